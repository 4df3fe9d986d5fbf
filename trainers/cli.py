"""`dvi train`, `dvi retrain`, `dvi drafter distill` and `dvi mlflow`: parse, build typed config, run the recipe.

`dvi train` is the long-running trainer: a member of consumer group `trainer.group_id` on the decisions topic,
training while its trigger (`trigger=continuous|threshold|schedule|manual`) says so. One process with plain
`python`/`dvi`; several with `deepspeed --no_local_rank --module dvi.cli train ...`. `dvi retrain` asks
running trainers for a session on the control topic. `dvi drafter distill` runs the same recipe offline over
every record on a topic (from the beginning, with a group of its own) or in a JSON-lines file, and stops when it
is idle (or after --steps). This module
knows the command line, not the recipe's insides.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import uuid

from dvi.config import flat_params
from dvi.errors import DviError

log = logging.getLogger("dvi.trainer")


def _trainer(cfg, *, group_id: str, offline: bool, verbose: bool, dead_letter: bool = True):
    """The recipe wired to the stream, the control topic and MLflow."""
    from streams import control
    from streams.client import quiet_kafka_logs
    from streams.consumer import DecisionConsumer
    from streams.topics import ensure_topics
    from trainers.recipe import Trainer
    from trainers.tracking import Tracker

    quiet_kafka_logs(verbose)
    ensure_topics(cfg.stream)
    source = DecisionConsumer(cfg.stream, group_id=group_id, from_beginning=True, dead_letter=dead_letter, client_id="dvi-trainer")
    reader = control.ControlReader(cfg.stream)
    tracker = Tracker(cfg.tracking, run_name=f"{'distill' if offline else 'train'}-{time.strftime('%Y%m%d-%H%M%S')}",
                      params=flat_params(cfg), tags={"dvi.role": "distill" if offline else "trainer", "dvi.trigger": cfg.trigger.kind})
    publish = lambda kind, **fields: control.send(cfg.stream, kind, **fields)  # noqa: E731
    return Trainer(cfg, source, tracker=tracker, control=reader, publisher=publish, offline=offline), (source, reader, tracker)


def _file_trainer(cfg, path: str):
    """The recipe over a file of records: no broker needed; MLflow and the store as configured."""
    from trainers.data import FileSource
    from trainers.recipe import Trainer
    from trainers.tracking import Tracker

    source = FileSource(path)
    tracker = Tracker(cfg.tracking, run_name=f"distill-{time.strftime('%Y%m%d-%H%M%S')}", params=flat_params(cfg),
                      tags={"dvi.role": "distill", "dvi.source": str(source.path)})
    return Trainer(cfg, source, tracker=tracker, offline=True), (source, None, tracker)


def _run(trainer, parts) -> dict:
    source, reader, tracker = parts
    try:
        counters = trainer.run()
    finally:
        if reader is not None:
            reader.close()
        source.close()
        stats = tracker.close()
        if stats.dropped:
            log.warning("MLflow: %d metric points were lost while it was unreachable", stats.dropped)
    return {"step": trainer.state.step, "serving": trainer.state.lineage[-1], **counters.to_dict(),
            "dead_lettered": source.stats.dead_lettered}


def cmd_train(args: argparse.Namespace) -> int:
    from dvi.cli import overrides_of
    from dvi.config import load_config

    cfg = load_config(overrides_of(args))
    trainer, parts = _trainer(cfg, group_id=cfg.trainer.group_id, offline=False, verbose=args.verbose)
    print(f"dvi train: distilling from {cfg.stream.topic} at {cfg.stream.bootstrap} (group {cfg.trainer.group_id}, trigger "
          f"{cfg.trigger.kind}), drafter {trainer.state.lineage[-1]}; Ctrl-C stops it", flush=True)
    print(_summary(_run(trainer, parts)))
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dvi.cli import overrides_of
    from dvi.config import load_config

    cfg = load_config(overrides_of(args))
    run_dir = cfg.trainer.run_dir or os.path.join(os.path.expanduser(cfg.model.cache_dir or "~/.cache/dvi"), "distill", uuid.uuid4().hex[:8])
    trainer = replace(cfg.trainer, run_dir=run_dir, idle_exit_s=cfg.trainer.idle_exit_s or args.idle)
    if args.steps:  # epochs over what the topic holds: keep stepping on replayed records until `steps`
        trainer = replace(trainer, max_steps=args.steps, replay_when_idle=True, idle_exit_s=None)
    cfg = replace(cfg, trainer=trainer, trigger=replace(cfg.trigger, kind="continuous"))
    if args.file:
        trainer, parts = _file_trainer(cfg, args.file)
    else:  # a group of its own, read from the beginning: every record on the topic, whatever the serving trainers did
        trainer, parts = _trainer(cfg, group_id=f"dvi-distill-{uuid.uuid4().hex[:8]}", offline=True, verbose=args.verbose,
                                  dead_letter=False)
    result = _run(trainer, parts)
    print(_summary(result))
    print(trainer.state.serving_dir)
    return 0


def cmd_retrain(args: argparse.Namespace) -> int:
    from dvi.cli import overrides_of
    from dvi.config import load_config
    from streams import control

    cfg = load_config(overrides_of(args))
    msg = control.send(cfg.stream, control.RETRAIN, reason=args.reason or "dvi retrain")
    print(f"retrain requested on {cfg.stream.control_topic} at {cfg.stream.bootstrap} ({msg['reason']})")
    return 0


def _summary(r: dict) -> str:
    return (f"step {r['step']}: {r['trained']} records trained, {r['held_out']} held out, {r['skipped']} skipped, "
            f"{r['duplicates']} duplicates, {r['nonfinite']} non-finite batches; {r['published']} published, "
            f"{r['refused']} refused by the gate; serving {r['serving']}")


def register(sub: argparse._SubParsersAction) -> None:
    from trainers.mlflow_server import cmd_mlflow

    t = sub.add_parser("train", help="the online distillation trainer (DeepSpeed), fed by the decision stream")
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("retrain", help="ask running trainers for a training session (control topic)")
    r.add_argument("--reason", help="a note for the trainer's log")
    r.set_defaults(func=cmd_retrain)
    m = sub.add_parser("mlflow", help="run the local MLflow server (SQLite + local artifacts) on 127.0.0.1:tracking.port")
    m.set_defaults(func=cmd_mlflow)
    drafter = sub.choices["drafter"]._subparsers._group_actions[0]
    d = drafter.add_parser("distill", help="distill the drafter offline from every record on the decisions topic, then publish")
    d.add_argument("--idle", type=float, default=10.0, help="stop after this many seconds without a fresh record")
    d.add_argument("--file", help="a JSON-lines file of records (`dvi stream tail --json --from-beginning > FILE`) instead of the topic")
    d.add_argument("--steps", type=int, help="train exactly this many steps, replaying records once all were read")
    d.set_defaults(func=cmd_distill)
