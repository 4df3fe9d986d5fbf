"""Whether serving has requests in flight, and whose turn it is on the CPU, as files in one directory: how `dvi up`
stops its trainer while the server answers (`trainer.cpu_priority=pause`), and how serving steps aside for the
trainer's share of the time (`trainer.pause_share`).

- A serving process started with $DVI_BUSY_DIR keeps one file there, `<pid>.busy`, whose one byte says whether it has
  a request in flight (`BusyFile.set`: written only when that changes, one byte in place). `busy(directory)` says
  whether any live process's file says so; a file left by a process that is gone never counts.
- Turns: while the supervisor lets the trainer run however busy serving is, it keeps a file `turn` there holding its
  pid (`Turn.give`). Serving's decoding loops look for it before each step (`TurnWait.wait`): while it is there they
  wait between two steps, with a file `<pid>.waiting` saying so (`Turn.taken`), so that the trainer has the cores to
  itself rather than two processes each slowing the other several-fold. A turn file whose supervisor is gone never
  counts, and no one turn file holds a step up for longer than `TurnWait.max_s`.
- `Serving(directory)`: whether serving is stepping now (a request in flight, no turn): where a process that waits on
  serving's next step may spin rather than sleep.
- Idle files: the part whose turns they are (`dvi up`'s trainer) keeps `<pid>.idle` there, one byte saying whether it
  waits with nothing to do (`IdleFile`); `idle(directory)` says whether every live process that keeps one says so, so
  that a turn it has no use for ends early rather than holding serving up.
- Claim files: that part also keeps `<pid>.claim`, the fraction of its share of serving's busy time it claims now, as
  five characters of text (`ClaimFile`: a trainer whose last candidates did not beat the serving drafter claims less);
  `claimed(directory)` is the largest a live process's file says, 1 where none says anything. `TurnTaker` is that
  part's side: its idle and claim files, and whether it has its turn now.

This module knows files and pids; what a request is and what to do while serving is busy are its callers'.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

ENV = "DVI_BUSY_DIR"
SUFFIX = ".busy"
IDLE = ".idle"  # `<pid>.idle`: the part whose turns they are says it waits with nothing to do
CLAIM = ".claim"  # `<pid>.claim`: the fraction of its share of serving's busy time that part claims now
TURN = "turn"  # the supervisor's file while the trainer has its turn (its pid)
WAITING = ".waiting"  # `<pid>.waiting`: a serving process waits for a turn to end

log = logging.getLogger(__name__)


class BusyFile:
    """This process's busy file in `directory` (made if missing), set to not busy."""

    SUFFIX = SUFFIX
    INITIAL: object = False

    def __init__(self, directory: str | os.PathLike):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"{os.getpid()}{self.SUFFIX}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._state: object = None
        self.set(self.INITIAL)

    def set(self, busy: bool) -> None:
        if busy != self._state:
            os.pwrite(self._fd, b"1" if busy else b"0", 0)
            self._state = busy

    @classmethod
    def from_env(cls) -> BusyFile | None:
        """The file $DVI_BUSY_DIR asks for; None where it is not set."""
        directory = os.environ.get(ENV)
        return cls(directory) if directory else None


class IdleFile(BusyFile):
    """This process's idle file in `directory` (made if missing), set to working: `set(True)` while it waits with nothing
    to do (`dvi up`'s trainer: nothing fresh to train on, or its trigger not active), `set(False)` once it has work."""

    SUFFIX = IDLE


class ClaimFile(BusyFile):
    """This process's claim file in `directory` (made if missing): the fraction of its share of serving's busy time the
    part claims now (`set`, clamped to [0, 1], written in place as five characters: "0.250"), 1 at first."""

    SUFFIX = CLAIM
    INITIAL = 1.0
    WIDTH = 5

    def set(self, fraction: float) -> None:
        fraction = min(1.0, max(0.0, float(fraction)))
        if fraction != self._state:
            os.pwrite(self._fd, f"{fraction:.3f}".encode(), 0)
            self._state = fraction


class TurnTaker:
    """The side of the part whose turns they are (`dvi up`'s trainer), over `directory`: `idle(bool)` says whether it
    waits with nothing to do (its `IdleFile`), `claim(fraction)` how much of its share of serving's busy time it claims
    (its `ClaimFile`), `has_turn()` whether a live supervisor's turn file is there now, serving waiting (or about to) for
    it to run: no record comes meanwhile, so that it need not wait for the stream to pause."""

    def __init__(self, directory: str | os.PathLike):
        self.file = IdleFile(directory)
        self.claims = ClaimFile(directory)
        self.path = Path(directory) / TURN

    def idle(self, on: bool) -> None:
        self.file.set(on)

    def claim(self, fraction: float) -> None:
        self.claims.set(fraction)

    def has_turn(self) -> bool:
        return turn_holder(self.path) is not None

    @classmethod
    def from_env(cls) -> TurnTaker | None:
        """The one $DVI_BUSY_DIR asks for; None where it is not set."""
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
    return any(flag == b"1" and _alive(pid) for pid, flag in _flags(directory, SUFFIX))


def idle(directory: str | os.PathLike) -> bool:
    """Whether some live process keeps an idle file in `directory` and every one that does says it is idle (a trainer of
    several ranks is idle when all of them are)."""
    flags = [flag == b"1" for pid, flag in _flags(directory, IDLE) if _alive(pid)]
    return bool(flags) and all(flags)


def claimed(directory: str | os.PathLike) -> float:
    """The fraction of its share of serving's busy time the part whose turns they are claims: the largest a live
    process's claim file in `directory` says (several ranks claim alike), 1 where none says a number in [0, 1] (a part
    that keeps no claim file claims its whole share)."""
    said = []
    for pid, text in _flags(directory, CLAIM, ClaimFile.WIDTH):
        try:
            fraction = float(text)
        except ValueError:  # not a number: says nothing
            continue
        if 0.0 <= fraction <= 1.0 and _alive(pid):
            said.append(fraction)
    return max(said, default=1.0)


def _flags(directory: str | os.PathLike, suffix: str, size: int = 1):
    """(pid, its first `size` bytes) of each file `<pid><suffix>` in `directory` that can be read."""
    for pid, path in _named(directory, suffix):
        try:
            with open(path, "rb") as f:
                flag = f.read(size)
        except OSError:
            continue
        yield pid, flag


def _named(directory: str | os.PathLike, suffix: str) -> list[tuple[int, str]]:
    """(pid, path) of each file `<pid><suffix>` in `directory`."""
    try:
        entries = list(os.scandir(directory))
    except OSError:  # missing, not a directory, unreadable: nobody said anything there (serving's readers ask in a loop)
        return []
    return [(int(e.name[: -len(suffix)]), e.path) for e in entries
            if e.name.endswith(suffix) and e.name[: -len(suffix)].isdigit()]


class Turn:
    """The supervisor's side of the turns: `give(True)` puts the turn file in `directory` (serving waits between steps),
    `give(False)` takes it away (serving goes on); `taken()`: whether a live serving process is waiting now."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / TURN
        self.path.unlink(missing_ok=True)  # one a supervisor killed outright left: its pid may be somebody's now
        self.given = False

    def give(self, on: bool) -> None:
        if on and not self.given:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staged = self.path.with_name(f".{TURN}.{os.getpid()}")
            staged.write_text(f"{os.getpid()}\n")
            os.replace(staged, self.path)  # whole or absent, never a half-written pid
        elif not on and self.given:
            self.path.unlink(missing_ok=True)
        self.given = on

    def taken(self) -> bool:
        return any(_alive(pid) for pid, _ in _named(self.path.parent, WAITING))


def turn_holder(path: Path) -> tuple[int, int] | None:
    """The turn file at `path`'s identity (inode, mtime) while a live supervisor holds it; else None."""
    try:
        st = os.stat(path)
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    return (st.st_ino, st.st_mtime_ns) if pid > 0 and _alive(pid) else None


class Serving:
    """Whether serving is stepping now as far as `directory` says: a request in flight and no trainer's turn (the
    trainer stopped), looked at once every `every_s` at most (a caller may ask in a spin loop). What a reader of
    vLLM's queues asks before it spins (`dvi.cli.vllm.loop.park_idle_readers`). It raises nothing: a file it cannot
    read says nothing. A turn file that `TurnWait` waited out (`max_s`, a supervisor that forgot it) still counts here
    while its supervisor lives: serving steps, and its readers park as if the trainer had its turn."""

    def __init__(self, directory: str | os.PathLike, every_s: float = 0.005):
        self.directory, self.every_s = Path(directory), every_s
        self._turn = self.directory / TURN
        self._at: float | None = None
        self._now = False

    def __call__(self, now: float) -> bool:
        if self._at is None or now - self._at >= self.every_s:
            self._at = now
            self._now = busy(self.directory) and turn_holder(self._turn) is None
        return self._now


class TurnWait:
    """Serving's side: `wait()`, before each step, waits while a live supervisor's turn file is in `directory`, at most
    `max_s` for any one file (a supervisor that forgot to take its turn back costs one wait, not one a step), polling
    every `poll_s`; returns the seconds it waited (0.0: no turn). A file it cannot read or write is no reason to stop
    serving: it raises nothing."""

    def __init__(self, directory: str | os.PathLike, max_s: float = 30.0, poll_s: float = 0.002,
                 say: logging.Logger = log):
        self.directory = Path(directory)
        self.say = say  # where the first wait and an expired turn are told (serving: its decisions' logger)
        self.path = self.directory / TURN
        self.max_s, self.poll_s = max_s, poll_s
        self.turns = 0  # turns waited for ...
        self.waited_s = 0.0  # ... and the seconds in all
        self._expired: tuple[int, int] | None = None  # (inode, mtime) of a turn file waited on for max_s

    @classmethod
    def from_env(cls, say: logging.Logger = log) -> TurnWait | None:
        directory = os.environ.get(ENV)
        return cls(directory, say=say) if directory else None

    def _turn(self) -> tuple[int, int] | None:
        """The turn file's identity while a live supervisor holds it and it has not expired; else None."""
        key = turn_holder(self.path)
        return None if key == self._expired else key

    def wait(self) -> float:
        key = self._turn()
        if key is None:
            return 0.0
        start = time.monotonic()
        waiting = self.directory / f"{os.getpid()}{WAITING}"
        try:
            waiting.touch()
        except OSError:  # not said: the supervisor lets its part go after its grace
            pass
        try:
            while True:
                time.sleep(self.poll_s)
                if self._turn() != key:
                    break
                if time.monotonic() - start >= self.max_s:
                    self._expired = key
                    self.say.warning("waited %.0f s for the trainer's turn in %s to end; going on without waiting for it",
                                     self.max_s, self.path)
                    break
        finally:
            try:
                waiting.unlink(missing_ok=True)
            except OSError:
                pass
        waited = time.monotonic() - start
        self.turns += 1
        self.waited_s += waited
        if self.turns == 1:
            self.say.info("serving waited %.2f s between two steps for the trainer's turn on the CPU (%s; "
                          "trainer.pause_share); the turns after it are not logged", waited, self.path)
        return waited
