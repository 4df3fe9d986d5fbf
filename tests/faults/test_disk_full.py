"""Scenario 6, disk full during a checkpoint: the trainer's run directory and model store on a small tmpfs that
fills up. The previous checkpoint stays intact and loadable, the error is reported, no offsets are committed,
nothing is published, the trainer keeps running; once space is back the next checkpoint succeeds. Real parts:
DeepSpeed, the embedded broker, records from the real engine (the tiny pair with the demo tokenizer keeps the
checkpoints a few MB)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from trainers import checkpoint

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.broker]


@pytest.fixture
def small_disk(tmp_path):
    """A 192 MiB tmpfs (needs root, as the CI machines run): a disk that can really be filled."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192m", "tmpfs", str(mnt)], capture_output=True, text=True)
    assert done.returncode == 0, f"cannot mount a tmpfs for the disk-full scenario: {done.stderr.strip()}"
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Fill `disk` until fewer than `leave_bytes` are free; the filler file's path."""
    filler = disk / "filler"
    with filler.open("wb") as f:
        while shutil.disk_usage(disk).free > leave_bytes:
            f.write(b"\0" * min(1 << 20, max(4096, shutil.disk_usage(disk).free - leave_bytes)))
            f.flush()
            os.fsync(f.fileno())
    return filler


def test_a_full_disk_fails_the_checkpoint_cleanly_and_nothing_is_published(small_disk, stream_cfg, tiny_dirs, tmp_path, caplog, ds_world):
    from broker_fixtures import engine_records

    from dvi import store
    from dvi.config import DviConfig, ModelConfig, TrackingConfig, TrainerConfig
    from streams.consumer import DecisionConsumer
    from streams.producer import DecisionProducer
    from trainers.recipe import Trainer

    producer = DecisionProducer(stream_cfg)
    for record in engine_records(*tiny_dirs, n=16):
        producer.submit(record)
    assert producer.close(timeout_s=20).sent == 16
    cfg = DviConfig(model=ModelConfig(target=str(tiny_dirs[0]), drafter=str(tiny_dirs[1])), stream=stream_cfg,
                    trainer=TrainerConfig(group_id=f"disk-{uuid.uuid4().hex[:6]}", run_dir=str(small_disk / "run"),
                                          store=str(small_disk / "store"), batch_tokens=64, replay_share=0.0,
                                          holdout_share=0.25, gate_min_records=1, checkpoint_every=10**6, gate_every=10**6,
                                          keep_checkpoints=1, lr=1e-3),
                    tracking=TrackingConfig(enabled=False))
    with DecisionConsumer(cfg.stream, group_id=cfg.trainer.group_id, from_beginning=True) as source:
        trainer = Trainer(cfg, source)  # writes the step-0 checkpoint
        for _ in range(20):
            trainer.ingest(source.poll(0.5))
        assert trainer.buffer.pending and len(trainer.buffer.holdout) >= 1
        trainer.step()
        good = trainer.checkpoint()
        assert good is not None and checkpoint.latest(Path(cfg.trainer.run_dir), clean=False) == good
        size = sum(f.stat().st_size for f in good.rglob("*") if f.is_file())

        filler = fill(small_disk, leave_bytes=1 << 20)  # 1 MiB left: less than a checkpoint or a drafter version takes
        trainer.step()
        caplog.set_level(logging.ERROR, logger="dvi.trainer")
        assert trainer.checkpoint() is None  # reported, not raised: the trainer keeps running
        assert trainer.state.counters.checkpoint_failures == 1
        # a checkpoint by time is tried again trainer.checkpoint_every_s after the failure, not on the next turn
        every = cfg.trainer.checkpoint_every_s
        assert trainer._checkpoint_due(time.monotonic()) == (False, False)
        assert trainer._checkpoint_due(time.monotonic() + every) == (True, True)
        assert any("could not be written" in r.getMessage() and good.name in r.getMessage() for r in caplog.records)
        # the previous checkpoint is the newest complete one and loads; the failed one left nothing behind
        assert checkpoint.latest(Path(cfg.trainer.run_dir), clean=False) == good
        assert sorted(p.name for p in Path(cfg.trainer.run_dir).iterdir()) == [good.name]
        checkpoint.load(trainer.student, good)
        # nothing is published while the last checkpoint failed, however good the candidate
        assert trainer.gate_and_publish() is False and store.versions(Path(cfg.trainer.store)) == []
        # and a publish that meets the full disk itself leaves nothing behind and announces nothing
        lineage = list(trainer.state.lineage)
        assert trainer.publish({"candidate_acceptance": 1.0, "serving_acceptance": 0.0}) is False
        assert trainer.state.lineage == lineage and trainer.state.counters.published == 0
        assert not Path(cfg.trainer.store).exists() or not any(Path(cfg.trainer.store).iterdir())
        print(f"\ncheckpoint of {size / 2**20:.1f} MiB on a disk with {shutil.disk_usage(small_disk).free / 2**20:.1f} MiB "
              f"free: refused and reported; {good.name} intact and loadable; nothing published")

        filler.unlink()  # space is back: the next checkpoint succeeds and supersedes the old one
        trainer.step()
        newer = trainer.checkpoint()
        assert newer is not None and newer != good and checkpoint.latest(Path(cfg.trainer.run_dir), clean=False) == newer
        assert trainer.checkpoint_ok
