"""The model store: published drafter versions as plain directories, written atomically, checked by sha256.

A version is `<store>/<version>/`, a drafter directory that `dvi.models.load_drafter` reads: the parent
drafter's config and tokenizer files, `model.safetensors` (a reduced-vocabulary head goes to
`draft_head.safetensors` with its token ids, as `build_drafter` writes it), `dvi_drafter.json` (version,
parent, lineage and gate metadata; the parent's `kind`, "eagle3" for an EAGLE-3 drafter, whose config.json is the
speculators format and whose model.safetensors holds its fc, midlayer, head and d2t/t2d, `dvi.eagle3`) and `SHA256SUMS` (sha256 of every other file). The digest of SHA256SUMS pins
the whole version: it travels in the control message and the registry, and a server checks it before loading.
Weights are safetensors only; `verify` refuses a directory holding any pickle-capable weight file.

Writes go to `<store>/.tmp-<version>-<random>`, are fsynced, and are renamed into place: a crash leaves no
visible version.

`<store>/VERDICTS` keeps what live traffic decided about versions, one JSON line each (`record_verdict`):
`production` (a replica kept it) or `rejected` (a replica rolled it back). The trainer, the store's one writer,
records them from the control topic; a replica that starts reads them (`serving_candidates`), so a restart serves
the current production drafter, never one that was rolled back. This module knows files and safetensors, not
training, Kafka or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from dvi import control
from dvi.drafter_kinds import kind_of_config
from dvi.errors import DviError
from dvi.files import fsync_path, sha256_file
from dvi.models import DRAFT_HEAD, DRAFTER_META, cache_dir, read_drafter_meta

SUMS = "SHA256SUMS"
VERDICTS = "VERDICTS"
PRODUCTION, REJECTED = "production", "rejected"
WEIGHTS = "model.safetensors"
MAX_INFO_CHARS = 500  # of each detail kept with a verdict
# what a published version may hold: its own files, and the config and tokenizer files copied from its parent
ALLOWED_FILES = frozenset([SUMS, WEIGHTS, DRAFT_HEAD, DRAFTER_META, "config.json", "generation_config.json",
                           "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                           "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model"])
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_TMP = ".tmp-"
_OWN_FILES = {SUMS, WEIGHTS, DRAFT_HEAD, DRAFTER_META}


@dataclass(frozen=True)
class Published:
    version: str
    path: Path
    sha256: str  # of SHA256SUMS: pins every file of the version
    bytes: int


def default_root(cfg) -> Path:
    """The store a `dvi.config.DviConfig` names for its trainer: `trainer.store`, or <cache>/store."""
    return Path(cfg.trainer.store).expanduser() if cfg.trainer.store else cache_dir(cfg.model) / "store"


def serving_root(cfg) -> Path:
    """The only directory a replica loads drafters from: `serve.swap.store`, or the trainer's store (resolved)."""
    return (Path(cfg.serve.swap.store).expanduser() if cfg.serve.swap.store else default_root(cfg)).resolve()


def check_version_name(version: str) -> None:
    """DviError unless `version` is a drafter version name (`dvi.control.check_version`) a store can hold."""
    try:
        control.check_version(version)
    except control.ControlError as e:
        raise DviError(str(e)) from None
    if version.startswith(_TMP):
        raise DviError(f"invalid drafter version name {version!r}: {_TMP}* names are the store's temporary folders")


def publish(store: Path, version: str, state_dict: dict[str, torch.Tensor], source_dir: Path, meta: dict,
            vocab_map: torch.Tensor | None = None) -> Published:
    """Write `state_dict` as drafter `version` into `store` (see the module docstring); returns where and its digest.

    state_dict: the drafter's weights with the base model's keys (for a reduced head, `lm_head.weight` is
    [N, hidden] and `vocab_map` [N] its target ids); source_dir: the parent drafter's directory (config and
    tokenizer files are copied from it); meta: recorded in dvi_drafter.json next to version and time (and the
    parent's kind, unless meta names one). A parent whose config.json is the speculators format's for eagle3 makes
    an EAGLE-3 version: `state_dict` is an `Eagle3Drafter`'s, written to model.safetensors as vLLM reads it (fc,
    midlayer, norm, lm_head with d2t and t2d; not the shared embedding, which is the target's; `vocab_map` is
    its d2t's and is not written apart).
    """
    check_version_name(version)
    store, source_dir = Path(store).expanduser(), Path(source_dir).expanduser()
    final = store / version
    if final.exists():
        raise DviError(f"drafter version {version!r} already exists in the store {store}")
    if not (source_dir / "config.json").is_file():
        raise DviError(f"the parent drafter directory {source_dir} has no config.json")
    store.mkdir(parents=True, exist_ok=True)
    tmp = store / f"{_TMP}{version}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        for f in sorted(source_dir.iterdir()):  # config, generation config, tokenizer files
            if f.is_file() and f.name in ALLOWED_FILES and f.name not in _OWN_FILES:
                shutil.copy2(f, tmp / f.name)
        weights = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        config = json.loads((source_dir / "config.json").read_text())
        kind = kind_of_config(config)
        if kind is None:
            raise DviError(f"the parent drafter directory {source_dir}: its config.json is no kind of drafter dvi knows")
        for name, tensors in kind.version_tensors(weights, config, vocab_map).items():  # the files its kind reads back
            if name == WEIGHTS:
                save_file(_unshared(tensors), str(tmp / WEIGHTS), metadata={"format": "pt"})
            else:
                save_file(tensors, str(tmp / name))
        kind = read_drafter_meta(source_dir).get("kind")
        meta = {**({"kind": kind} if kind else {}), **meta, "version": version, "created": time.time()}
        (tmp / DRAFTER_META).write_text(json.dumps(meta, indent=2, default=str))
        sums = "".join(f"{sha256_file(f)}  {f.name}\n" for f in sorted(tmp.iterdir()) if f.is_file())
        (tmp / SUMS).write_text(sums)
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        tmp.rename(final)
        fsync_path(store)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in final.iterdir())
    return Published(version, final, sha256_file(final / SUMS), size)


class VersionError(DviError):
    """A version directory that must not be loaded; `kind` is "pickle" (a pickle-capable file), "files" (what else
    the directory holds) or "checksum"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def read_verified(path: Path, sha256: str | None = None, max_bytes: int | None = None) -> dict[str, bytes]:
    """Every file of the version at `path`, read once, as name -> bytes: the bytes a caller loads are the bytes
    checked here. VersionError unless no entry is a pickle-capable weight file, every entry is a regular file (lstat:
    no links, no folders), they hold at most `max_bytes` in all, SHA256SUMS matches `sha256` (when given) and
    lists exactly the other files with their digests, and every name is one ALLOWED_FILES has."""
    path = Path(path).expanduser()
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        raise VersionError("files", f"drafter version directory {path} cannot be read ({e.strerror})") from None
    pickles = [name for name in names if name.endswith(PICKLE_SUFFIXES)]
    if pickles:  # nothing here ever unpickles: refused by name, before anything is read
        raise VersionError("pickle", f"{path} holds pickle-capable weight files {pickles}: refusing to load (safetensors only)")
    sizes = {}
    for name in names:
        st = os.lstat(path / name)
        if not stat.S_ISREG(st.st_mode):
            raise VersionError("files", f"{path / name} is not a regular file (a link or a folder): refusing the version")
        sizes[name] = st.st_size
    if SUMS not in sizes:
        raise VersionError("files", f"{path} has no {SUMS}: not a published drafter version")
    if max_bytes is not None and sum(sizes.values()) > max_bytes:
        raise VersionError("files", f"{path} holds {sum(sizes.values())} bytes, more than the {max_bytes} a drafter of "
                                    "this target may take")
    sums = _read_regular(path / SUMS, sizes[SUMS])
    if sha256 is not None and hashlib.sha256(sums).hexdigest() != sha256:
        raise VersionError("checksum", f"{path / SUMS} does not match the expected digest {sha256[:12]}...: the version was "
                                       "altered or is not the one announced")
    listed = {}
    for line in sums.decode("utf-8", "replace").splitlines():
        digest, _, name = line.partition("  ")
        if not name or "/" in name or name in (".", ".."):
            raise VersionError("checksum", f"{path / SUMS}: malformed line {line[:100]!r}")
        listed[name] = digest
    extra = sorted(set(sizes) - set(listed) - {SUMS})
    if extra:
        raise VersionError("files", f"{path} holds files not listed in {SUMS}: {extra}")
    foreign = sorted(set(listed) - ALLOWED_FILES)
    if foreign:
        raise VersionError("files", f"{path}: {foreign} are not files a drafter version holds ({', '.join(sorted(ALLOWED_FILES))})")
    data = {SUMS: sums}
    for name, digest in listed.items():
        if name not in sizes:
            raise VersionError("checksum", f"{path / name} is listed in {SUMS} but missing")
        data[name] = _read_regular(path / name, sizes[name])
        if hashlib.sha256(data[name]).hexdigest() != digest:
            raise VersionError("checksum", f"{path / name} does not match its sha256 in {SUMS}: corrupt or altered")
    return data


def _read_regular(path: Path, size: int) -> bytes:
    """The bytes of a regular file, opened without following links, at most the `size` its lstat gave."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise VersionError("files", f"{path} cannot be opened as a regular file ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise VersionError("files", f"{path} is not a regular file")
        data = f.read(size + 1)
    if len(data) != size:
        raise VersionError("files", f"{path} changed while it was read")
    return data


def verify(path: Path, sha256: str | None = None) -> None:
    """Raise a DviError naming the problem unless the version at `path` passes `read_verified`."""
    read_verified(path, sha256)


def versions(store: Path) -> list[str]:
    """Complete versions in the store, oldest first (by creation time in their metadata)."""
    store = Path(store).expanduser()
    if not store.is_dir():
        return []
    found = []
    for d in store.iterdir():
        if d.is_dir() and not d.name.startswith(_TMP) and (d / SUMS).is_file():
            try:
                created = float(json.loads((d / DRAFTER_META).read_text()).get("created", 0.0))
            except (OSError, ValueError):
                created = 0.0
            found.append((created, d.name))
    return [name for _, name in sorted(found)]


def older(store: Path, version: str, than: str) -> bool:
    """Whether `version` was published before `than` (both complete versions of the store; `versions` order)."""
    names = versions(store)
    return version in names and than in names and names.index(version) < names.index(than)


def record_verdict(store: Path, version: str, verdict: str, **info) -> None:
    """Append live traffic's verdict on `version` (PRODUCTION or REJECTED) to the store's VERDICTS, fsynced. Each
    value of `info` (who decided, why) is kept to its first MAX_INFO_CHARS characters: a line stays short."""
    check_version_name(version)
    if verdict not in (PRODUCTION, REJECTED):
        raise DviError(f"unknown verdict {verdict!r}: expected {PRODUCTION} or {REJECTED}")
    store = Path(store).expanduser()
    store.mkdir(parents=True, exist_ok=True)
    info = {k: None if v is None else str(v)[:MAX_INFO_CHARS] for k, v in info.items()}
    line = json.dumps({"version": version, "verdict": verdict, "time": time.time(), **info}) + "\n"
    with open(store / VERDICTS, "a", encoding="utf-8") as f:  # one short append: whole lines, even with two writers
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def verdicts(store: Path) -> dict[str, str]:
    """version -> its latest verdict (lines that do not parse are skipped)."""
    path = Path(store).expanduser() / VERDICTS
    found: dict[str, str] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            entry = json.loads(line)
            found[str(entry["version"])] = str(entry["verdict"])
        except (ValueError, KeyError, TypeError):
            continue
    return found


def serving_candidates(store: Path, prefer_production: bool = True) -> list[str]:
    """The versions a replica may start with, best first: those kept in production, newest first (unless
    `prefer_production` is off), then the others never rejected, newest first. A replica serves the first that passes
    its checks (a newest version that fails them does not send it back to its configured drafter)."""
    names, said = versions(store), verdicts(store)
    kept = [n for n in reversed(names) if said.get(n) == PRODUCTION] if prefer_production else []
    return kept + [n for n in reversed(names) if said.get(n) != REJECTED and n not in kept]


def serving_version(store: Path, prefer_production: bool = True) -> str | None:
    """The first of `serving_candidates` (what a replica starts with when it passes its checks); None when there is none."""
    return next(iter(serving_candidates(store, prefer_production)), None)


def next_version(store: Path, prefix: str = "d") -> str:
    """The next free version name: d0001, d0002, ... (sortable; gaps and other names are left alone)."""
    store = Path(store).expanduser()
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)")
    taken = [int(m.group(1)) for d in (store.iterdir() if store.is_dir() else []) if (m := pattern.fullmatch(d.name.split("-")[0]))]
    # tmp directories count too: a crashed publish never hands its number to someone else mid-write
    taken += [int(m.group(1)) for d in (store.iterdir() if store.is_dir() else [])
              if d.name.startswith(_TMP) and (m := pattern.match(d.name[len(_TMP):]))]
    return f"{prefix}{max(taken, default=0) + 1:04d}"


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory: give each its own copy where they do."""
    seen, out = set(), {}
    for k, v in weights.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out
