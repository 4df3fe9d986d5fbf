"""Whether serving has requests in flight, as files a supervisor watches: how `dvi up` stops its trainer while the
server answers (`trainer.cpu_priority=pause`).

A serving process started with $DVI_BUSY_DIR keeps one file there, `<pid>.busy`, whose one byte says whether it has
a request in flight (`BusyFile.set`: written only when that changes, one byte in place). `busy(directory)` says
whether any live process's file says so; a file left by a process that is gone never counts.

This module knows files and pids; what a request is and what to do while serving is busy are its callers'.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "DVI_BUSY_DIR"
SUFFIX = ".busy"


class BusyFile:
    """This process's busy file in `directory` (made if missing), set to not busy."""

    def __init__(self, directory: str | os.PathLike):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"{os.getpid()}{SUFFIX}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._state: bool | None = None
        self.set(False)

    def set(self, busy: bool) -> None:
        if busy != self._state:
            os.pwrite(self._fd, b"1" if busy else b"0", 0)
            self._state = busy

    @classmethod
    def from_env(cls) -> BusyFile | None:
        """The busy file $DVI_BUSY_DIR asks for; None where it is not set."""
        directory = os.environ.get(ENV)
        return cls(directory) if directory else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's process: alive
        return True
    return True


def busy(directory: str | os.PathLike) -> bool:
    """Whether a live process's busy file in `directory` says it has a request in flight."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return False
    for entry in entries:
        if not entry.name.endswith(SUFFIX) or not entry.name[: -len(SUFFIX)].isdigit():
            continue
        try:
            with open(entry.path, "rb") as f:
                flag = f.read(1)
        except OSError:
            continue
        if flag == b"1" and _alive(int(entry.name[: -len(SUFFIX)])):
            return True
    return False
