"""Training checkpoints that are never torn: DeepSpeed's state plus the trainer's own, sealed on disk.

This module owns the files under the trainer's run directory. A checkpoint is the directory
`<root>/step-<08d>/` (`step-<08d>-<n>/` for the n-th save of the same step again, e.g. a checkpoint due by
time while no step was taken: checkpoints order by step, then n) holding DeepSpeed's files (weights,
optimizer, ZeRO shards), `dvi_state.json` (the trainer's JSON-able `state`), `MANIFEST.json` (relative path
-> sha256 and size of every other file) and, written last, the completion marker `COMPLETE` (step, the
manifest's sha256, ZeRO stage, world size). It knows DeepSpeed and files; it does not know what `state`
holds (record-id ledger, consumer offsets, lineage are the trainer's), nor records or Kafka.

How a save stays atomic: DeepSpeed writes into `<root>/.tmp-<tag>/`; every file is
hashed and fsynced, the manifest written, the directory renamed into place and fsynced, and only then the
marker is written (itself through a rename) and fsynced. A crash at any point leaves either a `.tmp-*`
leftover (removed by `latest`) or a step directory without a marker (skipped by `latest`, removed by the
next save's pruning). `latest` returns the newest checkpoint whose marker exists and whose files match the
manifest; `load` refuses one without a marker, and reads DeepSpeed's files with `torch.load(weights_only=True)`:
nothing in a checkpoint is unpickled as code.

Several ranks: every rank calls `save` and `load` (DeepSpeed's save and load are collective); rank 0 alone
seals, renames, marks and prunes, so the run directory must be one filesystem that all ranks share.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum

from dvi.errors import DviError
from dvi.files import fsync_path, sha256_file, write_synced

log = logging.getLogger("dvi.trainers.checkpoint")

# what DeepSpeed's optimizer files hold besides tensors and containers: a loss scaler, the ZeRO stage, fragment
# addresses (deepspeed.utils.tensor_fragment is imported by name: deepspeed.utils rebinds that attribute)
DEEPSPEED_GLOBALS = [LossScaler, ZeroStageEnum, importlib.import_module("deepspeed.utils.tensor_fragment").fragment_address]
STATE = "dvi_state.json"
MANIFEST = "MANIFEST.json"
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step-(\d{8,})(?:-(\d+))?")
_TMP = ".tmp-"


def step_tag(step: int, again: int = 0) -> str:
    """The directory name of step `step`'s checkpoint, the `again`-th save of that step after the first."""
    return f"step-{step:08d}" + (f"-{again}" if again else "")


# ----------------------------------------------------------------------------------------------
# save


def save(engine: DeepSpeedEngine, root: Path, step: int, state: dict, *, keep: int) -> Path:
    """Write a complete checkpoint of `engine` and `state` as `<root>/step-<08d>` and return its path; then
    prune to the `keep` newest complete checkpoints, the new one always among them. Every rank calls it.

    The new checkpoint becomes the newest: step directories with a higher step (an abandoned timeline,
    e.g. corrupt ones that `latest` skipped) are removed, as are torn ones. A step saved again gets a new name
    (`step-<08d>-<n>`), so the checkpoint it follows stands until the new one is complete.
    """
    root = Path(root)
    tag = step_tag(step, _agains(root, step))
    tmp = root / f"{_TMP}{tag}"
    final = root / tag
    # serialised first: a state that is not JSON-able fails before anything is written
    state_bytes = json.dumps(state, separators=(",", ":")).encode() if _rank() == 0 else b""
    if _rank() == 0:
        _remove(tmp)
    _barrier()
    try:
        engine.save_checkpoint(str(tmp), tag=tag, client_state={"dvi_step": step}, save_latest=False)
        if _rank() == 0:  # DeepSpeed's save ends in a barrier: every rank's files are written
            manifest_sha = _seal(tmp / tag, state_bytes)
            _install(tmp, tag, final)
            marker = {"step": step, "manifest_sha256": manifest_sha, "zero_stage": engine.zero_optimization_stage(),
                      "world_size": _world_size(), "time": time.time()}
            _write_marker(final, marker)
            _prune(root, final, keep)
    except BaseException:  # a failed write (disk full): give the space back; the previous checkpoints stay as they are
        if _rank() == 0:
            _remove(tmp)
            if final.exists() and not (final / MARKER).exists():
                _remove(final)
        raise
    _barrier()
    return final


def _seal(ckpt: Path, state_bytes: bytes) -> str:
    """Write the state and the manifest into `ckpt`, fsync every file and directory; the manifest's sha256."""
    write_synced(ckpt / STATE, state_bytes)
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        files[path.relative_to(ckpt).as_posix()] = {"sha256": sha256_file(path, fsync=True), "size": path.stat().st_size}
    manifest = json.dumps({"files": files}, indent=1, sort_keys=True).encode()
    write_synced(ckpt / MANIFEST, manifest)
    for directory in sorted((p for p in ckpt.rglob("*") if p.is_dir()), reverse=True):
        fsync_path(directory)
    fsync_path(ckpt)
    return hashlib.sha256(manifest).hexdigest()


def _agains(root: Path, step: int) -> int:
    """How many times `step` was saved before under `root` (0: never): the next save's `again`. Every rank sees
    the same directory: the last save ended in a barrier after its pruning."""
    found = [again for (s, again), _ in _step_dirs(root) if s == step] if root.is_dir() else []
    return max(found) + 1 if found else 0


def _install(tmp: Path, tag: str, final: Path) -> None:
    """Rename the sealed `tmp/tag` to `final` and drop `tmp`."""
    os.rename(tmp / tag, final)
    fsync_path(final.parent)
    _remove(tmp)  # whatever DeepSpeed put beside the tag directory (zero_to_fp32.py)


def _write_marker(final: Path, marker: dict) -> None:
    part = final / f"{MARKER}.part"
    write_synced(part, json.dumps(marker, sort_keys=True).encode())
    os.rename(part, final / MARKER)
    fsync_path(final)


def _prune(root: Path, current: Path, keep: int) -> None:
    """Keep `current` and the `keep - 1` newest complete checkpoints before it; remove every other step directory."""
    step = _step_of(current)
    older = [p for s, p in _step_dirs(root) if s < step and (p / MARKER).is_file()]
    kept = {current, *older[-(keep - 1):]} if keep > 1 else {current}
    for _, path in _step_dirs(root):
        if path not in kept:
            # renamed first, so a crash mid-delete leaves a `.tmp-*` leftover, not a half-deleted checkpoint
            doomed = root / f"{_TMP}pruned-{path.name}"
            os.rename(path, doomed)
            _remove(doomed)


# ----------------------------------------------------------------------------------------------
# find, verify, load


def latest(root: Path, clean: bool = True) -> Path | None:
    """The newest complete, intact checkpoint under `root`, or None. Torn or corrupt ones are skipped with a
    warning. `clean` removes `.tmp-*` leftovers of interrupted saves (only the run directory's owner should)."""
    root = Path(root)
    if not root.is_dir():
        return None
    if clean and _rank() == 0:
        for leftover in root.glob(f"{_TMP}*"):
            _remove(leftover)
    for _, path in reversed(_step_dirs(root)):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def verify(path: Path, hashes: bool = True) -> str | None:
    """What is wrong with the checkpoint at `path` (None: nothing). Sizes are always checked, sha256 if `hashes`."""
    try:
        marker = json.loads((path / MARKER).read_bytes())
    except FileNotFoundError:
        return "no completion marker (the save did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable completion marker ({e})"
    try:
        manifest = (path / MANIFEST).read_bytes()
    except OSError as e:
        return f"unreadable manifest ({e})"
    if not isinstance(marker, dict) or hashlib.sha256(manifest).hexdigest() != marker.get("manifest_sha256"):
        return "manifest does not match the sha256 in the completion marker"
    try:
        files = json.loads(manifest)["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"malformed manifest ({e})"
    return _check_files(path, files, hashes)


def _check_files(path: Path, files: dict, hashes: bool) -> str | None:
    for rel, expected in files.items():
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        size = file.stat().st_size
        if size != expected["size"]:
            return f"{rel} has {size} bytes, the manifest says {expected['size']} (truncated or overwritten)"
    if hashes:
        for rel, expected in files.items():
            if sha256_file(path / rel) != expected["sha256"]:
                return f"{rel} does not match its sha256 in the manifest (corrupt)"
    return None


def load(engine: DeepSpeedEngine, path: Path) -> dict:
    """Restore `engine` (weights, optimizer, scheduler) from the checkpoint at `path`; return its `state`.
    Every rank calls it. Refuses a checkpoint without its marker or with files of the wrong size."""
    path = Path(path)
    problem = verify(path, hashes=False)
    if problem is not None:
        raise DviError(f"checkpoint {path} cannot be loaded: {problem}; use `latest(run_dir)` to find an intact one")
    saved_stage = json.loads((path / MARKER).read_bytes()).get("zero_stage")
    if saved_stage != engine.zero_optimization_stage():
        raise DviError(f"checkpoint {path} was saved with trainer.zero_stage={saved_stage}, this run uses "
                       f"{engine.zero_optimization_stage()}: set it back, or point trainer.run_dir at a new directory")
    hint = ("was it written for another drafter, finetune mode (full / LoRA) or world size? Use those settings, "
            "or point trainer.run_dir at a new directory")
    try:
        with _weights_only(engine):
            loaded, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    except Exception as e:  # DeepSpeed raises whatever torch.load or load_state_dict raised
        raise DviError(f"DeepSpeed could not load checkpoint {path} ({type(e).__name__}: {e}): {hint}") from e
    if loaded is None:
        raise DviError(f"DeepSpeed found no checkpoint it can load in {path}: {hint}")
    try:
        return json.loads((path / STATE).read_bytes())
    except (OSError, ValueError) as e:
        raise DviError(f"checkpoint {path} has an unreadable {STATE} ({e})") from e


@contextlib.contextmanager
def _weights_only(engine: DeepSpeedEngine) -> Iterator[None]:
    """Within: DeepSpeed reads checkpoint files with `torch.load(weights_only=True)`, so a file that was tampered
    with cannot run code while it loads; the only classes it may build beyond tensors and plain containers are
    the few DeepSpeed writes into its optimizer files (DEEPSPEED_GLOBALS)."""
    reader = engine.checkpoint_engine

    def load(path, map_location=None):
        with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)

    reader.load = load  # on this instance only, for this call
    try:
        yield
    finally:
        del reader.load


# ----------------------------------------------------------------------------------------------
# files and ranks


def _step_dirs(root: Path) -> list[tuple[tuple[int, int], Path]]:
    """((step, again), path) of every step directory under `root`, oldest first."""
    found = [(_step_of(p), p) for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(found)


def _step_of(path: Path) -> tuple[int, int]:
    """(step, again): the order of checkpoints."""
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)), int(m.group(2) or 0)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
