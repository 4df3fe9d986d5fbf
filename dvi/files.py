"""Durable file helpers shared by the model store, the trainer's checkpoints and the pinned downloads: digests,
digest checks and fsync.

Knows bytes on disk, nothing about models or what the files mean.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from dvi.errors import DviError


def sha256_file(path: Path, fsync: bool = False) -> str:
    """The file's sha256 hex digest, read in 1 MiB blocks; with `fsync`, also flushes it to disk."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def check_sha256(path: Path, expected: str, what: str) -> None:
    """Refuse (DviError naming `what`, the file and both digests) a file whose sha256 is not the pinned `expected`."""
    found = sha256_file(path)
    if found != expected:
        raise DviError(f"{what} at {path} has sha256 {found}, not the pinned {expected}: refusing to use it "
                       "(a corrupted or tampered download or install)")


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_once(path: Path, data: bytes, mode: int) -> None:
    """Write `path` unless it exists: a temporary file linked into place, so a reader never sees half of it and the
    first of two writers wins."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
