"""The trainer end to end on real parts: the embedded broker, DeepSpeed (CPU, gloo), the model store.

A tiny random Llama with the demo tokenizer (vocabulary 49,152) stands in for the target where the test is
about bookkeeping (exactly-once training, dead letters, kill -9 and restart, the gate, non-finite losses);
its records come from the real engine. Learning itself is tested on the real demo pair
(`test_training_on_demo_records_raises_held_out_acceptance`).
"""

from __future__ import annotations

import copy
import json
import logging
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from broker_fixtures import chat_records, dead_letters, engine_records, make_record, poison
from child_env import clean_env
from kafka import KafkaProducer

from dvi import keys
from dvi.config import DviConfig, ModelConfig, TrackingConfig, TrainerConfig, keys_dir
from dvi.control import DrafterPromoted, DrafterPublished, DrafterRejected
from dvi.control import encode as encode_control
from dvi.models import load_causal_lm, load_drafter
from dvi.record_codec import encode
from streams.consumer import DecisionConsumer
from streams.control import ControlReader
from streams.control import send as control_send
from streams.producer import DecisionProducer
from trainers import checkpoint
from trainers.data import Fate, Kept
from trainers.gate import evaluate
from trainers.recipe import JOINED, Trainer

pytestmark = [pytest.mark.broker, pytest.mark.slow]

VOCAB = 49152  # the demo tokenizer's, which the tiny pair (tests/conftest.py: tiny_dirs) uses


@pytest.fixture(scope="session")
def tiny_records(tiny_dirs) -> list:
    return engine_records(*tiny_dirs, n=24)


def config(stream_cfg, dirs, tmp_path: Path, **trainer) -> DviConfig:
    target, drafter = dirs
    # a consumer group of its own per test: members of another test's group (a killed process lingers until its
    # session times out) must not hold up this one's rebalance
    t = dict(group_id=f"trainer-{tmp_path.name}", run_dir=str(tmp_path / "run"), store=str(tmp_path / "store"),
             batch_tokens=64, replay_share=0.0,
             holdout_share=0.0, checkpoint_every=2, gate_every=1000, idle_exit_s=3.0, lr=1e-3,
             holdout_first=0, gate_every_s=None, gate_min_records=8, min_gain=0.0)  # gates only when a test asks for one
    t.update(trainer)
    return DviConfig(model=ModelConfig(target=str(target), drafter=str(drafter)), stream=stream_cfg,
                     trainer=TrainerConfig(**t), tracking=TrackingConfig(enabled=False))


def produce(stream_cfg, records) -> None:
    producer = DecisionProducer(stream_cfg)
    for r in records:
        assert producer.submit(r) is not False
    stats = producer.close(timeout_s=20)
    assert stats.sent == len(records), stats


def send_raw(stream_cfg, values: list[bytes]) -> None:
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
    for v in values:
        p.send(stream_cfg.topic, v)
    p.flush()
    p.close()


def run_trainer(cfg: DviConfig, **kw) -> Trainer:
    source = DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id, from_beginning=True)
    trainer = Trainer(cfg, source, **kw)
    try:
        trainer.run()
    finally:
        source.close()
    return trainer


def held_out(trainer: Trainer, source, n: int) -> list:
    """Ingest what `source` reads until `trainer` holds out `n` records (30 s at most); its held-out records."""
    deadline = time.monotonic() + 30
    while len(trainer.buffer.holdout) < n and time.monotonic() < deadline:
        trainer.ingest(source.poll(0.5))
    return list(trainer.buffer.holdout)


def last_state(cfg: DviConfig) -> dict:
    path = checkpoint.latest(Path(cfg.trainer.run_dir), clean=False)
    assert path is not None, "no complete checkpoint"
    return json.loads((path / checkpoint.STATE).read_text())


def committed(cfg: DviConfig) -> dict[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=cfg.stream.bootstrap, group_id=cfg.trainer.group_id, enable_auto_commit=False)
    try:
        parts = c.partitions_for_topic(cfg.stream.topic)
        return {p: c.committed(TopicPartition(cfg.stream.topic, p)) for p in parts}
    finally:
        c.close()


def end_offsets(cfg: DviConfig) -> dict[int, int]:
    """Per partition, the offset after the last message, read by consuming the topic (Tansu's ListOffsets is
    wrong for multi-message batches, see PLATFORM.md): until every partition's position reaches the high-water
    mark its fetches report, or nothing arrived for 2 s."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=cfg.stream.bootstrap, enable_auto_commit=False)
    try:
        tps = [TopicPartition(cfg.stream.topic, p) for p in c.partitions_for_topic(cfg.stream.topic)]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        ends = {tp.partition: 0 for tp in tps}
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 2.0:
            batches = c.poll(timeout_ms=300)
            for tp, messages in batches.items():
                ends[tp.partition] = max(ends[tp.partition], messages[-1].offset + 1)
                quiet_since = time.monotonic()
            highs = [c.highwater(tp) for tp in tps]
            if None not in highs and all(ends[tp.partition] >= high for tp, high in zip(tps, highs, strict=True)):
                break  # read to the end of every partition
        return ends
    finally:
        c.close()


@pytest.mark.faults
def test_each_record_trained_once_duplicates_and_garbage_set_aside(stream_cfg, tiny_dirs, tiny_records, tmp_path):
    cfg = config(stream_cfg, tiny_dirs, tmp_path)
    other_target = make_record(vocab=1000)  # valid, but for another target's vocabulary
    produce(stream_cfg, tiny_records + tiny_records[:5] + [other_target])  # five records delivered twice
    send_raw(stream_cfg, [b"garbage", encode(tiny_records[0])[:40]])
    trainer = run_trainer(cfg)
    c = trainer.state.counters
    assert (c.trained, c.duplicates, c.held_out, c.skipped, c.nonfinite) == (len(tiny_records), 5, 0, 0, 0)
    assert c.foreign == 1 and other_target.record_id not in trainer.ledger
    assert trainer.source.stats.dead_lettered == 2
    state = last_state(cfg)
    trained = [rid for rid, fate in state["ledger"] if fate == Fate.TRAINED]
    assert sorted(trained) == sorted(r.record_id for r in tiny_records)
    assert state["counters"]["trained"] == len(tiny_records) and state["step"] == trainer.state.step > 1
    assert committed(cfg) == end_offsets(cfg)  # everything read is inside the final checkpoint


def test_records_waiting_past_the_age_limit_are_skipped_and_committed_without_a_step(stream_cfg, tiny_dirs, tiny_records,
                                                                                      tmp_path, caplog):
    """A trainer that takes no step (trigger=manual, no retrain asked for) still gets the records of its queue that
    were logged longer ago than trainer.pending_max_age_s done (skipped, ledgered, counted as expired), and a
    checkpoint by time (trainer.checkpoint_every_s) commits them at step 0; fresher records wait. Without both, a
    queue that outlives the stream's retention holds its partitions' committed offsets on records the broker has
    removed, and a restart reads on from the oldest left: the records between are never ledgered."""
    import threading

    from dvi.config import TriggerConfig

    caplog.set_level(logging.INFO, logger="dvi.decision.trainer")

    old = [replace(r, time=time.time() - 3600.0) for r in tiny_records[:16]]
    fresh = tiny_records[16:]
    produce(stream_cfg, old)
    produce(stream_cfg, fresh)  # after every old one is acknowledged: in each partition the old records come first
    cfg = config(stream_cfg, tiny_dirs, tmp_path, pending_max_age_s=600.0, checkpoint_every_s=1.0, idle_exit_s=None)
    cfg = replace(cfg, trigger=TriggerConfig(kind="manual"))
    said = []  # what it says of having nothing to do (dvi up ends its turn on the CPU early on True)
    with DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id, from_beginning=True) as source:
        trainer = Trainer(cfg, source, turns=SimpleNamespace(idle=said.append, has_turn=lambda: True, claim=lambda fraction: None))
        thread = threading.Thread(target=trainer.run)
        thread.start()
        try:
            deadline = time.monotonic() + 90
            while sum(o or 0 for o in committed(cfg).values()) < len(old) and time.monotonic() < deadline:
                time.sleep(0.5)
            c, state = trainer.state.counters, last_state(cfg)
            assert sum(o or 0 for o in committed(cfg).values()) == len(old)  # the old ones, up to the first fresh one
            assert trainer.state.step == 0 == state["step"] and c.trained == 0
            assert (c.records, c.expired, c.skipped, len(trainer.buffer.pending)) == (len(tiny_records), len(old), len(old), len(fresh))
            ledger = dict(state["ledger"])
            assert {r.record_id: ledger.get(r.record_id) for r in old} == {r.record_id: Fate.SKIPPED for r in old}
            assert not any(r.record_id in ledger for r in fresh) and state["counters"]["expired"] == len(old)
            # records came (work: ingest), then, fresh ones queued but no session to train them in (its turn or not), it
            # waits idle
            assert False in said and said[-1] is True
            joined = [r.getMessage() for r in caplog.records if r.name == "dvi.decision.trainer" and JOINED in r.getMessage()]
            assert len(joined) == 1 and "reading the decision stream" in joined[0]  # said once, when its group gave it partitions
        finally:
            trainer.stop_requested = True
            thread.join(timeout=60)
    assert not thread.is_alive()


@pytest.mark.faults
def test_three_kill_9s_one_mid_checkpoint_lose_nothing_and_never_publish_a_torn_drafter(stream_cfg, tiny_dirs, tmp_path):
    """Fault scenario 1: the trainer is SIGKILLed three times while it trains and publishes (each life publishes a
    version before its kill), the second time while a checkpoint is being written. After each kill the newest complete checkpoint loads, covers part of the stream,
    and every published version verifies; after the last restart every acked record is in the ledger exactly once,
    after the ledgers the kills left. Batches are built ahead on a thread (a GPU's default, forced here): a batch
    built but not trained when the process dies holds records the checkpoint does not cover, and they are trained
    after the restart, once."""
    from dvi import store

    records = engine_records(*tiny_dirs, n=64, new_tokens=32, seed=3)  # about 16 steps trained when the last kill lands
    cfg = config(stream_cfg, tiny_dirs, tmp_path, batch_tokens=32, checkpoint_every=2, idle_exit_s=4.0,
                 holdout_share=0.2, gate_min_records=2, gate_every=4, min_gain=-1.0)  # publish often: kills meet publishes
    # the records arrive in three parts, one before each life: a restarted trainer holds out none of the records it
    # read before (they are committed), so each life gets fresh ones for its gate, and publishes before it is killed
    parts = [records[:40], records[40:52], records[52:]]
    run_dir, store_root = Path(cfg.trainer.run_dir), Path(cfg.trainer.store)
    cmd = [sys.executable, "-m", "dvi.cli", "train", *train_overrides(cfg, stream_cfg, **{"trainer.min_gain": -1.0,
                                                                                          "trainer.gate_min_records": 2,
                                                                                          "trainer.batch_ahead": "true"})]
    torn_at_kill, progress, ledgers = [], [], []
    for kill in range(3):
        produce(stream_cfg, parts[kill])
        published = len(store.versions(store_root))
        proc = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        start = _step_of(checkpoint.latest(run_dir, clean=False)) if checkpoint.latest(run_dir, clean=False) else 0
        deadline = time.monotonic() + 240
        while ((latest := checkpoint.latest(run_dir, clean=False)) is None or _step_of(latest) < start + 4
               or len(store.versions(store_root)) <= published):  # this life has trained and published
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the trainer made no progress or published nothing in time"
            time.sleep(0.05)
        if kill == 1:  # mid-checkpoint: the moment a checkpoint's temporary directory appears
            while not any(p.name.startswith(".tmp-step") for p in run_dir.iterdir()):
                assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint write to interrupt"
                time.sleep(0.002)
            torn_at_kill.append(sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".tmp-")))
        else:
            time.sleep(0.7)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        latest = checkpoint.latest(run_dir, clean=False)
        state = json.loads((latest / checkpoint.STATE).read_text())  # the newest complete checkpoint reads
        ledgers.append(state["ledger"])
        assert 0 < sum(fate == Fate.TRAINED for _, fate in state["ledger"]) < len(records), "the kill should land mid-run"
        for version in store.versions(store_root):
            store.verify(store_root / version)  # every published drafter is whole
        progress.append((_step_of(latest), len(store.versions(store_root)), state["counters"]["trained"]))
    assert torn_at_kill and torn_at_kill[0], "the second kill did not land inside a checkpoint write"
    assert [versions for _, versions, _ in progress] == sorted(set(v for _, v, _ in progress)) and progress[0][1] > 0, progress

    final = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-3000:]
    after = last_state(cfg)
    trained = [rid for rid, fate in after["ledger"] if fate == Fate.TRAINED]
    held_out = [rid for rid, fate in after["ledger"] if fate == Fate.HELD_OUT]
    # every record once, trained or held out for the gate (none skipped): none lost, none twice
    assert sorted(trained + held_out) == sorted(r.record_id for r in records)
    assert len(set(trained)) == len(trained) and after["counters"]["trained"] == len(trained)  # survives restarts
    for ledger in ledgers:  # what each checkpoint before a kill covered, in order, then what came after it
        assert after["ledger"][: len(ledger)] == ledger
        trained_before = [rid for rid, fate in ledger if fate == Fate.TRAINED]
        assert trained[: len(trained_before)] == trained_before
    assert committed(cfg) == end_offsets(cfg)
    for version in store.versions(store_root):
        store.verify(store_root / version)
    print(f"\nthree SIGKILLs (step, versions published, records trained at each): {progress}; "
          f"the second inside a checkpoint write ({torn_at_kill[0]}); final: {len(trained)} trained + "
          f"{len(held_out)} held out = {len(records)} records, each once; {len(store.versions(store_root))} versions, all whole")


def train_overrides(cfg: DviConfig, stream_cfg, **extra) -> list[str]:
    t = cfg.trainer
    out = [f"model.target={cfg.model.target}", f"model.drafter={cfg.model.drafter}",
           f"stream.bootstrap_servers={stream_cfg.bootstrap}", f"stream.topic={stream_cfg.topic}",
           f"stream.dlq_topic={stream_cfg.dlq_topic}", f"stream.control_topic={stream_cfg.control_topic}",
           f"trainer.group_id={t.group_id}", f"trainer.run_dir={t.run_dir}", f"trainer.store={t.store}", f"trainer.batch_tokens={t.batch_tokens}",
           f"trainer.replay_share={t.replay_share}", f"trainer.holdout_share={t.holdout_share}",
           f"trainer.checkpoint_every={t.checkpoint_every}", f"trainer.gate_every={t.gate_every}",
           f"trainer.idle_exit_s={t.idle_exit_s}", f"trainer.holdout_first={t.holdout_first}",
           f"trainer.gate_every_s={'null' if t.gate_every_s is None else t.gate_every_s}",
           f"trainer.gate_min_records={t.gate_min_records}", f"trainer.min_gain={t.min_gain}", "tracking.enabled=false",
           "model.threads=1"]
    out = [o for o in out if o.split("=")[0] not in extra]  # an extra override replaces the config's value
    return out + [f"{k}={v}" for k, v in extra.items()]


def test_two_ranks_share_the_stream_and_train_every_record_once(stream_cfg, tiny_dirs, tmp_path):
    """Two trainer processes in one DeepSpeed world (the environment the `deepspeed` launcher sets) split the
    partitions in their consumer group, step together, and checkpoint one ledger covering every record once."""
    from dvi.procs import free_port

    records = engine_records(*tiny_dirs, n=30, new_tokens=24, seed=2)
    produce(stream_cfg, records)
    cfg = config(stream_cfg, tiny_dirs, tmp_path, batch_tokens=48, checkpoint_every=4, idle_exit_s=4.0)
    cmd = [sys.executable, "-m", "dvi.cli", "train", *train_overrides(cfg, stream_cfg)]
    port = str(free_port())
    procs = [subprocess.Popen(cmd, env=clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    state = last_state(cfg)
    trained = [rid for rid, fate in state["ledger"] if fate == Fate.TRAINED]
    assert sorted(trained) == sorted(r.record_id for r in records)
    assert state["counters"]["trained"] == len(records)
    assert len(state["ranks"]) == 2 and all(r["trained"] > 0 for r in state["ranks"])  # both ranks had partitions
    assert committed(cfg) == end_offsets(cfg)


@pytest.mark.faults
def test_one_percent_poison_into_a_running_trainer_is_dead_lettered_and_the_lag_returns_to_zero(broker, stream_config,
                                                                                               tiny_dirs, tmp_path):
    """Scenario 5: while `dvi train` runs, 594 good records and 6 poison ones (garbage, truncated, unknown schema,
    oversized, ids outside the vocabulary, NaN log-probs: 1%) arrive mixed in 6 bursts, the trainer taking steps
    between them. Every poison record lands in the dead-letter topic with its origin and error; every good one is
    trained once; the group's committed offsets reach the end of every partition (lag 0); the one trainer process
    never crashes."""
    import random
    import re
    import threading

    from kafka import KafkaProducer

    from streams.topics import ensure_topics

    scfg = stream_config(broker.bootstrap, partitions=2, max_record_bytes=16384)
    ensure_topics(scfg)
    good = engine_records(*tiny_dirs, n=594, new_tokens=12, seed=5)
    assert len(good) == 594
    bad = poison(scfg.max_record_bytes)
    mixed = [(r.request_id.encode(), encode(r)) for r in good] + [(k, v) for k, (v, _) in bad.items()]
    random.Random(0).shuffle(mixed)
    cfg = config(scfg, tiny_dirs, tmp_path, batch_tokens=96, checkpoint_every=4, idle_exit_s=4.0)
    cmd = [sys.executable, "-m", "dvi.cli", "-v", "train", *train_overrides(cfg, scfg), "stream.max_record_bytes=16384",
           "trainer.log_every=1"]
    train = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []  # its output so far, read on a thread

    def read() -> None:
        for line in train.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def steps() -> int:
        return sum(bool(re.search(r"dvi\.trainer: step \d+: loss", line)) for line in list(lines))

    def wait_for(ready, what: str) -> None:
        deadline = time.monotonic() + 240
        while not ready():
            assert train.poll() is None, "the trainer died: " + "".join(lines)[-3000:]
            assert time.monotonic() < deadline, f"the trainer {what} in time"
            time.sleep(0.1)

    raw = KafkaProducer(bootstrap_servers=broker.bootstrap, max_request_size=1 << 20)
    origin = {}
    try:
        wait_for(lambda: any("training a layer drafter" in line for line in list(lines)), "was not set up")
        for burst in range(6):  # while the trainer runs: it trains between bursts
            if burst:
                trained_steps = steps()
                wait_for(lambda: steps() > trained_steps, f"took no step after burst {burst}")
            assert train.poll() is None, "the trainer died"
            sent = [(key, raw.send(scfg.topic, key=key, value=value)) for key, value in mixed[burst * 100:(burst + 1) * 100]]
            raw.flush()
            for key, future in sent:
                meta = future.get(timeout=10)
                if key in bad:
                    origin[key] = (meta.partition, meta.offset)
        train.wait(timeout=600)  # it stops by itself once the stream has been idle for 4 s
        reader.join(timeout=30)
        out = "".join(lines)
    finally:
        raw.close()
        if train.poll() is None:
            train.kill()
    assert train.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]

    state = last_state(cfg)
    trained = [rid for rid, fate in state["ledger"] if fate == Fate.TRAINED]
    assert sorted(trained) == sorted(r.record_id for r in good)  # every good record once
    assert committed(cfg) == end_offsets(cfg)  # lag 0: the group committed past every record, the poison included

    letters = dead_letters(scfg, bad, origin)
    print(f"\npoison 1%: {len(good)} good records trained once, {len(letters)} of {len(bad)} poison records "
          f"dead-lettered with origin and error, committed == end offsets {committed(cfg)}, one trainer process, exit 0")


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[-1])


def test_gate_publishes_only_a_better_candidate(stream_cfg, tiny_dirs, tiny_records, tmp_path):
    cfg = config(stream_cfg, tiny_dirs, tmp_path, holdout_share=0.5, gate_min_records=4, max_steps=1)
    produce(stream_cfg, tiny_records)
    publisher = lambda msg: control_send(stream_cfg, msg)  # noqa: E731
    with ControlReader(stream_cfg) as control, ControlReader(stream_cfg) as trainer_control, \
            DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id) as source:
        claims = []  # what it claims of serving's busy time under dvi up's pause policy (trainers.triggers.Claim)
        trainer = Trainer(cfg, source, control=trainer_control, publisher=publisher,
                          turns=SimpleNamespace(idle=lambda idle: None, has_turn=lambda: False, claim=claims.append))
        trainer.run()
        assert len(trainer.buffer.holdout) >= 4 and claims == []
        candidate = trainer.student.module.model
        original = {k: v.clone() for k, v in candidate.state_dict().items()}
        with torch.no_grad():
            for p in candidate.parameters():
                p.add_(torch.randn_like(p) * 0.5)  # a much worse candidate
        assert trainer.gate_and_publish() is False
        assert trainer.state.counters.refused == 1 and not list(Path(cfg.trainer.store).glob("d*"))
        assert claims == [0.5]  # a gate refused its candidate: half its share

        candidate.load_state_dict(original)
        worse = copy.deepcopy(trainer.baseline)  # the trainer takes a new baseline object whenever serving changes,
        with torch.no_grad():                     # and its gate keeps the old one's figures until it does
            for p in worse.parameters():
                p.add_(torch.randn_like(p) * 0.5)  # now the serving drafter is the worse one
        trainer.baseline = worse
        assert trainer.gate_and_publish() is True
        version = trainer.state.lineage[-1]
        assert version != cfg.model.drafter and (Path(cfg.trainer.store) / version).is_dir()
        assert trainer.published == [version] and claims == [0.5, 1.0]  # published: all of it again
        published = load_drafter(Path(cfg.trainer.store) / version, VOCAB)
        for k, v in published.model.state_dict().items():
            assert torch.equal(v, original[k]), k
        deadline = time.monotonic() + 10
        msgs = []
        while not msgs and time.monotonic() < deadline:
            msgs = [m for m in control.poll(0.5) if isinstance(m, DrafterPublished)]
        assert msgs and msgs[0].version == version and msgs[0].gate["candidate_acceptance"] > msgs[0].gate["serving_acceptance"]

        # the servers roll it back: the gate compares against the drafter before it again
        control_send(stream_cfg, DrafterRejected(version=version, reason="live acceptance fell", replica_id="r1"))
        deadline = time.monotonic() + 10
        while trainer.state.lineage[-1] == version:
            assert time.monotonic() < deadline, "the trainer did not act on DrafterRejected"
            trainer._control()
            time.sleep(0.2)
        assert trainer.state.serving_dir == str(trainer.initial_dir) and claims[-1] == 1.0
        initial = load_drafter(trainer.initial_dir, VOCAB)
        for a, b in zip(trainer.baseline.parameters(), initial.model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_gate_evaluates_the_baseline_only_on_records_new_to_the_held_out_set(stream_cfg, tiny_dirs, tiny_records, tmp_path,
                                                                             monkeypatch):
    """The baseline's figures are kept per record while it serves: a check evaluates it on the held-out records it
    has not seen, forgets those that left, starts over for a new baseline, and its pooled figures equal evaluating
    the baseline on the whole held-out set afresh. Per-record figures do not depend on the batch around them."""
    from trainers import recipe

    # fp32: figures independent of the batch to float rounding (bf16 products round by the batch's shape)
    cfg = config(stream_cfg, tiny_dirs, tmp_path, holdout_share=0.5, gate_min_records=4, min_gain=1.0, precision="fp32")
    produce(stream_cfg, tiny_records)
    claims = []
    with DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id, from_beginning=True) as source:
        trainer = Trainer(cfg, source, turns=SimpleNamespace(idle=lambda idle: None, has_turn=lambda: False, claim=claims.append))
        held = held_out(trainer, source, 6)
    assert len(held) >= 6
    args = (VOCAB, trainer.vocab_map, trainer.teacher_lm, cfg.trainer.batch_tokens, trainer.gate_rule, trainer.precision)

    # per record: the same figures batched together as each alone, and pooled as `evaluate` pools them
    together = recipe.evaluate_each(trainer.baseline, held, *args)
    for e, kept in zip(held, together, strict=True):
        (alone,) = recipe.evaluate_each(trainer.baseline, [e], *args)
        assert alone.positions == kept.positions == e.positions
        assert alone.acceptance == pytest.approx(kept.acceptance, rel=1e-4, abs=1e-5)
        assert abs(alone.greedy - kept.greedy) <= 1  # a near-tie may break the other way in another batch shape
        assert abs(alone.realized - kept.realized) <= 1  # greedy records: the engine realizes the greedy match
    assert recipe.pooled(together) == pytest.approx(evaluate(trainer.baseline, held, *args))
    expected = recipe.pooled(together[1:6])  # the baseline on held[1:6], evaluated afresh
    tie = 1.0 / sum(e.positions for e in held[1:6])  # a near-tie of the argmax breaking the other way in another batch

    seen: list[list[str]] = []  # the record ids each evaluation of the baseline ran on
    each = recipe.evaluate_each

    def counted(student, examples, *rest):
        if student is trainer.baseline:
            seen.append([e.record_id for e in examples])
        return each(student, examples, *rest)

    monkeypatch.setattr(recipe, "evaluate_each", counted)

    def gate_on(examples) -> float:
        trainer.buffer.holdout = Kept(len(examples), 1 << 62)
        trainer.buffer.holdout.extend(examples)
        assert trainer.gate_and_publish() is False  # min_gain 1: refused, the baseline stays
        gate = trainer.last_gate  # the gate ranks on the acceptance the engine realizes; the expected one beside it
        return gate["serving_acceptance"], gate["serving_expected"]

    first = gate_on(held[:4])
    assert seen == [[e.record_id for e in held[:4]]]
    assert gate_on(held[:4]) == first and len(seen) == 1  # nothing new: the kept figures
    moved = gate_on(held[1:6])  # held[0] left, held[4:6] arrived
    assert seen[1:] == [[e.record_id for e in held[4:6]]]
    assert moved[1] == pytest.approx(expected["acceptance"], rel=1e-4)
    assert moved[0] == pytest.approx(expected["realized"], abs=tie + 1e-9)
    assert set(trainer._baseline_each) == {e.record_id for e in held[1:6]}

    trainer.baseline = copy.deepcopy(trainer.baseline)  # a new serving drafter: every record evaluated again
    gate_on(held[1:6])
    assert seen[2:] == [[e.record_id for e in held[1:6]]]
    assert trainer.state.counters.gates == 4 and trainer.state.counters.refused == 4
    # four refusals in a row: half its share, a quarter, then trainer.pause_share_min (0.025 of 0.1) as the least
    assert claims == [0.5, 0.25, 0.25, 0.25] and cfg.trainer.pause_share_min / cfg.trainer.pause_share == 0.25
    trainer.close()


def test_non_finite_weights_roll_back_and_are_never_checkpointed_or_published(stream_cfg, tiny_dirs, tiny_records, tmp_path):
    cfg = config(stream_cfg, tiny_dirs, tmp_path, holdout_share=0.25, gate_min_records=2, max_steps=2)
    produce(stream_cfg, tiny_records)
    with DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id, from_beginning=True) as source:
        trainer = Trainer(cfg, source)
        trainer.run()  # two steps, then a checkpoint that covers them
        good = checkpoint.latest(Path(cfg.trainer.run_dir))
        trained = trainer.state.counters.trained
        with torch.no_grad():
            next(trainer.student.module.parameters()).fill_(float("nan"))
        assert trainer.gate_and_publish() is False and not list(Path(cfg.trainer.store).glob("d*"))
        deadline = time.monotonic() + 20
        while not trainer.buffer.pending and time.monotonic() < deadline:
            trainer.ingest(source.poll(0.5))
        trainer.step()  # non-finite loss with non-finite weights: back to the last checkpoint
        assert trainer.state.counters.nonfinite == 1
        assert checkpoint.latest(Path(cfg.trainer.run_dir)) == good  # nothing new written
        assert all(bool(torch.isfinite(p).all()) for p in trainer.student.module.parameters())
        assert trainer.state.counters.trained == trained and trainer.state.step == 2
        # the stream is read again from the committed offsets: the rest trains normally, each record once
        trainer.tcfg = replace(trainer.tcfg, max_steps=None)
        trainer.run()
    state = last_state(cfg)
    fates = [fate for _, fate in state["ledger"]]
    assert len(fates) == len(tiny_records) and state["counters"]["nonfinite"] == 1
    assert state["counters"]["trained"] == fates.count(Fate.TRAINED)


@pytest.mark.real_model
def test_training_on_demo_records_raises_held_out_acceptance(stream_cfg, demo_target_dir, demo_drafter_dir, tmp_path):
    """A short run on real records of one domain (Python questions) raises the drafter's estimated acceptance
    on held-out records of that domain."""
    from dvi.models import load_tokenizer

    tokenizer = load_tokenizer(demo_target_dir)
    target = load_causal_lm(demo_target_dir, "target")
    records = chat_records(target, load_drafter(demo_drafter_dir, VOCAB), tokenizer)
    produce(stream_cfg, records)
    cfg = config(stream_cfg, (demo_target_dir, demo_drafter_dir), tmp_path, batch_tokens=128, replay_share=0.5,
                 holdout_share=0.25, lr=5e-4, max_steps=24, checkpoint_every=1000, idle_exit_s=None,
                 replay_when_idle=True)
    cfg = replace(cfg, model=replace(cfg.model, threads=2))
    with DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id, from_beginning=True) as source:
        trainer = Trainer(cfg, source)
        holdout = held_out(trainer, source, 3)
        args = (VOCAB, None, trainer.teacher_lm, 512)
        before = evaluate(trainer.student.module, holdout, *args)
        trainer.run()
        after = evaluate(trainer.student.module, holdout, *args)
    assert trainer.state.step == 24
    print(f"held-out expected acceptance {before['acceptance']:.3f} -> {after['acceptance']:.3f}, "
          f"greedy match {before['greedy']:.3f} -> {after['greedy']:.3f}")
    assert after["acceptance"] > before["acceptance"] + 0.02


def test_manual_retrain_runs_a_session_then_publishes_to_store_registry_and_control(stream_cfg, tiny_dirs, tiny_records, tmp_path):
    """trigger=manual: nothing trains until `dvi retrain`; then one session of session_steps, the gate, and a
    publish that lands in the model store, the MLflow registry (alias candidate) and on the control topic."""
    import threading

    from mlflow import MlflowClient

    from dvi.config import TriggerConfig
    from dvi.mlflow_server import LocalMlflow
    from dvi.procs import free_port
    from dvi.tracking import Tracker

    produce(stream_cfg, tiny_records)
    with LocalMlflow(tmp_path / "mlflow", free_port()) as server:
        cfg = config(stream_cfg, tiny_dirs, tmp_path, holdout_share=0.5, gate_min_records=2, max_steps=3,
                     min_gain=-1.0, idle_exit_s=None)  # min_gain < 0: this test is about the trigger, not the gate
        cfg = replace(cfg, trigger=TriggerConfig(kind="manual", session_steps=3),
                      tracking=TrackingConfig(uri=server.uri, experiment="trigger-test"))
        tracker = Tracker(cfg.tracking, run_name="trigger-test", params={"trainer": {"lr": cfg.trainer.lr}})
        publisher = lambda msg: control_send(stream_cfg, msg)  # noqa: E731
        with ControlReader(stream_cfg) as control, DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id) as source, \
                ControlReader(stream_cfg) as announcements:
            trainer = Trainer(cfg, source, tracker=tracker, control=control, publisher=publisher)
            thread = threading.Thread(target=trainer.run)
            thread.start()
            deadline = time.monotonic() + 30
            while trainer.state.counters.records < len(tiny_records) and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.5)
            assert trainer.state.counters.records == len(tiny_records) and trainer.state.step == 0  # waiting for a request

            retrain = subprocess.run([sys.executable, "-m", "dvi.cli", "retrain", "--reason", "test",
                                      f"stream.bootstrap_servers={stream_cfg.bootstrap}", f"stream.control_topic={stream_cfg.control_topic}"],
                                     capture_output=True, text=True, timeout=120)
            assert retrain.returncode == 0, retrain.stderr[-2000:]
            thread.join(timeout=120)
            assert not thread.is_alive()
            assert trainer.state.step == 3 and trainer.state.counters.published == 1
            version = trainer.state.lineage[-1]
            assert trainer.published == [version]
            msgs = [m for m in announcements.poll(5.0) if isinstance(m, DrafterPublished)]
            assert [m.version for m in msgs] == [version]
        stats = tracker.close(timeout_s=60)
        assert stats.connected and stats.dropped == 0

        client = MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)
        mv = client.get_model_version_by_alias(cfg.tracking.registry_model, "candidate")
        assert mv.tags["dvi.version"] == version and mv.tags["parent_version"] == trainer.state.lineage[-2]
        assert "gate.candidate_acceptance" in mv.tags and mv.tags["sha256"] == msgs[0].sha256
        run = client.get_run(stats.run_id)
        assert {"loss", "train/acceptance", "gate/candidate_acceptance", "step_time_s"} <= set(run.data.metrics)
        # the consumer's counts, refused batches among them (streams.batches), beside the trainer's
        assert run.data.metrics["stream/received"] == len(tiny_records) and run.data.metrics["stream/batches_refused"] == 0
        assert run.data.metrics["stream/invalid"] == 0
        assert run.data.params["trainer.lr"] == str(cfg.trainer.lr)


def test_retrain_under_continuous_gates_and_publishes_now_and_says_so(stream_cfg, tiny_dirs, tiny_records, tmp_path, caplog):
    """trigger=continuous: `dvi retrain` forces a gate and publish attempt at once (gate_every far away, no timer),
    acknowledged in the trainer's decision log and its counters."""
    import logging
    import threading

    produce(stream_cfg, tiny_records)
    cfg = config(stream_cfg, tiny_dirs, tmp_path, holdout_share=0.1, holdout_first=4, gate_min_records=4, min_gain=-1.0,
                 idle_exit_s=None)
    publisher = lambda msg: control_send(stream_cfg, msg)  # noqa: E731
    with ControlReader(stream_cfg) as control, DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id) as source, \
            caplog.at_level(logging.INFO, logger="dvi.decision"):
        trainer = Trainer(cfg, source, control=control, publisher=publisher)
        thread = threading.Thread(target=trainer.run)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while (trainer.state.counters.records < len(tiny_records) or trainer.state.step == 0) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert trainer.state.step >= 1 and trainer.state.counters.held_out >= 4 and trainer.state.counters.published == 0
            retrain = subprocess.run([sys.executable, "-m", "dvi.cli", "retrain", "--reason", "new tenant",
                                      f"stream.bootstrap_servers={stream_cfg.bootstrap}", f"stream.control_topic={stream_cfg.control_topic}"],
                                     capture_output=True, text=True, timeout=120)
            assert retrain.returncode == 0, retrain.stderr[-2000:]
            deadline = time.monotonic() + 60
            while trainer.state.counters.published == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            trainer.stop_requested = True
            thread.join(timeout=120)
    c = trainer.state.counters
    assert c.retrains == 1 and c.gates == 1 and c.published == 1 and trainer.published == [trainer.state.lineage[-1]]
    lines = [r.getMessage() for r in caplog.records if r.name == "dvi.decision.trainer"]
    assert any(line.startswith("retrain requested (new tenant): acknowledged") for line in lines), lines
    assert any("gate at step" in line and "(retrain requested): passed: candidate" in line for line in lines), lines
    assert any(line.startswith(f"{trainer.published[0]} published (parent ") for line in lines), lines


def test_distill_offline_from_a_tail_file(stream_cfg, tiny_dirs, tiny_records, tmp_path):
    """`dvi stream tail --json` writes the topic to a file; `dvi drafter distill --file` trains on it (a bad line
    is skipped and counted), runs the gate at the end, and reports where the serving drafter is."""
    produce(stream_cfg, tiny_records)
    stream = [f"stream.bootstrap_servers={stream_cfg.bootstrap}", f"stream.topic={stream_cfg.topic}"]
    tail = subprocess.run([sys.executable, "-m", "dvi.cli", "stream", "tail", "--json", "--from-beginning", "--timeout", "4", *stream],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert tail.returncode == 0, tail.stderr[-2000:]
    lines = tail.stdout.splitlines()
    assert len(lines) == len(tiny_records)
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join(lines[:5] + ["{not json"] + lines[5:]) + "\n")
    cfg = config(stream_cfg, tiny_dirs, tmp_path, holdout_share=0.25, gate_min_records=2, min_gain=-1.0, batch_tokens=256)
    distill = subprocess.run([sys.executable, "-m", "dvi.cli", "drafter", "distill", "--file", str(records), "--steps", "6",
                              *train_overrides(cfg, stream_cfg, **{"trainer.min_gain": -1.0, "trainer.gate_min_records": 2})],
                             capture_output=True, text=True, timeout=300, env=clean_env())
    assert distill.returncode == 0, distill.stdout[-2000:] + distill.stderr[-3000:]
    assert "skipping an invalid record" in distill.stderr and "records.jsonl:6" in distill.stderr
    summary, serving = distill.stdout.strip().splitlines()[-2:]
    assert summary.startswith("step 6:") and "1 published" in summary
    assert Path(serving).parent == Path(cfg.trainer.store)
    load_drafter(serving, VOCAB)  # a loadable drafter version
    state = last_state(cfg)  # 256 positions a step: every record is read within the 6 steps, then replayed
    assert sorted(rid for rid, _ in state["ledger"]) == sorted(r.record_id for r in tiny_records)


def test_distill_replays_records_no_drafter_drafted_for(stream_cfg, tiny_dirs, tmp_path):
    """Records of a replica whose drafting was off (no round drafted, no drafter version) carry the target's choices
    alone: they are replayed like the newest records, so an offline run over them reaches its steps (it used to find
    nothing to replay and wait for ever)."""
    records = engine_records(tiny_dirs[0], None, n=8)
    assert all(r.drafter_version is None for r in records)
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    cfg = config(stream_cfg, tiny_dirs, tmp_path, min_gain=-1.0, gate_min_records=1, holdout_first=1)
    distill = subprocess.run([sys.executable, "-m", "dvi.cli", "drafter", "distill", "--file", str(path), "--steps", "12",
                              *train_overrides(cfg, stream_cfg, **{"trainer.min_gain": -1.0, "trainer.gate_min_records": 1,
                                                                   "trainer.holdout_first": 1})],
                             capture_output=True, text=True, timeout=300, env=clean_env())
    assert distill.returncode == 0, distill.stdout[-2000:] + distill.stderr[-3000:]
    assert distill.stdout.strip().splitlines()[-2].startswith("step 12:")  # 8 records of 24 positions, 64 a step: replayed


def test_servers_verdicts_are_recorded_in_the_store_for_restarting_replicas(stream_cfg, tiny_dirs, tmp_path):
    """DrafterPromoted / DrafterRejected from the replicas become lines of <store>/VERDICTS (the trainer is the
    store's writer; replicas may mount it read-only); a version that is not in this store is ignored."""
    from dvi import store

    cfg = config(stream_cfg, tiny_dirs, tmp_path)
    root = Path(cfg.trainer.store)
    weights = load_drafter(tiny_dirs[1], VOCAB).model.state_dict()
    for v in ("d0001", "d0002"):
        store.publish(root, v, weights, tiny_dirs[1], {"parent": "init"})
    with ControlReader(stream_cfg) as control, DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id) as source:
        trainer = Trainer(cfg, source, control=control)
        control_send(stream_cfg, DrafterPromoted(version="d0001", replica_id="r1", acceptance=0.4))
        rejected = encode_control(DrafterRejected(version="d0002", replica_id="r1", reason="acceptance fell"),
                          keys.load(keys_dir(stream_cfg), sign_as=("replica",)))
        raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
        raw.send(stream_cfg.control_topic, rejected).get(timeout=10)
        control_send(stream_cfg, DrafterPromoted(version="d0099", replica_id="r2"))  # not in this store
        control_send(stream_cfg, DrafterPromoted(version="../d0001", replica_id="r3"))  # not a version name
        # forged: unsigned, and signed by a key this deployment does not trust; then the genuine rejection again
        raw.send(stream_cfg.control_topic, encode_control(DrafterRejected(version="d0001", replica_id="r9"))).get(timeout=10)
        stranger = keys.load(tmp_path / "stranger-keys", sign_as=("replica",))
        raw.send(stream_cfg.control_topic, encode_control(DrafterRejected(version="d0001", replica_id="r9"), stranger)).get(timeout=10)
        raw.send(stream_cfg.control_topic, rejected).get(timeout=10)  # a replay
        raw.close()
        deadline = time.monotonic() + 30
        while control.invalid < 4 and time.monotonic() < deadline:
            trainer._control()
            time.sleep(0.2)
        trainer._control()
    assert control.invalid == 4  # "../d0001", the two forgeries and the replay
    assert store.verdicts(root) == {"d0001": store.PRODUCTION, "d0002": store.REJECTED}
    assert len((root / store.VERDICTS).read_text().splitlines()) == 2
    assert store.serving_version(root) == "d0001"


def test_system_metrics_describe_this_process():
    import psutil

    from trainers.telemetry import gpu_busy_share, system_metrics

    process = psutil.Process()
    process.cpu_percent()
    sum(i * i for i in range(200_000))  # some CPU time in the interval
    m = system_metrics(process, torch.device("cpu"))
    assert set(m) == {"system/cpu_percent", "system/rss_mb", "system/memory_percent", "system/heap_in_use_mb",
                      "system/heap_free_mb", "system/heap_mmap_mb", "system/py_blocks"}  # glibc: its heap's figures too
    assert m["system/rss_mb"] > 50 and 0 < m["system/memory_percent"] <= 100 and m["system/cpu_percent"] >= 0
    # (memory handed out need not be resident: blocks never written, pages swapped out)
    assert 0 < m["system/heap_mmap_mb"] <= m["system/heap_in_use_mb"] and m["system/heap_free_mb"] >= 0 and m["system/py_blocks"] > 0
    assert gpu_busy_share(torch.device("cpu")) is None  # NVML's figure is a GPU's only


def test_one_non_finite_value_in_any_trainable_parameter_is_found():
    from trainers.students import params_finite

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    assert params_finite(model) and params_finite(torch.nn.Module())  # no parameters: nothing non-finite
    for value in (float("nan"), float("inf")):
        with torch.no_grad():
            model[1].bias[1] = value
        assert not params_finite(model)
    # a frozen parameter (an EAGLE-3 drafter's copy of the target's embedding) is never stepped: not looked at
    model[1].requires_grad_(False)
    assert params_finite(model)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert not params_finite(model)

