"""The drafters that ship with dvi: the demo pair's bootstrap drafter, and its installation into the model cache.

`smollm2-eagle3-bootstrap/` is an EAGLE-3 drafter for the demo target (SmolLM2-135M-Instruct) in the speculators
format, bf16, made by `dvi drafter bootstrap` (`benchmarks/gpu_bootstrap.sh`; how, on what, for how long and its
held-out acceptance per domain are in its dvi_drafter.json under `bootstrap`, and in
benchmarks/results/bootstrap-gpu-h200.json). It holds config.json, model.safetensors, dvi_drafter.json and
SHA256SUMS, whose own sha256 is pinned here (`SHIPPED_SHA256`): the store's checks (`dvi.store.read_verified`: no
pickle-capable file, nothing unlisted, every digest) run on it before it is installed, and the installed weights are
checked against it at every load. It holds no tokenizer: `installed_bootstrap` writes the target's beside it, and the
target's directory into its config, under `<cache>/models/eagle3-bootstrap`.

`dvi.pairs.pair_dirs` serves it for the demo pair's EAGLE-3 drafter (`model.drafter` null, the demo target, the
default draft vocabulary); `model.drafter=init` keeps the untrained drafter built from the target. This module knows
files; not training, serving or the store's versions.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
from pathlib import Path

from dvi import store
from dvi.drafter_kind_names import EAGLE3
from dvi.errors import DviError
from dvi.files import sha256_file
from dvi.models import DRAFTER_META, load_tokenizer, staged_dir

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).resolve().parent / "smollm2-eagle3-bootstrap"
SHIPPED_SHA256 = "b038790366a25a49fb1a9f54adb761f361d56028148bcbc7b2e5d374ad8e3355"  # of its SHA256SUMS
SHIPPED_VOCAB = 8192  # its draft vocabulary
INSTALLED = "eagle3-bootstrap"  # its directory under <cache>/models/
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def shipped_weights_sha256() -> str:
    """The sha256 of the shipped weights, as its SHA256SUMS (checked against `SHIPPED_SHA256`) lists it."""
    files = store.read_verified(SHIPPED, SHIPPED_SHA256)  # VersionError (a DviError) naming what is wrong
    for line in files[store.SUMS].decode().splitlines():
        digest, _, name = line.partition("  ")
        if name == WEIGHTS:
            return digest
    raise DviError(f"{SHIPPED / store.SUMS} lists no {WEIGHTS}")


def shipped_version() -> str:
    """The version name the shipped drafter serves under (its dvi_drafter.json's)."""
    return json.loads((SHIPPED / "dvi_drafter.json").read_text())["version"]


def installed_bootstrap(cache_dir: Path, target_dir: Path) -> Path:
    """The shipped bootstrap drafter as a drafter directory for the target at `target_dir`: `<cache>/models/
    eagle3-bootstrap`, the target's tokenizer beside it and the target's directory its verifier. Installed once; its
    weights are checked against the shipped digest every time, and an installed copy that does not match (altered, or
    a release before this one's) is replaced by the shipped one, with a warning. A DviError names a shipped copy that
    fails the store's checks."""
    digest = shipped_weights_sha256()
    out = Path(cache_dir) / "models" / INSTALLED
    if _installed(out, digest):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{INSTALLED}.lock", "w") as lock:  # processes starting at once install it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed(out, digest):
            return out
        if (out / DRAFTER_META).is_file():
            log.warning("%s does not match the shipped bootstrap drafter's sha256 %s...: installing the shipped one again",
                        out / WEIGHTS, digest[:12])
        _install(out, target_dir, digest)
    return out


def _installed(out: Path, digest: str) -> bool:
    return (out / DRAFTER_META).is_file() and (out / WEIGHTS).is_file() and sha256_file(out / WEIGHTS) == digest


def _install(out: Path, target_dir: Path, digest: str) -> None:
    with staged_dir(out, ".eagle3-bootstrap-") as staging:
        shutil.copy2(SHIPPED / WEIGHTS, staging / WEIGHTS)
        if sha256_file(staging / WEIGHTS) != digest:
            raise DviError(f"{SHIPPED / WEIGHTS} changed while it was installed")
        config = json.loads((SHIPPED / "config.json").read_text())
        config["speculators_config"]["verifier"]["name_or_path"] = str(Path(target_dir).resolve())
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        load_tokenizer(target_dir, "target").save_pretrained(staging)
        shutil.copy2(SHIPPED / DRAFTER_META, staging / DRAFTER_META)


def applies(cfg) -> bool:
    """Whether a `dvi.config.ModelConfig` asks for the shipped drafter: no drafter named, the demo target, an EAGLE-3
    drafter over the shipped draft vocabulary."""
    return (cfg.drafter is None and cfg.target is None and cfg.drafter_kind == EAGLE3
            and cfg.drafter_vocab in (None, SHIPPED_VOCAB))
