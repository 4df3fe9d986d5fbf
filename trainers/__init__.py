"""Training side of dvi: the online distillation recipe that turns the decision stream into better drafters.

`trainers.recipe` (the `Trainer`) wires the parts together; `trainers.students` holds the modules it optimises (a
drafter answering at teacher positions, EAGLE-3's unrolled steps and loss), `trainers.gate` the held-out figures the
gate compares, `trainers.losses` the objective's maths,
`trainers.data` turns records into batches and keeps the replay buffer, ledger and offsets, `trainers.intake` says
what a record is to the trainer, `trainers.state` holds its counters and a checkpoint's state, `trainers.triggers`
decides when to train, `trainers.ds` builds the DeepSpeed engine, `trainers.checkpoint` writes its checkpoints,
`trainers.publishing` writes, registers and announces a published version and `trainers.telemetry` reads the system
and source figures it reports.
MLflow tracking is `dvi.tracking`'s, the Kafka side `streams`', and the command line (`dvi train`, `dvi retrain`,
`dvi drafter distill`) `dvi.cli.train`'s.
"""
