"""`dvi train`, `dvi retrain`, `dvi drafter distill` and `dvi drafter bootstrap`: the recipe wired to its sources and channels.

`dvi train` is the long-running trainer: a member of consumer group `trainer.group_id` on the decisions topic,
training while its trigger (`trigger=continuous|threshold|schedule|manual`) says so. One process with plain
`python`/`dvi`; several with `deepspeed --no_local_rank --module dvi.cli train ...`. `dvi retrain` asks running
trainers for a session on the control topic. `dvi drafter distill` runs the same recipe offline over every record
on a topic (from the beginning, with a group of its own) or in a JSON-lines file, and stops when it is idle (or
after --steps); `--json` prints its result as one JSON object (`published_versions`: what it published, oldest
first). `dvi drafter bootstrap` makes a general drafter offline from packaged text (`trainers.bootstrap`: the corpus, the
target's answers, the same recipe over them). This module builds the trainer's source (a consumer or a file), its control reader, its publisher and its
MLflow tracker; the recipe is `trainers.recipe`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from dvi.busy import TurnTaker
from dvi.cli.output import out
from dvi.cli.vllm.answers import VllmAnswers
from dvi.config import DviConfig, flat_params, load_config, overrides_of
from dvi.control import RetrainRequested
from dvi.hardware import resolve_device, resolve_dtype
from dvi.models import cache_dir
from dvi.record_codec import Limits
from dvi.tracking import Tracker
from dvi.waiting import waiting_for
from streams import control
from streams.client import quiet_kafka_logs
from streams.consumer import DecisionConsumer
from streams.topics import ensure_topics
from trainers import bootstrap as boot
from trainers.data import FileSource
from trainers.recipe import Trainer

log = logging.getLogger("dvi.trainer")


def _stream_trainer(cfg: DviConfig, *, group_id: str, offline: bool, verbose: bool, dead_letter: bool = True):
    """The recipe fed by the decisions topic, listening to the control topic, publishing on it, tracked in MLflow."""
    quiet_kafka_logs(verbose)
    with waiting_for(f"the Kafka broker at {cfg.stream.bootstrap}"):
        ensure_topics(cfg.stream)
    # a record's features are bounded by its own size (stream.max_record_bytes: a writer trims them to it)
    limits = Limits(topk=cfg.stream.topk, max_rounds=cfg.stream.chunk_rounds, max_k=cfg.serve.spec.k_max,
                    max_feature_bytes=cfg.stream.max_record_bytes)
    source = DecisionConsumer(cfg.stream, group_id=group_id, from_beginning=True, limits=limits, dead_letter=dead_letter,
                              client_id="dvi-trainer")
    # what this trainer (its consumer group) has acted on stays a replay across its restarts
    reader = control.ControlReader(cfg.stream, seen_file=control.seen_file(f"dvi-trainer-{group_id}"))
    role = "distill" if offline else "trainer"
    tracker = Tracker(cfg.tracking, run_name=role, params=flat_params(cfg),  # stable names: the README's `trainer`, `distill`
                      tags={"dvi.role": role, "dvi.trigger": cfg.trigger.kind, "dvi.started": time.strftime("%Y-%m-%d %H:%M:%S")})
    with waiting_for("the models to load and DeepSpeed to start"):
        # under dvi up's pause policy ($DVI_BUSY_DIR): turns on the CPU, which end where it has nothing to do
        turns = None if offline else TurnTaker.from_env()
        trainer = Trainer(cfg, source, tracker=tracker, control=reader, publisher=lambda msg: control.send(cfg.stream, msg),
                          offline=offline, turns=turns)
    return trainer, (source, reader, tracker)


def _file_trainer(cfg: DviConfig, path: str):
    """The recipe over a file of records: no broker needed; MLflow and the store as configured."""
    source = FileSource(path)
    tracker = Tracker(cfg.tracking, run_name="distill", params=flat_params(cfg),
                      tags={"dvi.role": "distill", "dvi.source": str(source.path), "dvi.started": time.strftime("%Y-%m-%d %H:%M:%S")})
    with waiting_for("the models to load and DeepSpeed to start"):
        return Trainer(cfg, source, tracker=tracker, offline=True), (source, None, tracker)


def _run(trainer: Trainer, parts) -> dict:
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
    return {"step": trainer.state.step, **counters.to_dict(), "serving": trainer.state.lineage[-1],
            "serving_dir": trainer.state.serving_dir, "published_versions": list(trainer.published),
            "first_gate": trainer.first_gate, "last_gate": trainer.last_gate}


def train(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args))
    trainer, parts = _stream_trainer(cfg, group_id=cfg.trainer.group_id, offline=False, verbose=args.verbose)
    out(f"dvi train: distilling from {cfg.stream.topic} at {cfg.stream.bootstrap} (group {cfg.trainer.group_id}, trigger "
          f"{cfg.trigger.kind}), drafter {trainer.state.lineage[-1]}; Ctrl-C stops it", flush=True)
    out(_summary(_run(trainer, parts)))
    return 0


def distill(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args))
    run_dir = cfg.trainer.run_dir or str(cache_dir(cfg.model) / "distill" / uuid.uuid4().hex[:8])
    trainer_cfg = replace(cfg.trainer, run_dir=run_dir, idle_exit_s=cfg.trainer.idle_exit_s or args.idle)
    if args.steps or args.minutes:  # epochs over what the topic holds: keep stepping on replayed records until then
        trainer_cfg = replace(trainer_cfg, max_steps=args.steps or None, max_seconds=args.minutes * 60 if args.minutes else None,
                              replay_when_idle=True, idle_exit_s=None)
    cfg = replace(cfg, trainer=trainer_cfg, trigger=replace(cfg.trigger, kind="continuous"))
    if args.file:
        trainer, parts = _file_trainer(cfg, args.file)
    else:  # a group of its own, read from the beginning: every record on the topic, whatever the serving trainers did
        trainer, parts = _stream_trainer(cfg, group_id=f"dvi-distill-{uuid.uuid4().hex[:8]}", offline=True,
                                         verbose=args.verbose, dead_letter=False)
    with _progress(trainer, args.steps):
        result = _run(trainer, parts)
    if args.json:
        out(json.dumps(result))
    else:
        out(_summary(result))
        out(result["serving_dir"])
    return 0


@contextlib.contextmanager
def _progress(trainer: Trainer, steps: int | None):
    """A tqdm bar of the trainer's steps while it runs (with its records and publishes, read from its state by a thread);
    on stderr, and only on a terminal."""
    bar = tqdm(total=steps, desc="dvi drafter distill", unit=" steps", disable=None)
    done = threading.Event()

    def follow() -> None:
        while not done.wait(0.5):
            c = trainer.state.counters
            bar.update(trainer.state.step - bar.n)
            bar.set_postfix_str(f"{c.records} records, {c.published} published, {c.refused} refused")

    thread = threading.Thread(target=follow, daemon=True, name="distill-progress")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.update(trainer.state.step - bar.n)
        bar.close()


def vllm_answerer(cfg, plan: boot.Plan):
    """What makes the bootstrap's answerer from the target's directory: vLLM's engine in this process, in the dtype
    serving runs the target in, a batch of `plan.batch` prompts at a time."""
    dtype = str(resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))).removeprefix("torch.")
    return lambda target_dir: VllmAnswers(target_dir, cfg.serve.vllm, dtype, plan.batch,
                                          plan.max_prompt_tokens + plan.new_tokens + 1)


def bootstrap(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args))
    out_dir = Path(args.out).expanduser().resolve()
    if args.slice_only:
        written = boot.answer_slice(cfg, out_dir)
        out(json.dumps(written))
        return 0
    plan = boot.Plan(work=Path(args.work).expanduser() if args.work else cache_dir(cfg.model) / "bootstrap" / out_dir.name,
                     out=out_dir, prompts=args.prompts, corpus_file=Path(args.corpus) if args.corpus else None,
                     samples=args.samples, new_tokens=args.new_tokens, batch=args.batch, answer_minutes=args.answer_minutes,
                     minutes=None if args.steps else args.minutes, steps=args.steps)
    engine = args.engine if args.engine != "auto" else "vllm" if importlib.util.find_spec("vllm") else "generate"
    out(f"dvi drafter bootstrap: work in {plan.work} (a rerun resumes there), the drafter to {plan.out}; answers by "
        f"{engine}", flush=True)
    given = sys.argv[sys.argv.index("bootstrap") + 1 :] if "bootstrap" in sys.argv else []  # after any global flag
    report = boot.run(cfg, plan, command=" ".join(["dvi", "drafter", "bootstrap", *given]),
                      answerer=vllm_answerer(cfg, plan) if engine == "vllm" else None)
    for when in ("before", "after"):
        figures = ", ".join(f"{d} {f['realized']:.3f}" for d, f in report[when].items())
        out(f"held-out acceptance {when} ({report['trainer']['steps']} steps): {figures}" if when == "after"
            else f"held-out acceptance before: {figures}")
    out(report["out"]["path"])
    return 0


def retrain(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args))
    msg = RetrainRequested(reason=args.reason or "dvi retrain")
    control.send(cfg.stream, msg)
    out(f"retrain requested on {cfg.stream.control_topic} at {cfg.stream.bootstrap} ({msg.reason})")
    return 0


def _summary(r: dict) -> str:
    return (f"step {r['step']}: {r['trained']} records trained, {r['held_out']} held out, {r['skipped']} skipped, "
            f"{r['duplicates']} duplicates, {r['nonfinite']} non-finite batches; {r['published']} published, "
            f"{r['refused']} refused by the gate; serving {r['serving']}")
