"""Child processes that dvi starts and stops: the embedded broker, the local MLflow, the parts of `dvi up`.

Owns the life of one child: spawned in a session (and process group) of its own with its output in a log file,
stopped at exit if its owner forgets, waited on until a probe says it is ready (failing fast when it exits
first), stopped with a signal to its whole group and SIGKILL after a grace period; under a supervisor, recorded in
its registry of processes ($DVI_CHILDREN_DIR) until stopped, so that what a dead process left running can be found
and stopped (`stop_leftovers`). Also the foreground loop of
a command that keeps one server up until Ctrl-C or SIGTERM, the two probes the servers share (a TCP port,
an HTTP 200), and a process's resident memory (with its children's). It knows nothing about what the children
are, how they are configured, or what they serve.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable, Iterator

from dvi.errors import DviError

log = logging.getLogger("dvi.procs")

HOST = "127.0.0.1"

Probe = Callable[[], "str | None"]  # None: ready; otherwise what is still missing ("connection refused", "HTTP 503")

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local probe never goes via a proxy


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_PORT = 20000  # free_port's ports lie between this and the ephemeral range: above the configured defaults (19092)
_given: set[int] = set()  # the ports free_port handed out in this process, never handed out twice
_draw = random.SystemRandom()  # no state a seed or a fork could make two processes share


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int] | None:
    """The kernel's ephemeral port range (low, high), from which bind(0) and outgoing connections take their local
    ports; None where it cannot be read."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def free_port(ephemeral: tuple[int, int] | None = None) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a process that binds it later. It is drawn below
    the ephemeral range (`ephemeral`, else the kernel's), so that nothing on the host is given it in the meantime: an
    ephemeral port found free and released can go to the next bind(0) or outgoing connection (a vLLM engine core
    once found the port meant for dvi's loop view taken when it came to bind it, a minute after `dvi serve` chose
    it). Where that range leaves no room below it, an ephemeral port as before."""
    low = (ephemeral or ephemeral_range() or (FIRST_PORT, FIRST_PORT))[0]
    candidates = [p for p in _draw.sample(range(FIRST_PORT, low), min(64, max(0, low - FIRST_PORT))) if p not in _given]
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:  # in use
                continue
        _given.add(port)
        return port
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def default_replica_id(port: int | None = None) -> str:
    """This process's name where `stream.replica_id` is not set: <host>-<port> for a server (the same across restarts,
    and so is its MLflow run, `serve-<host>-<port>`), <host>-<pid> for a one-off process."""
    return f"{socket.gethostname()}-{os.getpid() if port is None else port}"


class Child:
    """One spawned child process; see `spawn`. A Child is one launch: to start again, spawn a new one."""

    def __init__(self, name: str, proc: subprocess.Popen, log_file: IO[bytes], temporary_log: bool):
        self.name = name
        self.log_path = Path(log_file.name)
        self.started = time.monotonic()
        self._proc: subprocess.Popen | None = proc
        self._pid = proc.pid
        self._log = log_file
        self._temporary_log = temporary_log
        self._returncode: int | None = None
        self._log_start = os.fstat(log_file.fileno()).st_size  # where this launch's output begins in an appended log
        atexit.register(self.stop)  # an owner that forgets to stop its child does not leave it running

    @property
    def pid(self) -> int:
        """This launch's pid, also once it has stopped: what it left running is found by it (`stop_leftovers`)."""
        return self._pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (negative: killed by that signal), else None."""
        return self._proc.poll() if self._proc is not None else self._returncode

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    def log_tail(self, chars: int = 800) -> str:
        """The end of the child's log ("" once a temporary log is gone)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
                return f.read().decode(errors="replace").strip() or "(empty log)"
        except OSError:
            return "" if self._proc is None else "(no log)"

    def log_since_start(self, limit: int = 1 << 20) -> str:
        """What this launch wrote to its log so far (at most `limit` bytes from its start)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read(limit).decode(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> int | None:
        """Send `sig` to the child's process group, SIGKILL the group after `grace_s`; returns the exit status.

        The group is killed even after the child exited, so that workers it started do not outlive it.
        Idempotent; until it has finished, the child stays registered to be stopped at exit.
        """
        proc = self._proc
        if proc is None:
            return self._returncode
        if proc.poll() is None:
            signal_group(proc.pid, sig)
        if sig != signal.SIGKILL and proc.poll() is None:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored %s for %.0f s: killing it", self.name, proc.pid, signal.Signals(sig).name, grace_s)
        signal_group(proc.pid, signal.SIGKILL)
        self._returncode = proc.wait()
        _unregister(proc.pid)
        self._proc = None
        atexit.unregister(self.stop)
        self._log.close()
        if self._temporary_log:
            self.log_path.unlink(missing_ok=True)
        return self._returncode

    def kill(self) -> int | None:
        """SIGKILL at once, no shutdown: what a crash looks like to the child's clients."""
        return self.stop(signal.SIGKILL, grace_s=0)


# ----------------------------------------------------------------------------------------------
# The registry of a supervisor's processes: what is left when the supervisor (or a part) dies without stopping them

REGISTRY_ENV = "DVI_CHILDREN_DIR"  # set by a supervisor (`dvi up`): every process dvi spawns below it is recorded there


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (the state first); None when there is no such process
    (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), which tells a process from a later one that got its
    pid; None when there is no such process."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _register(name: str, pid: int) -> None:
    """Record a child just spawned in $DVI_CHILDREN_DIR (when set): its pid (its process group's id), start time,
    name and the pid of the process that spawned it. Removed when it is stopped (`_unregister`)."""
    folder = os.environ.get(REGISTRY_ENV)
    if not folder:
        return
    entry = {"pid": pid, "start": start_time(pid), "name": name, "parent": os.getpid()}
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{pid}.json").write_text(json.dumps(entry))
    except OSError as e:
        log.warning("cannot record %s (pid %d) in %s: %s", name, pid, folder, e)


def _unregister(pid: int) -> None:
    folder = os.environ.get(REGISTRY_ENV)
    if folder:
        with contextlib.suppress(OSError):
            (Path(folder) / f"{pid}.json").unlink()


def stop_leftovers(folder: Path, below: int | None = None, grace_s: float = 5.0) -> list[str]:
    """Stop the recorded processes of `folder` that still run (each with its process group: SIGTERM, SIGKILL after
    `grace_s`, then up to `grace_s` more until the group is gone) and forget every record: all of them, or with `below` only those that pid spawned, and theirs in turn.
    A record whose pid now belongs to another process (another start time) is forgotten, never signalled. Returns
    "name (pid N)" for each process stopped."""
    records = {}
    for path in Path(folder).glob("*.json"):
        try:
            entry = json.loads(path.read_text())
            records[int(entry["pid"])] = (path, entry)
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                path.unlink()
    chosen = set(records)
    if below is not None:
        chosen, frontier = set(), {below}
        while frontier:
            frontier = {pid for pid, (_, e) in records.items() if e.get("parent") in frontier} - chosen
            chosen |= frontier
    def left(pid: int) -> bool:  # its group still runs: led by it, or by no one (its leader died, its workers did not)
        now = start_time(pid)
        return (now == records[pid][1].get("start") and not _zombie(pid)) if now is not None else _group_alive(pid)

    stopped, alive = [], []
    for pid in chosen:
        path, entry = records[pid]
        if entry.get("start") is not None and left(pid):
            signal_group(pid, signal.SIGTERM)
            alive.append(pid)
            stopped.append(f"{entry.get('name', '?')} (pid {pid})")
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if left(pid)]
    for pid in alive:
        signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s  # until they are gone: what follows takes their ports (a server draining
    while alive and time.monotonic() < deadline:  # its requests on SIGTERM outlives `grace_s`, then dies by SIGKILL)
        time.sleep(0.05)
        alive = [pid for pid in alive if left(pid)]
    for pid in chosen:
        with contextlib.suppress(OSError):
            records[pid][0].unlink()
    return stopped


def _group_alive(pgid: int) -> bool:
    """Whether a process group `pgid` has members. While it has, no new process gets `pgid` as its pid, so members
    of a group whose leader is gone are that leader's workers."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _zombie(pid: int) -> bool:
    """Whether `pid` is gone or a zombie (exited, not yet reaped)."""
    fields = _stat(pid)
    return fields is None or fields[0] == "Z"


def spawn(name: str, cmd: list[str], *, log_path: Path | None = None, env: dict | None = None, cwd: Path | None = None) -> Child:
    """Start `cmd` in a session of its own, stdout and stderr appended to `log_path` (None: a temporary log,
    deleted when the child is stopped). Its own session: a Ctrl-C in the terminal reaches dvi only, which then
    stops the child itself, and a signal to its group reaches the workers it starts too. Under a supervisor
    ($DVI_CHILDREN_DIR) the child is recorded until it is stopped (`stop_leftovers`)."""
    if log_path is None:
        log_file = tempfile.NamedTemporaryFile(prefix=f"dvi-{name}-", suffix=".log", delete=False)
    else:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    except OSError as e:
        log_file.close()
        raise DviError(f"cannot start {name} ({' '.join(cmd)}): {e}") from e
    _register(name, proc.pid)
    return Child(name, proc, log_file, temporary_log=log_path is None)


def signal_group(pid: int, sig: int) -> bool:
    """`sig` to the process group of a child `spawn` started (its own session); False where the group is gone."""
    try:
        os.killpg(pid, sig)  # start_new_session: the group id is the child's pid
    except ProcessLookupError:
        return False
    return True


def wait_ready(child: Child, probe: Probe, timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    """Poll `probe` until it says ready; DviError (with the log's end) when the child exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not look_ready(child, probe, deadline, timeout_s, what):
        time.sleep(interval_s)


def look_ready(child: Child, probe: Probe, deadline: float, timeout_s: float, what: str) -> bool:
    """One look at a starting child: True once `probe` says it is ready; DviError (with the log's end) when it exited,
    or when the `deadline` (`timeout_s` after its start) passed."""
    if not child.running:
        raise DviError(f"{what} exited at start (status {child.returncode}): {child.log_tail()}")
    missing = probe()
    if missing is None:
        return True
    if time.monotonic() >= deadline:
        raise DviError(f"{what} did not answer within {timeout_s:.0f} s ({missing}); log: {child.log_tail()}")
    return False


# ----------------------------------------------------------------------------------------------
# Probes


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its children, MiB (from /proc)."""
    total, pids = 0.0, [pid]
    children = f"/proc/{pid}/task/{pid}/children"
    if os.path.exists(children):
        pids += [int(c) for c in open(children).read().split()]
    for p in pids:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def local_get(url: str, timeout_s: float = 2.0) -> bytes:
    """GET `url` from a local server, never via a proxy; urllib's errors (an HTTPError on a non-2xx answer)."""
    with _NO_PROXY.open(url, timeout=timeout_s) as resp:
        return resp.read()


def local_post(url: str, data: bytes, timeout_s: float = 2.0, content_type: str = "application/json", method: str = "POST",
               headers: dict[str, str] | None = None) -> bytes:
    """POST (or `method`) `data` to a local server, never via a proxy; urllib's errors (an HTTPError on a non-2xx answer)."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type, **(headers or {})}, method=method)
    with _NO_PROXY.open(req, timeout=timeout_s) as resp:
        return resp.read()


def http_ok(url: str, timeout_s: float = 2.0, headers: dict[str, str] | None = None) -> str | None:
    """A probe: None when GET `url` (with `headers`) answers 200, else what it answered."""
    try:
        with _NO_PROXY.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


# ----------------------------------------------------------------------------------------------
# Foreground commands


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within: SIGTERM raises KeyboardInterrupt in the main thread like Ctrl-C does, so both take one path out."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class ServerProcess:
    """Base of a server that dvi runs as one child process (EmbeddedBroker, LocalMlflow, LocalS3): started on enter,
    stopped on exit. A subclass writes `start()` with `_launch`; `stop_signal` is what asks it to stop."""

    stop_signal: int = signal.SIGTERM
    _child: Child | None = None

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.running

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def start(self) -> ServerProcess:
        raise NotImplementedError

    def _launch(self, name: str, cmd: list[str], probe: Probe, timeout_s: float, what: str, *, env: dict | None = None,
                cwd: Path | None = None, interval_s: float = 0.1) -> None:
        """Spawn the child and wait until `probe` says it is ready; stopped again (and DviError) when it is not."""
        self._child = spawn(name, cmd, env=env, cwd=cwd)
        try:
            wait_ready(self._child, probe, timeout_s, what, interval_s=interval_s)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 800) -> str:
        return self._child.log_tail(chars) if self._child is not None else ""

    def stop(self, grace_s: float = 10.0) -> None:
        """`stop_signal` to the child's process group, SIGKILL after `grace_s`. Idempotent."""
        child, self._child = self._child, None
        if child is not None:
            child.stop(self.stop_signal, grace_s)

    def kill(self) -> None:
        """SIGKILL, no shutdown: what a crash looks like to the clients (for tests)."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_foreground(command: str, what: str, server: ServerProcess, on_ready: Callable[[ServerProcess], str],
                   say: Callable[..., None] = print) -> int:
    """`dvi <command>`: start `server`, `say` the line `on_ready` returns, keep it up until Ctrl-C or SIGTERM.

    Exit status 0 when stopped that way; DviError (naming `what`, with its log's end) when it exits on its own.
    """
    with sigterm_interrupts():
        try:
            with server:
                say(f"dvi {command}: {on_ready(server)}; Ctrl-C stops it", flush=True)
                while server.running:
                    time.sleep(0.5)
                raise DviError(f"{what} exited unexpectedly: {server.log_tail()}")
        except KeyboardInterrupt:
            pass
    say(f"dvi {command}: stopped", flush=True)
    return 0
