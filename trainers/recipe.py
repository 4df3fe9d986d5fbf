"""The distillation recipe: the drafter learns from the decision stream, and better drafters are published.

`Trainer.run()` reads top to bottom as setup -> loop (ingest, step, checkpoint, gate and publish) -> cleanup:

- setup: the drafter under training is `Trainer.student` (a DeepSpeed engine over a `PositionLM`, a causal LM
  whose forward returns logits only at the teacher positions, or, for an EAGLE-3 drafter (`dvi.eagle3`), an
  `Eagle3PositionLM`, which drafts from the target's features and trains on `trainer.eagle3_ttt_steps` unrolled
  drafting steps). The features are those serving sent with the records (`trainer.features` records or auto: the
  trainer holds no copy of the target, and shares the target's embedding, read alone from its files), or those its
  own frozen copy of the target computes, `Trainer.features_target` (recompute, or auto for records without them
  where the target is loaded; in `trainer.features_dtype`: serving's, bf16 where the hardware has it). The target is
  loaded only where something needs it; `Trainer.teacher_lm` is then the teacher for records logged without top-k.
  `Trainer.baseline` is a frozen copy of the drafter now serving, the gate's baseline. The step runs in
  `trainer.precision` (bf16-mixed on a CPU with native bf16: `torch.autocast` over fp32 weights). A complete
  checkpoint in the run directory is resumed from;
- ingest: records from the source (a consumer group, or a file) arrive validated by the record codec; records
  for another target vocabulary or without generated tokens are counted as `foreign` and set aside, records this
  trainer cannot train (no features and no target to compute them: `no_features`; no top-k and no target:
  `no_teacher`) are skipped and counted; the rest are deduplicated by record id (the `Ledger`, each id with its
  `Fate`), routed by prompt to the gate's held-out set or the fresh queue (`trainers.data.Buffer`), and counted by
  the trigger's rolling acceptance;
- step: while the trigger says the trainer is active, a batch of fresh records (plus a replayed share) is
  packed and the drafter takes one DeepSpeed step on `trainers.losses.position_loss` (divergence to the
  teacher + the DVI reward term on the KL-to-reward schedule). A batch short of `trainer.batch_tokens` (the stream
  paused) steps at the share of `trainer.lr` it fills (`partial_lr`). A non-finite loss skips the batch (counted). On a
  GPU (`trainer.batch_ahead`) the next batch is taken and built on a thread while the step runs (`trainers.data.Ahead`);
  its records stay in flight, uncommitted, until it is trained;
- checkpoint: every `trainer.checkpoint_every` steps, and every `trainer.checkpoint_every_s` seconds while records
  were done without a step (held out, skipped), a DeepSpeed checkpoint holding the ledger, the committable offsets
  and the lineage is written atomically (`trainers.checkpoint`); only then are the offsets committed, so a crash
  re-reads exactly the records the last checkpoint does not cover. A fresh record waits in the queue at most
  `trainer.pending_max_age_s` (by default half the stream's retention) and is then skipped: a waiting record holds
  its partition's committed offset back, and a restart must never resume from offsets the broker has removed;
- gate and publish: every `trainer.gate_every` steps, every `trainer.gate_every_s` seconds in which a step was
  taken (spaced further where the checks would take more than `trainer.gate_max_share` of the time), at the end
  of a triggered session and at once on a retrain request under the continuous trigger, the candidate's
  acceptance on held-out records, as the serving engine realizes it (`trainer.gate_rule`), is compared with the
  baseline's, over all held-out records or on one domain's (`trainers.gate.judge`; the first
  `trainer.holdout_first` prompts of each domain are all held out, so the first gate can run within minutes, and
  one soon after traffic drifts to a new domain; the baseline's figures are kept per record while it serves, so a
  check evaluates it on the records new to the held-out set only); only a better candidate is written
  to the model store (`dvi.store`), registered in MLflow (alias `candidate`, through the tracker it is handed)
  and announced as a `dvi.control.DrafterPublished` through the publisher it is handed. `Trainer.published`
  lists the versions published in this run.

Control messages are `dvi.control`'s typed messages, read from the control reader it is handed:
`RetrainRequested` starts a session (continuous trigger: a gate and publish attempt now); `DrafterRejected` (a replica rolled a version back) puts the previous
drafter back as the gate's baseline and records the verdict `store.REJECTED` in the model store;
`DrafterPromoted` records `store.PRODUCTION`.

The same recipe runs offline (`dvi drafter distill`) over a topic read from the beginning by a group of its
own, or over a file of records, stopping when it is idle.

Under `dvi up`'s pause policy serving gives the trainer turns on the CPU (`turns`, a `dvi.busy.TurnTaker`): while the
loop waits for records with nothing to do (nothing fresh to train on, or its trigger not active) it says so, and the
turn ends early; in its turn a short batch steps at once rather than after the stream's one-second pause.

Every decision (a trigger fired, a retrain request acknowledged, a gate passed, refused or not run for lack of
held-out records, a publish, its consumer group joined) is one line on the logger `dvi.decision.trainer`, which the CLI shows at its default
level; the counters go to the tracker after every gate and every `COUNTERS_EVERY_S`. This module knows records, DeepSpeed (through
`trainers.ds`) and the model store; the modules it trains and their losses are `trainers.students`', picked for the
drafter's kind by `trainers.student_kinds`, the gate's figures
`trainers.gate`'s, the maths is in `trainers.losses`, the record layout in `trainers.data`, what a record is to this
trainer in `trainers.intake`, the counters and checkpoint state in `trainers.state`, checkpoint files in
`trainers.checkpoint`, a version's store write, registration and announcement in `trainers.publishing`, the system
and source figures in `trainers.telemetry`. It does not know Kafka or MLflow clients: its source, control
reader, publisher and tracker are passed in.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from dvi import store
from dvi.alloc import release_free
from dvi.config import DviConfig, learning_rate
from dvi.control import DrafterPromoted, DrafterRejected, RetrainRequested
from dvi.drafter_kinds import kind_of_dir
from dvi.errors import DviError
from dvi.hardware import resolve_device, resolve_dtype
from dvi.models import Drafter, cache_dir, load_causal_lm, untrained
from dvi.pairs import load_any_drafter, pair_dirs, resolve_pair
from dvi.records import Delivered
from trainers import anchor, checkpoint, ds
from trainers.data import Ahead, Buffer, Example, Fate, Item, Ledger, Offsets, pending_age_limit
from trainers.gate import Figures, evaluate_each, gate_rule, judge, pooled, teacher_for
from trainers.intake import Intake
from trainers.losses import kl_reward_weights, partial_lr
from trainers.publishing import announce, record_verdict, version_meta, write_version
from trainers.state import Counters, State, merged, rank_part, restore
from trainers.student_kinds import student_kind
from trainers.students import PositionLM, autocast, params_finite
from trainers.telemetry import source_counts, source_lag, system_metrics
from trainers.triggers import Claim, Trigger, batch_ready, next_gate_in, release_due

log = logging.getLogger("dvi.trainer")
decision = logging.getLogger("dvi.decision.trainer")  # one line per decision, shown at the CLI's default level
JOINED = "joined its consumer group"  # the decision line once a group member's source has partitions to read

COUNTERS_EVERY_S = 30.0  # the counters go to the tracker at least this often while the trainer runs


class Trainer:
    """One trainer process. `run()` until stopped; see the module docstring."""

    def __init__(self, cfg: DviConfig, source, tracker=None, control=None, publisher=None, offline: bool = False,
                 turns=None):
        """source: a `streams.consumer.DecisionConsumer`, a `trainers.data.FileSource` (anything whose poll returns
        `dvi.records.Delivered`); tracker: a `dvi.tracking.Tracker` or None; control: a
        `streams.control.ControlReader` (its poll returns `dvi.control` messages) or None; publisher: a callable
        taking one `dvi.control` message (a `DrafterPublished`), or None; offline: stop when idle; turns: where serving
        gives it turns on the CPU (`dvi up`'s pause policy), a `dvi.busy.TurnTaker`: its `idle(bool)` is told whether the
        loop waits with nothing to do (nothing fresh to train on, or the trigger not active: the turn ends), and while
        `has_turn()` a short batch steps at once (serving waits for it: no record comes until it stops), and its
        `claim(fraction)` is told how much of its share of serving's busy time it claims (`trainers.triggers.Claim`);
        else None."""
        self.cfg, self.tcfg = cfg, cfg.trainer
        self.source, self.tracker, self.control, self.publisher, self.offline = source, tracker, control, publisher, offline
        self.say_idle: Callable[[bool], None] = turns.idle if turns is not None else (lambda idle: None)
        self.has_turn: Callable[[], bool] = turns.has_turn if turns is not None else (lambda: False)
        self.say_claim: Callable[[float], None] = turns.claim if turns is not None else (lambda fraction: None)
        self.pausing = turns is not None
        torch.manual_seed(self.tcfg.seed)
        self.rank, self.world = ds.init_distributed()
        self.cache = cache_dir(cfg.model)
        self.run_dir = Path(self.tcfg.run_dir).expanduser() if self.tcfg.run_dir else self.cache / "trainer"
        self.store = store.default_root(cfg)
        drafter = self._setup_models()
        self._setup_student(drafter.model)
        last = self._resume()
        self.anchor = self._setup_anchor()
        self._setup_loop()
        if last is None:
            self.checkpoint()  # step 0: there is always a complete checkpoint to roll back to

    # -- setup -----------------------------------------------------------------------------------

    def _setup_models(self) -> Drafter:
        """The drafter to train (returned), the vocabulary its records must use, and the trainer's copy of the target
        where something needs it; what the auto settings picked is said once, at the default level."""
        model_cfg, t = self.cfg.model, self.tcfg
        device = resolve_device(model_cfg.device)
        self.precision = ds.resolve_precision(self.tcfg, device.type)  # bf16 (GPU), bf16-mixed (CPU with native bf16), fp32
        if model_cfg.dtype == "auto" and device.type == "cpu":
            model_cfg = replace(model_cfg, dtype="float32")  # fp32 weights on a CPU (bf16-mixed: bf16 products, autocast)
        self.kind = student_kind(kind_of_dir(pair_dirs(model_cfg)[1]).name)  # what the trainer trains, and how
        # the trainer's copy of the target, only where something needs it (trainer.features, trainer.teacher): the
        # teacher of records logged without top-k, the drafter's features where records do not carry them
        with_target = t.teacher == "logits" or (t.features == "recompute" and (self.kind.reads_features or t.teacher == "auto"))
        pair = resolve_pair(model_cfg, with_drafter=True, over_target=True, target_weights=with_target)
        self.target_dir, self.vocab_size = pair.target_dir, int(pair.target.config.vocab_size)
        self.target = pair.target.eval().requires_grad_(False) if with_target else None
        # without the target, the drafter shares what it reads of it (an EAGLE-3 drafter's embedding) from its files
        self.embed = self.kind.shared_embedding(self.target_dir) if not with_target else None
        drafter = pair.drafter
        if not with_target:  # loaded on the CPU beside the target's skeleton: the trainer's own drafter
            drafter = load_any_drafter(pair.drafter_dir, self.vocab_size, resolve_dtype(model_cfg.dtype, device), device,
                                       embed=self.embed)
        self.vocab_map = None if drafter.vocab_map is None else drafter.vocab_map.to(device)
        self.state = State(lineage=[drafter.version], serving_dir=str(pair.drafter_dir))
        self.initial_dir = pair.drafter_dir  # serves again if every published version is rejected
        # trainer.lr=auto: a trained drafter is fine-tuned at a lower rate than an untrained one is trained
        self.tcfg = t = replace(t, lr=learning_rate(t.lr, untrained(pair.drafter_dir)))
        self.teacher_lm = PositionLM(self.target) if self.target is not None and t.teacher in ("auto", "logits") else None
        # the drafter's features from the records (trainer.features records or auto), else from the target
        self.takes_features = self.kind.reads_features and t.features != "recompute"
        layer_ids, self.feature_width = self.kind.features(drafter)
        # the target for the drafter's features: in the dtype serving computes them in (a copy where that differs)
        self.features_target = self.kind.features_target(
            self.target, self.cfg.model.dtype if t.features_dtype == "auto" else t.features_dtype, device)
        self.intake = Intake(self.vocab_size, t.max_seq_len, t.reward_penalty, self.kind.reads_features,
                             self.takes_features, layer_ids, self.feature_width, self.features_target is not None,
                             self.teacher_lm is not None)
        self.gate_rule = gate_rule(self.cfg)
        decision.info("training %s at lr %g, precision %s, features %s, gate rule %s", self.kind.drafter.description,
                 t.lr, self.precision, ("from records" + (", else recomputed" if self.features_target is not None else ""))
                 if self.takes_features else ("recomputed by the trainer's copy of the target" if self.kind.reads_features else "none"),
                 self.gate_rule)
        return drafter

    def _setup_student(self, model: torch.nn.Module) -> None:
        """The DeepSpeed engine training the drafter's module `model` (`Trainer.student`), on the precision and
        adapters the config asks for, and the batch builder and ledger beside it."""
        if self.tcfg.finetune == "lora":
            model = ds.apply_lora(model, self.tcfg)
        if self.precision in ("fp32", "bf16-mixed"):
            model = model.float()  # model.dtype may have loaded it in bf16 (a GPU's default); fp32 training keeps fp32 weights
        self.student = ds.build_engine(self._position_lm(model), self.tcfg)  # the DeepSpeed engine training the drafter
        self.device = next(self.student.module.parameters()).device
        self.ahead = Ahead(self.device, self.tcfg.batch_ahead)  # (on a GPU) the next batch is built while a step runs
        self.ledger = Ledger(self.tcfg.ledger_size)
        self.published: list[str] = []  # versions this trainer published in this run, oldest first

    def _resume(self) -> Path | None:
        """Resume from the last complete checkpoint in the run directory, if there is one (returned); the gate's
        baseline is then the drafter serving."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        last = checkpoint.latest(self.run_dir)
        if last is not None:
            saved = checkpoint.load(self.student, last)
            self._restore(saved)
            log.info("resumed from %s at step %d (%d records in the ledger)", last, self.state.step, len(self.ledger))
        self.baseline = self._baseline_model()
        return last

    def _setup_anchor(self) -> anchor.Anchor | None:
        """The bootstrap's held-out slice the gate keeps beside live traffic (`trainer.anchor`, `trainers.anchor`), read
        and checked now; its features and start figures come when a gate first needs them (`_anchor_start`), so they
        do not hold the trainer's start back. A slice that does not read, or does not fit this target, is said and left
        out: the trainer runs on without it."""
        try:
            path = anchor.resolve(self.cfg)
            records = anchor.read(path, self.vocab_size) if path is not None else []
        except DviError as e:
            decision.warning("the held-out slice is left out: %s", e)
            return None
        records = [r for r in records if self.intake.foreign(r) is None]
        if not records:
            if path is not None:
                decision.warning("the held-out slice is left out: %s holds no record for this target", path)
            return None
        kept = anchor.Anchor(path, [self.intake.example(r) for r in records], [r.domain or "" for r in records])
        decision.info("held-out slice of the bootstrap: %d records (%d positions) from %s, kept beside the live held-out "
                      "records: a candidate more than %g below the starting drafter's acceptance on it is refused",
                      len(records), kept.positions, path, self.tcfg.anchor_max_drop)
        return kept

    def _anchor_start(self, kept: anchor.Anchor) -> None:
        """The slice's examples with the target's features where the drafter reads them (computed once, by a copy of the
        target loaded for that alone where the trainer holds none), and the figures of the drafter the run started
        from on it (`Anchor.start`)."""
        if self.kind.reads_features:
            target = self.features_target
            if target is None:  # the trainer holds no copy of the target: one for these features alone
                dtype = self.cfg.model.dtype if self.tcfg.features_dtype == "auto" else self.tcfg.features_dtype
                target = load_causal_lm(self.target_dir, "target", resolve_dtype(dtype, self.device), self.device)
            kept.examples = anchor.with_features(kept.examples, target, self.intake.layer_ids)
            del target
            release_free()
        kept.start = self._anchor_figures(kept, self._drafter_module(self.initial_dir))
        decision.info("held-out slice of the bootstrap: the starting drafter's acceptance on it %.4f (%s rule)",
                      kept.start["all"]["realized"], self.gate_rule)

    def _anchor_figures(self, kept: anchor.Anchor, module) -> dict[str, dict]:
        """`module`'s figures on the held-out slice `kept`, pooled per domain and in all ("all")."""
        each = evaluate_each(module, kept.examples, self.vocab_size, self.vocab_map, self.teacher_lm,
                             self.tcfg.batch_tokens, self.gate_rule, self.precision)
        return {d: pooled(f) for d, f in kept.by_domain(each).items()}

    def _setup_loop(self) -> None:
        """The loop's queues, trigger and clocks: the fresh, held-out and replayed records, the offsets and record ids
        in flight, and when the last checkpoint, gate, counters and memory release were."""
        t = self.tcfg
        self.buffer = Buffer(t.pending_size, t.replay_size, t.holdout_size, t.replay_share, t.holdout_share,
                             t.version_decay, t.max_version_age, seed=t.seed, holdout_first=t.holdout_first,
                             replay_bytes=int(t.replay_mb * (1 << 20)), holdout_bytes=int(t.holdout_mb * (1 << 20)),
                             pending_bytes=int(t.pending_mb * (1 << 20)))
        self.offsets = Offsets()
        self.inflight: set[str] = set()  # ids read but not yet done (waiting in the fresh queue)
        self.trigger = Trigger(self.cfg.trigger, time.monotonic())
        self.stop_requested = False
        self.started_at = self.last_record_at = time.monotonic()
        self.joined = False  # a group member's source has had partitions to read (said once)
        self.last_checkpoint_step = self.state.step
        self.checkpointed_at = time.monotonic()
        self.committed: dict = {}  # the offsets the last checkpoint committed (a time checkpoint is due when they moved)
        self.pending_max_age_s = pending_age_limit(t.pending_max_age_s, self.cfg.stream.retention_hours)
        self.expired_since_log = 0
        self.expired_logged_at = 0.0
        self.checkpoint_ok = True  # the last checkpoint written (or resumed from) is complete
        self.last_gate: dict = {}  # the last gate check: step, time, outcome and figures (for the tracker and status)
        self.claim = Claim(t.pause_share_min / t.pause_share if t.pause_share else 1.0)  # of serving's busy time (turns)
        self.first_gate: dict = {}  # the first gate check run in this process
        self.last_gate_step = self.state.step
        self.next_gate_at = time.monotonic() + (t.gate_every_s or math.inf)
        self.counters_logged_at = self.released_at = time.monotonic()
        self.released_step = self.state.step

    def _restore(self, saved: dict) -> None:
        restore(self.state, saved, self.rank)  # this rank's own counters
        self.ledger = Ledger(self.tcfg.ledger_size, saved["ledger"])  # shared: partitions may move to another rank

    def _position_lm(self, model: torch.nn.Module) -> torch.nn.Module:
        """The drafter as a module answering at teacher positions (its kind's: `StudentKind.student`)."""
        return self.kind.student(model, self.features_target)

    def _baseline_model(self) -> PositionLM:
        """A frozen copy of the drafter now serving: the gate's baseline."""
        return self._drafter_module(self.state.serving_dir)

    def _drafter_module(self, drafter_dir) -> PositionLM:
        """A frozen copy of the drafter in `drafter_dir`, read onto the device and into the dtype of the drafter being
        trained, beside which the gate runs it."""
        like = next(self.student.module.parameters())
        drafter = load_any_drafter(drafter_dir, self.vocab_size, dtype=like.dtype, device=like.device,
                                   target=self.target, embed=self.embed)
        return self._position_lm(drafter.model.eval()).requires_grad_(False)

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> Counters:
        main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        stepped = False  # the last pass took a step: a backlog is being worked off, so the next poll does not wait
        try:
            while True:
                # waiting for records only when there was nothing to train: a step every pass over a backlog, not one
                # per poll timeout (what has arrived is read either way); said, while it waits with nothing to do
                self.say_idle(not stepped and not self._has_work(time.monotonic()))
                arrived = self.source.poll(timeout_s=0.0 if stepped else 0.5)
                if arrived:
                    self.say_idle(False)
                # a lost log first: records that came with the news are the new log's, and must not be forgotten
                for where in self.source.take_resets() if hasattr(self.source, "take_resets") else ():
                    self.offsets.forget(where)
                self.ingest(arrived)
                stepped = False
                self._expire()
                if not getattr(self.source, "assigned", True):  # still joining its group: not idle yet
                    self.last_record_at = time.monotonic()
                elif not self.joined and hasattr(self.source, "assigned"):
                    self.joined = True
                    decision.info("%s after %.0f s: reading the decision stream", JOINED, time.monotonic() - self.started_at)
                self._control()
                now = time.monotonic()
                reason = self.trigger.poll(now)
                if reason:
                    decision.info("trigger fired: %s", reason if reason.startswith(Trigger.FORCED) else f"training session starts: {reason}")
                if ds.from_rank0(bool(reason) and reason.startswith(Trigger.FORCED), self.world):
                    self.gate_and_publish(why="retrain requested")
                if time.monotonic() - self.counters_logged_at >= COUNTERS_EVERY_S:
                    self.log_counters()
                stop, go, due = self._agree(self._should_stop(), self.trigger.active(now), self._batch_ready(now),
                                            self._checkpoint_due(now))
                if stop:
                    break
                if due:  # records were done without a step (held out, skipped): commit them by time
                    self.say_idle(False)
                    self.checkpoint()
                if release_due(self.state.step, self.released_step, time.monotonic(), self.released_at):
                    release_free()  # what steps, checkpoints and gates freed
                    self.released_at, self.released_step = time.monotonic(), self.state.step
                if not go:
                    continue
                self.say_idle(False)
                before = self.state.step
                self.step()
                stepped = self.state.step > before
                if self.cfg.trigger.kind != "continuous":
                    self.trigger.step_done()
                if self.state.step % self.tcfg.checkpoint_every == 0:
                    self.checkpoint()
                session_over = ds.from_rank0(self.cfg.trigger.kind != "continuous" and self.trigger.session_over(), self.world)
                if session_over or self._gate_due():
                    published = self.gate_and_publish(why="session over" if session_over else "due")
                    if session_over:
                        self.trigger.end_session(time.monotonic(), published)
            if self.offline and self.state.step > self.last_gate_step:  # offline: the last steps get a gate too
                self.gate_and_publish(why="end of the offline run")
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.close()
        return self.state.counters

    def _agree(self, stop: bool, active: bool, ready: bool, due: tuple[bool, bool]) -> tuple[bool, bool, bool]:
        """(stop, step, checkpoint) agreed by every rank, one collective per loop: the trainers stop when every rank
        would stop (a rank that is done idles until the others are), rank 0's trigger decides whether they are
        active, and they step when any rank has a batch (the others join with a zero gradient: DeepSpeed's
        gradient all-reduce needs every rank in every step); a checkpoint by time is due when rank 0's clock says
        so and any rank has offsets to commit (`due`: (time, offsets))."""
        if self.world == 1:
            return stop, active and ready, all(due)
        flags = torch.tensor([-float(stop), float(active) if self.rank == 0 else 0.0, float(ready),
                              float(due[0]) if self.rank == 0 else 0.0, float(due[1])])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0] < 0), bool(flags[1] > 0) and bool(flags[2] > 0), bool(flags[3] > 0) and bool(flags[4] > 0)

    def _checkpoint_due(self, now: float) -> tuple[bool, bool]:
        """(the time for a checkpoint by time has come, this rank has offsets the last checkpoint did not commit)."""
        every = self.tcfg.checkpoint_every_s
        if every is None or now - self.checkpointed_at < every:
            return False, False
        return True, self._uncommitted()

    def _uncommitted(self) -> bool:
        """Whether a checkpoint now would commit offsets the last one did not."""
        return self._committable() != self.committed

    def _committable(self) -> dict:
        return self.offsets.committable({(tp[0], tp[1]): off for tp, off in self.source.positions().items()})

    def _on_signal(self, signum, frame) -> None:
        log.info("signal %d: finishing the current step, checkpointing and stopping", signum)
        self.stop_requested = True

    def _should_stop(self) -> bool:
        t = self.tcfg
        if self.stop_requested or (t.max_steps is not None and self.state.step >= t.max_steps):
            return True
        if t.max_seconds is not None and time.monotonic() - self.started_at >= t.max_seconds:
            log.info("trained for %.0f s (trainer.max_seconds): stopping", time.monotonic() - self.started_at)
            return True
        idle = time.monotonic() - self.last_record_at
        if t.idle_exit_s is not None and idle > t.idle_exit_s and not self.buffer.pending and not self.ahead.waiting:
            log.info("no fresh record for %.0f s: stopping", idle)
            return True
        return False

    def _gate_due(self) -> bool:
        """Every `gate_every` steps, or `gate_every_s` after the last gate (decided by rank 0's clock)."""
        due = self.state.step % self.tcfg.gate_every == 0 or time.monotonic() >= self.next_gate_at
        return ds.from_rank0(due and self.state.step > self.last_gate_step, self.world)

    def _batch_ready(self, now: float) -> bool:
        """A full batch of fresh positions is waiting, or some are and the stream paused for a second, or serving waits
        for this trainer's turn (no record comes meanwhile)."""
        if self.ahead.waiting:
            return True
        if not self.buffer.pending:
            return self.tcfg.replay_when_idle and bool(self.buffer.replay)
        budget = self.tcfg.batch_tokens * (1.0 - self.tcfg.replay_share)
        return batch_ready(self.buffer.pending_positions(), budget, now - self.last_record_at, self.has_turn)

    def _has_work(self, now: float) -> bool:
        """Whether there is anything to train now or once the batch fills: the trigger active and fresh records waiting
        (or a batch built ahead, or replay when idle)."""
        return self.trigger.active(now) and bool(self.ahead.waiting or self.buffer.pending
                                                 or (self.tcfg.replay_when_idle and self.buffer.replay))

    def ingest(self, delivered: list[Delivered]) -> None:
        """Take records the source read (validated by the record codec at the wire)."""
        c = self.state.counters
        for d in delivered:
            record, where = d.record, (d.topic, d.partition)
            if record.record_id in self.ledger or record.record_id in self.inflight:
                c.duplicates += 1
                self.offsets.seen(where, d.offset)
                if self.offline and self.tcfg.replay_when_idle:
                    self._rebuffer(record)
                continue
            why = self.intake.foreign(record)
            if why is not None:
                c.foreign += 1
                log.warning("record %s at %s[%d]@%d is not for this target: %s", record.record_id, d.topic, d.partition, d.offset, why)
                self.offsets.seen(where, d.offset)
                continue
            c.records += 1
            self.last_record_at = time.monotonic()
            self.trigger.observe(record.accepted, record.drafted, self.last_record_at)
            if self.claim.observe(record.accepted, record.drafted):
                self._reclaim(f"the acceptance of the last {Claim.WINDOW} records fell to {self.claim.acceptance:.3f} "
                              f"from {self.claim.acceptance_at:.3f} at the last refusal")
            example = self.intake.example(record)
            self.offsets.consumed(where, d.offset)
            self.inflight.add(record.record_id)
            lacks = self.intake.lacks(example)
            if lacks is not None:  # nothing to train it with: skipped, and counted by what it lacks
                self._done(example.record_id, where, d.offset, Fate.SKIPPED)
                c.skipped += 1
                setattr(c, lacks, getattr(c, lacks) + 1)
                continue
            c.with_features += example.features is not None
            fate, dropped = self.buffer.add(Item(example, where, d.offset, record.time))
            if fate == Fate.HELD_OUT:
                self._done(example.record_id, where, d.offset, Fate.HELD_OUT)
                c.held_out += 1
            for item in dropped:
                self._done(item.example.record_id, item.partition, item.offset, Fate.SKIPPED)
                c.skipped += 1

    def _rebuffer(self, record) -> None:
        """An offline run resumed over the records it read before (a file read again from its start): what the
        checkpoint's ledger says was trained goes back to replay, what was held out back to the gate's held-out set, so
        the epochs go on where they stopped; in a stream, a record seen again is only a duplicate."""
        fate = self.ledger.fate(record.record_id)
        if fate not in (Fate.TRAINED, Fate.HELD_OUT) or self.intake.foreign(record) is not None:
            return
        example = self.intake.example(record)
        if self.intake.lacks(example) is None:
            (self.buffer.holdout.append if fate == Fate.HELD_OUT else self.buffer.replay.append)(example)

    def _expire(self) -> None:
        """Skip the fresh records that have waited longer than the age limit (`pending_age_limit`)."""
        if self.pending_max_age_s is None:
            return
        expired = self.buffer.expire(time.time() - self.pending_max_age_s)
        for item in expired:
            self._done(item.example.record_id, item.partition, item.offset, Fate.SKIPPED)
        self.state.counters.skipped += len(expired)
        self.state.counters.expired += len(expired)
        self.expired_since_log += len(expired)
        if self.expired_since_log and time.monotonic() - self.expired_logged_at >= 60.0:
            log.warning("%d fresh records waited longer than %.0f s (trainer.pending_max_age_s; by default half of "
                        "stream.retention_hours) and were skipped untrained: the trainer is behind the stream",
                        self.expired_since_log, self.pending_max_age_s)
            self.expired_since_log, self.expired_logged_at = 0, time.monotonic()

    def _done(self, record_id: str, partition, offset: int, fate: Fate) -> None:
        self.inflight.discard(record_id)
        self.ledger.add(record_id, fate)
        self.offsets.done(partition, offset)

    def _control(self) -> None:
        """Act on the control messages sent since the last call (other kinds, e.g. DrafterPublished, are not ours)."""
        if self.control is None:
            return
        for msg in self.control.poll():
            if isinstance(msg, RetrainRequested):
                self.state.counters.retrains += 1
                decision.info("retrain requested (%s): acknowledged at step %d, trigger %s", msg.reason or "no reason given",
                              self.state.step, self.cfg.trigger.kind)
                self.trigger.request(time.monotonic())
                self._reclaim("retrain requested")
                if self.tracker is not None:
                    self.tracker.log_metrics({"count/retrains": self.state.counters.retrains}, step=self.state.step)
            elif isinstance(msg, DrafterRejected):
                self.rejected(msg.version, msg.reason)
                if self.rank == 0:
                    record_verdict(self.store, msg, store.REJECTED)
            elif isinstance(msg, DrafterPromoted) and self.rank == 0:
                record_verdict(self.store, msg, store.PRODUCTION)

    def rejected(self, version: str, reason: str) -> None:
        """A replica rolled back `version`: if it is the drafter the gate compares against, the one before it
        serves again, so the next candidate must beat that one (training goes on from the current weights)."""
        lineage = self.state.lineage
        if len(lineage) < 2 or lineage[-1] != version:
            return
        lineage.pop()
        previous = self.store / lineage[-1]
        self.state.serving_dir = str(previous if (previous / store.SUMS).is_file() else self.initial_dir)
        if self.rank == 0:
            self.baseline = self._baseline_model()
        log.warning("drafter %s was rejected by the replicas (%s): the gate compares against %s again", version,
                    reason or "no reason given", lineage[-1])
        self._reclaim(f"{version} rolled back")

    # -- one optimizer step ----------------------------------------------------------------------

    def _take(self) -> tuple[list[Item], list[Example], list[float]]:
        """The next batch's fresh items, replayed examples and the weights of all its examples."""
        fresh, replayed, weights = self.buffer.take(self.tcfg.batch_tokens, self.state.version_age)
        return fresh, [i.example for i in fresh] + replayed, [1.0] * len(fresh) + weights

    def step(self) -> None:
        t, c = self.tcfg, self.state.counters
        ahead = self.ahead.take()  # the batch built while the last step ran (trainer.batch_ahead), or None
        (fresh, examples, weights), batch = ahead if ahead is not None else (self._take(), None)
        if not examples and self.world == 1:  # nothing fresh, and nothing recent enough to replay
            return
        w_kl, w_reward = kl_reward_weights(self.state.step, t.reward_warmup, t.reward_ramp, t.reward_max)
        t0 = time.perf_counter()
        if examples:
            if batch is None:
                batch = self.ahead.build(examples, weights)
            if self.ahead.threaded and (self.buffer.pending or self.tcfg.replay_when_idle):
                following = self._take()  # built on the worker thread while this step runs on the device
                if following[1]:
                    self.ahead.submit(following, following[1], following[2])
            teacher = teacher_for(batch, self.vocab_size, self.vocab_map, self.teacher_lm)
            with autocast(self.device, self.precision):
                loss, metrics = self.kind.loss(self.student, batch, teacher, t, w_kl, w_reward, self.vocab_map)
        else:  # another rank has a batch: join its step with a zero gradient (every rank must step together)
            batch, metrics = None, {}
            loss = self.kind.zero_loss(self.student, self.device, self.feature_width)
        if not ds.on_every_rank(math.isfinite(loss.item()), self.world):  # every rank skips the backward together, or none does
            c.nonfinite += 1
            if not ds.on_every_rank(params_finite(self.student.module), self.world):
                self.rollback(f"step {self.state.step}: the drafter's weights are not finite")
                return
            log.warning("step %d: non-finite loss (%s): batch of %d records skipped", self.state.step, loss.item(), len(fresh))
            for item in fresh:
                self._done(item.example.record_id, item.partition, item.offset, Fate.SKIPPED)
            c.skipped += len(fresh)
            return  # no backward: nothing of this batch reaches the weights
        self.student.backward(loss)
        # a batch short of batch_tokens (the stream paused: `_batch_ready`) moves the weights in proportion to what it
        # holds: AdamW moves every weight by about lr whatever the batch, and a trained drafter's many small steps on a
        # few records each were a random walk away from it (`partial_lr`); over every rank's batch, so that all ranks
        # step at one rate and their weights stay the same
        held = ds.all_gathered({"positions": batch.positions if batch is not None else 0}, self.world)
        ds.set_lr(self.student, partial_lr(t.lr, sum(h["positions"] for h in held), t.batch_tokens * self.world))
        self.student.step()
        # a step that blew up never reaches a checkpoint or the store
        if not ds.on_every_rank(params_finite(self.student.module), self.world):
            c.nonfinite += 1
            self.rollback(f"step {self.state.step}: the optimizer step made the drafter's weights non-finite")
            return
        self.state.step += 1
        for item in fresh:
            self._done(item.example.record_id, item.partition, item.offset, Fate.TRAINED)
        self.buffer.trained([i.example for i in fresh])
        c.trained += len(fresh)
        if batch is None:
            return
        c.positions += batch.positions
        dt = time.perf_counter() - t0
        if self.tracker is not None and (self.state.step % t.log_every == 0 or self.state.step == 1):
            self.tracker.log_metrics({
                "loss": loss.item(), **{f"train/{k}": v for k, v in metrics.items()},
                "w_kl": w_kl, "w_reward": w_reward, "step_time_s": dt, "positions_per_s": batch.positions / dt,
                "records_per_s": len(fresh) / dt, "pending": len(self.buffer.pending),
            }, step=self.state.step)
            self.log_counters()  # with system/*: on a GPU, its busy share
        if self.state.step % t.log_every == 0:
            log.info("step %d: loss %.4f, acceptance %.3f, %d positions in %.2f s, %d records so far", self.state.step,
                     loss.item(), metrics["acceptance"], batch.positions, dt, c.records)

    def log_counters(self) -> None:
        """The counters, lag, trigger state and the gate's schedule to the tracker (`dvi status` reads them)."""
        self.counters_logged_at = time.monotonic()
        if self.tracker is None:
            return
        t = self.tcfg
        next_in = self.next_gate_at - time.monotonic() if t.gate_every_s else math.nan
        self.tracker.log_metrics({
            **{f"count/{k}": v for k, v in self.state.counters.to_dict().items()}, **source_lag(self.source),
            **{f"trigger/{k}": v for k, v in self.trigger.snapshot().items()},
            **({"trigger/busy_share": self.claim.value * t.pause_share} if self.pausing else {}),
            "holdout/records": len(self.buffer.holdout), "holdout/needed": t.gate_min_records,
            "gate/next_in_s": max(0.0, next_in), "gate/next_step": (self.state.step // t.gate_every + 1) * t.gate_every,
            "buffer/replay_mb": self.buffer.replay.nbytes / (1 << 20), "buffer/holdout_mb": self.buffer.holdout.nbytes / (1 << 20),
            "buffer/pending": len(self.buffer.pending), "buffer/pending_mb": self.buffer.pending_nbytes() / (1 << 20),
            **system_metrics(self._process, next(self.student.module.parameters()).device), **source_counts(self.source),
        }, step=self.state.step)

    @property
    def _process(self) -> psutil.Process:
        if not hasattr(self, "_proc"):
            self._proc = psutil.Process()
            self._proc.cpu_percent()  # the first reading is 0: start the interval now
        return self._proc

    # -- checkpoints -----------------------------------------------------------------------------

    def rollback(self, why: str) -> None:
        """Back to the last complete checkpoint: weights, optimizer, ledger and counters; the stream is re-read
        from the committed offsets, so records trained since then are trained again, once."""
        path = checkpoint.latest(self.run_dir)
        if path is None:
            raise DviError(f"{why}, and there is no complete checkpoint in {self.run_dir} to go back to")
        nonfinite = self.state.counters.nonfinite
        self._restore(checkpoint.load(self.student, path))
        self.state.counters.nonfinite = nonfinite  # what went wrong stays counted
        self.ahead.drop()  # its fresh records are read again, like those still pending
        self.buffer.clear_pending()
        if self.offline and self.tcfg.replay_when_idle:  # the records read again rebuild them from the restored ledger
            self.buffer.replay.clear()
            self.buffer.holdout.clear()
        self.offsets = Offsets()
        self.inflight.clear()
        self.source.rewind()
        log.warning("%s: rolled back to %s (step %d)", why, path, self.state.step)

    def checkpoint(self) -> Path | None:
        """Write a complete checkpoint, then commit the offsets it covers."""
        if not params_finite(self.student.module):
            raise DviError(f"step {self.state.step}: the drafter's weights are not finite; not checkpointing them "
                           "(restart resumes from the last complete checkpoint)")
        committable = self._committable()
        s = self.state
        self.checkpoint_ok = False
        state = merged(s, ds.all_gathered(rank_part(s.counters, self.ledger, committable), self.world))
        try:
            path = checkpoint.save(self.student, self.run_dir, s.step, state, keep=self.tcfg.keep_checkpoints)
        except (OSError, RuntimeError) as e:  # torch reports a failed write (ENOSPC) as a RuntimeError
            s.counters.checkpoint_failures += 1
            log.error("step %d: the checkpoint could not be written (%s: %s); the last complete one (%s) stands, no "
                      "offsets are committed and nothing is published until a checkpoint succeeds",
                      s.step, type(e).__name__, str(e).splitlines()[0] if str(e) else "", checkpoint.latest(self.run_dir, clean=False))
            if self.tracker is not None:
                self.tracker.log_metrics({"count/checkpoint_failures": s.counters.checkpoint_failures}, step=s.step)
            self.checkpointed_at = time.monotonic()  # a checkpoint by time is tried again checkpoint_every_s later
            return None
        self.checkpoint_ok = True
        self.last_checkpoint_step, self.checkpointed_at = s.step, time.monotonic()
        if committable and self.source.group_id is not None:
            try:
                self.source.commit(committable)
            except Exception as e:  # broker down: the checkpoint stands; redelivered records meet the ledger
                log.warning("checkpoint %s is complete but committing its offsets failed (%s: %s); they are "
                            "committed with the next checkpoint", path.name, type(e).__name__, e)
                return path
        self.committed = committable
        return path

    # -- gate and publish ------------------------------------------------------------------------

    def gate_and_publish(self, why: str = "due") -> bool:
        """Publish the candidate if it beats the baseline (the serving drafter) on the held-out records; True if published.
        Every rank calls it: rank 0 gates and writes the version, the others follow its lineage. `why` names what
        asked for the gate in its log line; the counters go to the tracker afterwards."""
        self.last_gate_step = self.state.step
        started = time.monotonic()
        if self.tcfg.gate_every_s:
            self.next_gate_at = started + self.tcfg.gate_every_s
        if not self.checkpoint_ok:  # a version published now could not be resumed from after a crash
            decision.warning("gate at step %d (%s): not run: the last checkpoint failed", self.state.step, why)
            return False
        gate = self._gate(why) if self.rank == 0 else None
        if self.tcfg.gate_every_s:  # a slow check (a full held-out set) spaces the next ones out
            self.next_gate_at = started + next_gate_in(self.tcfg.gate_every_s, time.monotonic() - started, self.tcfg.gate_max_share)
        gate, refused = ds.from_rank0((gate, self.rank == 0 and self.last_gate.get("outcome") == "refused"), self.world)
        published = gate is not None and self.publish(gate)
        if refused:
            self._reclaim(f"{self.claim.refused + 1} gate{'s' if self.claim.refused else ''} in a row refused the candidate",
                          refused=True)
        elif published:
            self._reclaim(f"{self.published[-1]} published")
        self.log_counters()
        return published

    def _reclaim(self, why: str, refused: bool = False) -> None:
        """The claim on serving's busy time (`trainers.triggers.Claim`) after a gate refused the candidate (`refused`), or
        all of it again (`why` says what restored it); told to the supervisor, and in a decision line where it changed
        under `dvi up`'s pause policy."""
        before = self.claim.value
        if refused:
            self.claim.refusal()
        else:
            self.claim.restore()
        after = self.claim.value
        self.say_claim(after)
        if after != before and self.pausing and self.tcfg.pause_share:
            decision.info("claims %.3g%% of serving's busy time now (%.3g of trainer.pause_share %g): %s",
                          100 * after * self.tcfg.pause_share, after, self.tcfg.pause_share, why)

    def _gate(self, why: str) -> dict | None:
        """Gate metrics when the candidate wins, else None (refusals are counted and logged)."""
        holdout = list(self.buffer.holdout)
        at = f"gate at step {self.state.step} ({why})"
        if len(holdout) < self.tcfg.gate_min_records:
            decision.info("%s: not run: %d held-out records of the %d needed", at, len(holdout), self.tcfg.gate_min_records)
            self.last_gate = {"step": self.state.step, "time": time.time(), "outcome": "waiting for held-out records"}
            return None
        self.state.counters.gates += 1
        cand_each = evaluate_each(self.student.module, holdout, self.vocab_size, self.vocab_map, self.teacher_lm,
                                  self.tcfg.batch_tokens, self.gate_rule, self.precision)
        base_each = self._baseline_figures(holdout)
        cand, base = pooled(cand_each), pooled(base_each)
        verdict = judge(cand_each, base_each, [e.domain for e in holdout], self.tcfg.min_gain, self.tcfg.gate_min_records,
                        self.tcfg.gate_by_domain)
        # the gate ranks on acceptance as the serving engine realizes it (trainer.gate_rule); the others are reported
        gate = {"candidate_acceptance": cand["realized"], "serving_acceptance": base["realized"],
                "candidate_expected": cand["acceptance"], "serving_expected": base["acceptance"],
                "candidate_greedy": cand["greedy"], "serving_greedy": base["greedy"], "holdout_records": len(holdout)}
        gains, finite = verdict.passes, params_finite(self.student.module)
        holds = True
        if gains and finite and self.anchor is not None:  # what adapting cost on the bootstrap's held-out slice
            if not self.anchor.start:
                self._anchor_start(self.anchor)
            kept = self._anchor_figures(self.anchor, self.student.module)
            gate.update(anchor.gate_figures(kept, self.anchor.start))
            holds = anchor.holds(gate["anchor_acceptance"], gate["anchor_start"], self.tcfg.anchor_max_drop)
        passed = gains and finite and holds
        if self.tracker is not None:
            per_domain = {f"gate/domain/{d}/{who}": v for d, (c, b, _) in verdict.domains.items()
                          for who, v in (("candidate_acceptance", c), ("serving_acceptance", b))}
            self.tracker.log_metrics({**{f"gate/{k}": v for k, v in gate.items()}, **per_domain, "gate/passed": float(passed)},
                                     step=self.state.step)
        self.last_gate = {"step": self.state.step, "time": time.time(), "outcome": "passed" if passed else "refused", **gate,
                          "won_on_domain": verdict.domain,
                          "domains": {d: {"candidate_acceptance": c, "serving_acceptance": b, "holdout_records": n}
                                      for d, (c, b, n) in verdict.domains.items()}}
        self.first_gate = self.first_gate or self.last_gate  # its serving figures: the drafter this run started from
        figures = (f"candidate {cand['realized']:.4f} vs serving {self.state.lineage[-1]} {base['realized']:.4f} "
                   f"({self.gate_rule} rule; expected {cand['acceptance']:.4f} vs {base['acceptance']:.4f}; "
                   f"min gain {self.tcfg.min_gain:g}) on {len(holdout)} held-out records"
                   + "".join(f"; {d}{' (won on)' if d == verdict.domain else ''} {c:.4f} vs {b:.4f} on {n}"
                             for d, (c, b, n) in verdict.domains.items()))
        if not gains:
            self.state.counters.refused += 1
            decision.info("%s: refused: %s", at, figures)
            return None
        if not finite:
            decision.warning("%s: refused: the candidate's weights are not finite", at)
            return None
        if not holds:
            self.state.counters.refused += 1
            decision.info("%s: refused: %s; but on the bootstrap's held-out slice its acceptance is %.4f, more than %g "
                          "below the starting drafter's %.4f (trainer.anchor_max_drop)", at, figures,
                          gate["anchor_acceptance"], self.tcfg.anchor_max_drop, gate["anchor_start"])
            return None
        decision.info("%s: passed: %s", at, figures)
        return gate

    @property
    def baseline(self) -> PositionLM:
        """A frozen copy of the drafter now serving: the gate's baseline."""
        return self._baseline

    @baseline.setter
    def baseline(self, model: PositionLM) -> None:
        self._baseline, self._baseline_each = model, {}  # the old one's figures go with it

    def _baseline_figures(self, holdout: list[Example]) -> list[Figures]:
        """The baseline's figures on each held-out record. A record's stand while the baseline does: only records new
        to the held-out set are evaluated (a gate of an EAGLE-3 drafter runs the target on them), and those that
        left it are forgotten."""
        known = self._baseline_each
        new = [e for e in holdout if e.record_id not in known]
        if new:
            figures = evaluate_each(self.baseline, new, self.vocab_size, self.vocab_map, self.teacher_lm, self.tcfg.batch_tokens,
                                    self.gate_rule, self.precision)
            known.update((e.record_id, f) for e, f in zip(new, figures, strict=True))
        self._baseline_each = {e.record_id: known[e.record_id] for e in holdout}
        return [known[e.record_id] for e in holdout]

    def publish(self, gate: dict) -> bool:
        """Write the candidate as a new version (rank 0: store, registry, publisher); every rank then takes it as the
        serving drafter (the gate's next baseline), adds it to `published` and checkpoints, since the lineage moved
        and a restart must know which drafter serves. False when the store could not take it (nothing was
        announced, the lineage stays)."""
        parent = self.state.lineage[-1]
        weights = ds.merged_state_dict(self.student.module.model)  # collective under ZeRO-3
        written = None
        if self.rank == 0:
            version = store.next_version(self.store)
            meta = version_meta(self.state, self.offsets.committable(), gate)
            written = write_version(self.store, version, weights, Path(self.state.serving_dir), meta, self.vocab_map)
        if self.rank == 0 and written is not None:
            decision.info("%s published (parent %s, step %d, %d records trained): held-out acceptance %.4f -> %.4f (%s rule); %s",
                          version, parent, self.state.step, self.state.counters.trained, gate["serving_acceptance"],
                          gate["candidate_acceptance"], self.gate_rule, written.path)
            announce(written, meta, self.state, gate, self.tracker, self.publisher)
            self.state.counters.published += 1
        shared = ds.from_rank0((written.version, str(written.path)) if written else None, self.world)
        if shared is None:
            return False
        version, path = shared
        self.state.lineage.append(version)
        self.state.serving_dir = path
        self.published.append(version)
        if self.rank == 0:
            self.baseline = self._baseline_model()
        self.checkpoint()
        return True

    # -- cleanup ---------------------------------------------------------------------------------

    def close(self) -> None:
        self.ahead.close()  # a batch built ahead is not trained: its records stay uncommitted and are read again
        stepped, uncommitted = self.state.step > self.last_checkpoint_step, not ds.on_every_rank(not self._uncommitted(), self.world)
        if stepped or uncommitted:  # what was trained, held out or skipped since the last checkpoint is committed
            try:
                self.checkpoint()
            except DviError as e:
                log.error("final checkpoint failed: %s", e)
        self.log_counters()
