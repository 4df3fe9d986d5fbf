"""The DeepSpeed engine (trainers/ds.py) and its checkpoints (trainers/checkpoint.py), with real DeepSpeed.

A tiny random Llama (vocabulary 4096, hidden 32: about 280K parameters) trains a few steps on CPU (gloo, a
world of one). Round trips are checked exactly: weights, optimizer state and one more step after the load.
Torn and corrupt checkpoints are made by hand (no marker, truncated, a flipped byte, ...) and by killing a
saving process with SIGKILL at the two moments that matter (before the rename, before the marker).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from dvi.config import TrainerConfig, default_cache_dir
from dvi.errors import DviError
from trainers.checkpoint import MANIFEST, MARKER, STATE, latest, load, save, step_tag, verify
from trainers.ds import apply_lora, build_engine, ds_config, merged_state_dict, resolve_precision, set_lr

VOCAB = 4096
CKPT_LOG = "dvi.trainers.checkpoint"


def make_engine(make_tiny_llama, seed: int = 0, **trainer):
    return build_engine(make_tiny_llama(seed=seed, vocab=VOCAB).train(), TrainerConfig(**trainer))


def train(engine, steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def assert_same(a, b, where: str = "") -> None:
    """Nested optimizer / model state equal: tensors exactly, everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and type(a).__eq__ is object.__eq__:  # e.g. DeepSpeed's loss scaler
        assert type(a) is type(b), where
        assert_same(vars(a), vars(b), where)
    else:
        assert a == b, where


# ----------------------------------------------------------------------------------------------
# config


def test_ds_config_is_what_the_trainer_config_says():
    cfg = TrainerConfig(zero_stage=2, grad_clip=0.5)
    assert ds_config(cfg, "fp32") == {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.5,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    assert ds_config(cfg, "bf16")["bf16"] == {"enabled": True}
    assert ds_config(TrainerConfig(grad_clip=0.0))["gradient_clipping"] == 0.0


def test_precision_auto_is_bf16_on_a_gpu_and_bf16_mixed_on_a_cpu_with_native_bf16(monkeypatch, caplog):
    from dvi import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "cpu_bf16_flags", lambda: ())
    assert resolve_precision(TrainerConfig()) == "fp32"
    monkeypatch.setattr(hardware, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    assert resolve_precision(TrainerConfig()) == "bf16-mixed"
    assert ds_config(TrainerConfig(), "bf16-mixed")["bf16"] == {"enabled": False}  # fp32 to DeepSpeed: autocast does bf16
    with caplog.at_level(logging.WARNING, "dvi.trainers.ds"):
        assert resolve_precision(TrainerConfig(precision="bf16")) == "bf16"
    assert "slowly on a CPU" in caplog.text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_precision(TrainerConfig()) == "bf16"
    assert resolve_precision(TrainerConfig(), "cpu") == "bf16-mixed"  # a trainer on the CPU of a GPU host
    assert resolve_precision(TrainerConfig(precision="fp32")) == "fp32"


def test_engine_optimizes_with_the_configured_adamw(ds_world, make_tiny_llama):
    engine = make_engine(make_tiny_llama, lr=1e-3, betas=(0.8, 0.9), weight_decay=0.01)
    assert isinstance(engine.optimizer, torch.optim.AdamW)
    group = engine.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.8, 0.9), 0.01)
    assert engine.gradient_clipping() == 1.0
    # a short batch's rate (trainers.recipe, partial_lr): the next step takes it; a fresh AdamW's first step moves a
    # weight by about lr
    set_lr(engine, 1e-6)
    before = [p.detach().clone() for p in engine.module.parameters()]
    train(engine, 1)
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(engine.module.parameters(), before))
    assert engine.optimizer.param_groups[0]["lr"] == 1e-6 and 0 < moved <= 1.1e-6, moved


def test_deepspeeds_compiled_op_is_kept_in_dvis_cache(ds_world):
    # the process group is up: DeepSpeed builds its CPU comm op where this says, once per cache, not under ~/.cache
    assert Path(os.environ["TORCH_EXTENSIONS_DIR"]) == default_cache_dir() / "torch_extensions"


# ----------------------------------------------------------------------------------------------
# save -> load round trip


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_save_then_load_round_trips_exactly(ds_world, make_tiny_llama, one_thread, tmp_path, zero_stage):
    engine = make_engine(make_tiny_llama, zero_stage=zero_stage)
    train(engine, 3)
    state = {"ledger": [f"{i:032x}" for i in range(1000)], "offsets": {"dvi.decisions/0": 41}, "lineage": None}
    path = save(engine, tmp_path, 3, state, keep=2)
    assert path == tmp_path / step_tag(3) and latest(tmp_path) == path
    assert not list(tmp_path.glob(".tmp-*"))

    fresh = make_engine(make_tiny_llama, seed=1, zero_stage=zero_stage)
    assert load(fresh, path) == state
    weights = merged_state_dict(engine)
    assert weights.keys() == make_tiny_llama(seed=0, vocab=VOCAB).state_dict().keys()
    assert_same(weights, merged_state_dict(fresh), "weights")
    assert_same(engine.optimizer.state_dict(), fresh.optimizer.state_dict(), "optimizer")
    train(engine, 1, seed=9)
    train(fresh, 1, seed=9)
    assert_same(merged_state_dict(engine), merged_state_dict(fresh), "weights after one more step")


def test_load_refuses_a_checkpoint_of_another_model(ds_world, make_tiny_llama, one_thread, saved_run):
    other = build_engine(make_tiny_llama(seed=0, vocab=VOCAB, layers=1), TrainerConfig())
    with pytest.raises(DviError, match="DeepSpeed could not load checkpoint .*step-00000002"):
        load(other, saved_run / step_tag(2))


def test_load_names_a_changed_zero_stage(ds_world, make_tiny_llama, saved_run):
    with pytest.raises(DviError, match="saved with trainer.zero_stage=0, this run uses 2"):
        load(make_engine(make_tiny_llama, zero_stage=2), saved_run / step_tag(2))


class _Payload:
    """Unpickling this runs `open(path, "w")`: what a tampered checkpoint file could make a trainer do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_tampered_checkpoint_cannot_run_code_when_it_loads(ds_world, make_tiny_llama, saved_run, tmp_path):
    """Its model-states file swapped for a pickle that runs code, and the manifest and marker sealed again over it
    (they are unkeyed hashes: anyone who can write the run directory can redo them): the load refuses it, and the
    code never ran, because DeepSpeed's files are read with torch.load(weights_only=True)."""
    root = copy_run(saved_run, tmp_path)
    ckpt = root / step_tag(2)
    ran = tmp_path / "payload-ran"
    states = next(ckpt.rglob("*model_states.pt"))
    torch.save({"module": _Payload(str(ran))}, states)
    files = {f.relative_to(ckpt).as_posix(): {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "size": f.stat().st_size}
             for f in sorted(ckpt.rglob("*")) if f.is_file() and f.name not in (MANIFEST, MARKER)}
    manifest = json.dumps({"files": files}, indent=1, sort_keys=True).encode()
    (ckpt / MANIFEST).write_bytes(manifest)
    marker = json.loads((ckpt / MARKER).read_bytes())
    (ckpt / MARKER).write_text(json.dumps({**marker, "manifest_sha256": hashlib.sha256(manifest).hexdigest()}))
    assert latest(root) == ckpt  # sealed again: the manifest checks alone would load it
    with pytest.raises(DviError, match="could not load checkpoint"):
        load(make_engine(make_tiny_llama), ckpt)
    assert not ran.exists()


# ----------------------------------------------------------------------------------------------
# torn and corrupt checkpoints


@pytest.fixture(scope="module")
def saved_run(ds_world, make_tiny_llama, tmp_path_factory) -> Path:
    """A run directory with two complete checkpoints, step 1 and step 2 (tests copy it before damaging it)."""
    root = tmp_path_factory.mktemp("run")
    engine = make_engine(make_tiny_llama)
    for step in (1, 2):
        train(engine, 1, seed=step)
        save(engine, root, step, {"step": step}, keep=5)
    return root


def copy_run(saved_run: Path, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(saved_run, root)
    return root


def _drop_marker(ckpt: Path) -> None:
    (ckpt / MARKER).unlink()


def _truncate(ckpt: Path) -> None:
    model = ckpt / "mp_rank_00_model_states.pt"
    os.truncate(model, model.stat().st_size // 2)


def _flip_byte(ckpt: Path) -> None:
    model = ckpt / "mp_rank_00_model_states.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))


def _drop_file(ckpt: Path) -> None:
    (ckpt / STATE).unlink()


def _edit_manifest(ckpt: Path) -> None:
    manifest = json.loads((ckpt / MANIFEST).read_bytes())
    manifest["files"][STATE]["size"] += 1
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _torn_marker(ckpt: Path) -> None:
    (ckpt / MARKER).write_text('{"step": 2, "manif')


DAMAGE = {
    "no marker": (_drop_marker, "no completion marker"),
    "truncated file": (_truncate, "bytes, the manifest says"),
    "flipped byte": (_flip_byte, "does not match its sha256"),
    "missing file": (_drop_file, f"{STATE} is missing"),
    "edited manifest": (_edit_manifest, "manifest does not match"),
    "torn marker": (_torn_marker, "unreadable completion marker"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_latest_skips_a_damaged_checkpoint(saved_run, tmp_path, caplog, damage):
    root = copy_run(saved_run, tmp_path)
    assert latest(root) == root / step_tag(2)
    spoil, problem = DAMAGE[damage]
    spoil(root / step_tag(2))
    with caplog.at_level(logging.WARNING, CKPT_LOG):
        assert latest(root) == root / step_tag(1)
    [line] = [r.getMessage() for r in caplog.records if r.name == CKPT_LOG]
    assert str(root / step_tag(2)) in line and problem in line


def test_load_refuses_a_torn_checkpoint(ds_world, make_tiny_llama, saved_run, tmp_path):
    root = copy_run(saved_run, tmp_path)
    _drop_marker(root / step_tag(2))
    with pytest.raises(DviError, match="no completion marker"):
        load(make_engine(make_tiny_llama), root / step_tag(2))


def test_latest_of_an_empty_or_missing_run_dir_is_none(tmp_path):
    assert latest(tmp_path / "nothing") is None
    assert latest(tmp_path) is None


def test_latest_removes_leftovers_of_interrupted_saves(saved_run, tmp_path):
    root = copy_run(saved_run, tmp_path)
    (root / ".tmp-step-00000003" / "step-00000003").mkdir(parents=True)
    assert latest(root, clean=False) == root / step_tag(2)
    assert (root / ".tmp-step-00000003").exists()
    assert latest(root) == root / step_tag(2)
    assert not (root / ".tmp-step-00000003").exists()


# ----------------------------------------------------------------------------------------------
# SIGKILL in the middle of a save

KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from dvi.config import TrainerConfig
    from trainers import checkpoint
    from trainers.ds import build_engine

    root, pause_before, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def pause(*args, **kwargs):
        print("PAUSED", flush=True)
        time.sleep(600)
    setattr(checkpoint, pause_before, pause)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    engine = build_engine(LlamaForCausalLM(config), TrainerConfig())
    checkpoint.save(engine, root, step, {"step": step}, keep=5)
    """
)
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def save_and_kill(root: Path, pause_before: str, step: int = 3) -> None:
    """Run a save of `step` in a fresh process, SIGKILL it as it reaches `checkpoint.<pause_before>`."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}  # the child makes its own world of one
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(root), pause_before, str(step)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    try:
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.strip() == "PAUSED" or not line:
                break
        assert line.strip() == "PAUSED", "".join(lines[-30:])
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.stdout.close()


@pytest.mark.slow
def test_sigkill_before_the_rename_leaves_the_previous_checkpoint(saved_run, tmp_path):
    root = copy_run(saved_run, tmp_path)
    save_and_kill(root, "_install")
    assert (root / ".tmp-step-00000003" / step_tag(3) / MANIFEST).is_file()  # sealed, not yet renamed
    assert latest(root) == root / step_tag(2)
    assert not (root / ".tmp-step-00000003").exists()


@pytest.mark.slow
def test_sigkill_before_the_marker_leaves_the_previous_checkpoint(saved_run, tmp_path, caplog):
    root = copy_run(saved_run, tmp_path)
    save_and_kill(root, "_write_marker")
    assert (root / step_tag(3) / MANIFEST).is_file() and not (root / step_tag(3) / MARKER).exists()
    with caplog.at_level(logging.WARNING, CKPT_LOG):
        assert latest(root) == root / step_tag(2)
    assert f"{root / step_tag(3)}: no completion marker" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("pause_before", ["_install", "_write_marker"])
def test_sigkill_while_a_step_is_saved_again_leaves_its_first_save(saved_run, tmp_path, pause_before):
    """Step 2 saved again (a checkpoint due by time, no step taken since) goes beside the first save of step 2,
    which stands whole until the new one is complete."""
    root = copy_run(saved_run, tmp_path)
    save_and_kill(root, pause_before, step=2)
    assert latest(root) == root / step_tag(2) and verify(root / step_tag(2)) is None
    assert not (root / step_tag(2, 1) / MARKER).exists()  # the second save: never renamed into place, or unmarked


# ----------------------------------------------------------------------------------------------
# pruning


def steps_in(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-").split("-")[0]) for p in root.glob("step-*"))


def test_pruning_keeps_the_newest_n(ds_world, make_tiny_llama, one_thread, tmp_path):
    engine = make_engine(make_tiny_llama)
    for step in range(1, 6):
        save(engine, tmp_path, step, {"step": step}, keep=3)
        assert steps_in(tmp_path) == list(range(max(1, step - 2), step + 1))
    (tmp_path / step_tag(5) / MARKER).unlink()  # torn: never counted among the kept, removed by the next save
    save(engine, tmp_path, 6, {}, keep=3)
    assert steps_in(tmp_path) == [3, 4, 6]
    again = save(engine, tmp_path, 6, {"again": True}, keep=1)  # the same step again: a new name, then the old goes
    assert again.name == step_tag(6, 1) == "step-00000006-1" and latest(tmp_path) == again
    assert load(engine, again) == {"again": True} and [p.name for p in tmp_path.iterdir()] == [again.name]
    third = save(engine, tmp_path, 6, {"third": True}, keep=2)
    assert third.name == step_tag(6, 2) and latest(tmp_path) == third
    assert sorted(p.name for p in tmp_path.iterdir()) == [again.name, third.name]
    assert save(engine, tmp_path, 7, {}, keep=2).name == step_tag(7) and steps_in(tmp_path) == [6, 7]



def test_a_save_behind_newer_checkpoints_removes_them(ds_world, make_tiny_llama, tmp_path):
    """Resuming from step 1 (step 2 was corrupt) starts a new timeline: the abandoned step 2 must not shadow it."""
    engine = make_engine(make_tiny_llama)
    for step in (1, 2):
        save(engine, tmp_path, step, {}, keep=3)
    resumed = save(engine, tmp_path, 1, {"resumed": True}, keep=3)
    assert steps_in(tmp_path) == [1, 1] and latest(tmp_path) == resumed == tmp_path / step_tag(1, 1)
    assert load(engine, resumed) == {"resumed": True}


# ----------------------------------------------------------------------------------------------
# LoRA


def lora_cfg(**kw) -> TrainerConfig:
    return TrainerConfig(finetune="lora", lora_r=4, lora_alpha=8, lr=1e-2, **kw)


def test_full_finetune_leaves_the_model_alone(make_tiny_llama):
    model = make_tiny_llama(seed=0, vocab=VOCAB)
    assert apply_lora(model, TrainerConfig()) is model


def test_lora_targets_that_fit_nothing_name_the_setting(make_tiny_llama):
    with pytest.raises(DviError, match="trainer.lora_targets"):
        apply_lora(make_tiny_llama(seed=0, vocab=VOCAB), lora_cfg(lora_targets=("no_such_proj",)))


def test_lora_trains_adapters_only_and_merges_into_plain_weights(ds_world, make_tiny_llama, one_thread):
    base = make_tiny_llama(seed=0, vocab=VOCAB)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    engine = build_engine(apply_lora(base, lora_cfg()), lora_cfg())
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    train(engine, 2)

    merged = merged_state_dict(engine)
    plain = LlamaForCausalLM(base.config).eval()
    assert merged.keys() == plain.state_dict().keys()
    assert any(not torch.equal(merged[k], before[k]) for k in merged)  # the adapters learned something
    assert torch.equal(merged["model.embed_tokens.weight"], before["model.embed_tokens.weight"])  # not a target
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    engine.module.eval()
    with torch.no_grad():
        lora_logits = engine.module(input_ids=ids).logits
        plain.load_state_dict(before)
        assert (plain(input_ids=ids).logits - lora_logits).abs().max() > 0.1  # the check below can tell
        plain.load_state_dict(merged)
        # fp32 rounding differs between W x + B A x and (W + B A) x; logits here reach about 25
        torch.testing.assert_close(plain(input_ids=ids).logits, lora_logits, rtol=1e-4, atol=1e-4)
    assert any(".lora_A." in n for n, _ in engine.module.named_parameters())  # merging left the adapters in place


def test_lora_checkpoint_round_trips(ds_world, make_tiny_llama, one_thread, tmp_path):
    engine = build_engine(apply_lora(make_tiny_llama(seed=0, vocab=VOCAB), lora_cfg()), lora_cfg())
    train(engine, 2)
    path = save(engine, tmp_path, 2, {"lora": True}, keep=1)
    fresh = build_engine(apply_lora(make_tiny_llama(seed=1, vocab=VOCAB), lora_cfg()), lora_cfg())
    assert load(fresh, path) == {"lora": True}
    assert_same(engine.module.state_dict(), fresh.module.state_dict(), "weights")
    assert_same(engine.optimizer.state_dict(), fresh.optimizer.state_dict(), "optimizer")
