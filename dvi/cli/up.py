"""`dvi up`: the whole local loop as supervised child processes.

Owns the plan (which parts run, in what order, how each says it is ready) and their supervision. The parts are
`dvi broker` (unless `stream.bootstrap_servers` names a Kafka), `dvi mlflow` (unless `tracking.uri` names a
server or tracking is off), `dvi serve` and `dvi train`, each run with this interpreter and the same overrides,
so each loads exactly the config `dvi up` loaded. They start in that order, each waited on until ready, but for serve
and train, which start together once the broker and MLflow are (`Part.needs`: on a small machine each spends its
first seconds importing on one core) and the model pair is prepared (`PairPrep`, a child process that runs while the
broker and MLflow start); a part
that exits is reported and restarted after a backoff (1 s, doubling to 30 s, back to 1 s once a run lasted a
minute); Ctrl-C or SIGTERM stops them in reverse order. Child logs go to <cache>/logs/<part>.log; the children's
decision lines (loggers `dvi.decision.*`: gates, publishes, swaps, promotions, rollbacks, triggers) are relayed to
this terminal as they appear, and a part that takes long to start is said to be awaited every few seconds.
`dvi up --detach` runs the same in the background (its output in <cache>/logs/up.log) and returns once the stack
is ready; the running `dvi up` keeps its pid in <cache>/up.pid, which `dvi down` signals (SIGTERM, the same ordered
shutdown as Ctrl-C) and which makes a second `dvi up` on that cache refuse, as does a port of the plan in use.
Every process the stack spawns (the parts, and the broker, S3 store and MLflow server they start) is recorded in
<cache>/up.children until it is stopped (`dvi.procs.stop_leftovers`): a part that dies has what it left running
stopped before it restarts, and a `dvi up` killed outright (SIGKILL, out of memory) has everything it left stopped
by the next `dvi up` on that cache, which then starts cleanly.
With `trainer.cpu_priority=pause` (auto's choice where the trainer trains on the CPU cores serving runs on:
`dvi.hardware.pick_cpu_priority`) the trainer is stopped (SIGSTOP) while the server has a request in flight
(`HoldWhileBusy`, reading `dvi.busy` files), but for `trainer.pause_share` of the time (`DutyCycle`), which it runs
alone: serving waits between two steps for the trainer's turn to end (`dvi.busy.Turn`), or for the trainer to say it has
nothing to do (`dvi.busy.IdleFile`); the turns come as often as the trainer claims (`dvi.busy.ClaimFile`: less while
the gate refuses its candidates, `trainers.triggers.Claim`).
The drift benchmark (benchmarks/drift.py) runs its replicas with the same `Supervisor`.

It knows how to start, watch and stop the parts, not what they do.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dvi.busy import ENV as BUSY_ENV
from dvi.busy import Turn, busy, claimed, idle
from dvi.cli.args import trainer_priority
from dvi.cli.output import ERROR_PREFIX, out
from dvi.config import TrainerConfig, cache_dir, load_config, overrides_of
from dvi.errors import DviError
from dvi.hardware import Pick, pick_engine
from dvi.mlflow_login import local_login
from dvi.procs import (REGISTRY_ENV, Child, http_ok, look_ready, port_in_use, signal_group, sigterm_interrupts, spawn, start_time,
                       stop_leftovers)
from dvi.tracking import find_experiment_link

PARTS = ("broker", "mlflow", "serve", "train")
INFRA = ("broker", "mlflow")  # what the loop's parts need ready before they start
PAIR_PARTS = ("serve", "train")  # the parts that load the model pair: they start once it is prepared (`PairPrep`)

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a run that lasted this long was healthy: the next crash starts the backoff over
READY_LINE = "Ctrl-C stops everything"  # in the banner once every part is ready (`--detach` waits for it)
# a trainer stopped while serving answers: its consumer group's session timeout. Longer than a request, so that a
# stop does not drop it from its group; not much longer, for a group join takes about half of it, of time the trainer
# runs (300 s: under paced load it had not joined after 5 minutes, and trained nothing)
PAUSED_SESSION_MS = 20_000
# trainer.pause_share's window: under continuous load a paused trainer runs its share of every this many seconds
# (long enough that a step's work is not cut into slivers, short against the minutes a training session takes)
DUTY_WINDOW_S = 10.0
WAIT_SAY_S = 5.0  # while a part starts, say what is awaited this often
DECISION_MARK = " dvi.decision."  # the loggers whose lines `dvi up` relays (see dvi.cli.setup_logging)


def next_backoff(previous_s: float | None, uptime_s: float) -> float:
    """The wait before restarting a part that exited after `uptime_s`, given the wait before its last start."""
    if previous_s is None or uptime_s >= STABLE_S:
        return FIRST_BACKOFF_S
    return min(MAX_BACKOFF_S, previous_s * 2)


@dataclass(frozen=True)
class Part:
    name: str
    args: list[str]  # the dvi subcommand and its options (the overrides are added to every part)
    ready: Callable[[Child], str | None]  # a probe given the running child: None once it serves
    ready_timeout_s: float
    # the parts that must be ready before it starts (those its supervisor runs; None: every part before it)
    needs: tuple[str, ...] | None = None
    env: dict[str, str] | None = None  # set in its environment, over the supervisor's own


def banner(prefix: str, anywhere: bool = False) -> Callable[[Child], str | None]:
    """A probe: ready once the child's log (since it started) has a line starting with `prefix` (`anywhere`: holding it)."""

    def probe(child: Child) -> str | None:
        lines = child.log_since_start().splitlines()
        found = any(prefix in line for line in lines) if anywhere else any(line.startswith(prefix) for line in lines)
        return None if found else f"no '{prefix}' yet"

    return probe


def stack_priority(cfg, only: set[str] | None = None, train: bool = True) -> Pick | None:
    """The CPU priority the online trainer of this dvi up runs at (`dvi.cli.args.trainer_priority`), and why: None
    where it runs no trainer; pause only where it also runs the server whose requests pause it."""
    runs = {name for name in PARTS if only is None or name in only}
    if not train or "train" not in runs:
        return None
    priority = trainer_priority(cfg)
    if priority.value == "pause" and "serve" not in runs:
        return Pick("normal", f"{priority.why}, but this dvi up runs no server to pause it for")
    return priority


def plan(cfg, only: set[str] | None = None, train: bool = True, priority: Pick | None = None) -> list[Part]:
    """The parts to run for a loaded `DviConfig`, in start order; `priority`: the trainer's (`stack_priority`, which
    it settles to when not given)."""
    unknown = sorted((only or set()) - set(PARTS))
    if unknown:
        raise DviError(f"--only {','.join(unknown)}: unknown part(s); the parts are {', '.join(PARTS)}")
    priority = priority or stack_priority(cfg, only, train)
    serve_url = f"http://{cfg.serve.host}:{cfg.serve.port}"
    parts = []
    if cfg.stream.bootstrap_servers is None:
        parts.append(Part("broker", ["broker"], banner("dvi broker:"), 60))  # its banner comes once the topics exist
    if cfg.tracking.enabled and cfg.tracking.uri is None:
        # longer than `dvi mlflow`'s own limit on its server (180 s), so that its error, not this wait, ends a start
        parts.append(Part("mlflow", ["mlflow"], lambda _: http_ok(f"{cfg.tracking.tracking_uri}/health"), 240))
    # 900 s: the first start on a machine compiles the models (vLLM, serve.vllm.enforce_eager=false: minutes on 2 cores);
    # serve and train start together once the broker and MLflow are ready (each starts on one core at first: imports)
    parts.append(Part("serve", ["serve"], lambda _: http_ok(f"{serve_url}/health"), 900, needs=INFRA))
    if train and (only is None or "train" in only):
        # stopped while serving answers (trainer.cpu_priority=pause): a request's time at a time, minutes while requests
        # come back to back; its consumer group keeps it over a request's stop (PAUSED_SESSION_MS)
        paused = [f"stream.session_timeout_ms={max(PAUSED_SESSION_MS, cfg.stream.session_timeout_ms)}"] \
            if priority is not None and priority.value == "pause" else []
        parts.append(Part("train", ["train", *paused], banner("dvi train:"), 300, needs=INFRA))
    return [p for p in parts if only is None or p.name in only]


class Supervisor:
    """Starts the parts in order (a part with `needs` as soon as those are ready), restarts those that exit, stops them
    all in reverse order."""

    def __init__(self, parts: list[Part], overrides: list[str], log_dir: Path, say: Callable[[str], None] = print,
                 relay: bool = True):
        self.parts = parts
        self.relay = relay  # say the children's decision lines (DECISION_MARK) as they appear in their logs
        self._read_at: dict[str, int] = {}  # part -> how far its log was read for decision lines
        self.overrides = overrides
        self.log_dir = log_dir
        self.say = say
        self.children: dict[str, Child] = {}
        self.restarts = {p.name: 0 for p in parts}
        self._backoff: dict[str, float | None] = {p.name: None for p in parts}
        self._due: dict[str, float] = {}  # part -> when to start it again
        self._starting: dict[str, float] = {}  # restarted part -> deadline to become ready

    def _spawn(self, part: Part) -> Child:
        cmd = [sys.executable, "-m", "dvi.cli", *part.args, *self.overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(part.env or {})}
        log_path = self.log_dir / f"{part.name}.log"
        self._read_at[part.name] = log_path.stat().st_size if log_path.exists() else 0  # this launch's lines only
        return spawn(part.name, cmd, log_path=log_path, env=env)

    def relay_decisions(self) -> None:
        """Say each child's new decision lines (gates, publishes, swaps, promotions, rollbacks, triggers), prefixed
        with the part's name."""
        if not self.relay:
            return
        for name, child in list(self.children.items()):
            try:
                with open(child.log_path, "rb") as f:
                    f.seek(self._read_at.get(name, 0))
                    chunk = f.read(1 << 20)
            except OSError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next look
            self._read_at[name] = self._read_at.get(name, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if DECISION_MARK in line:
                    self.say(f"[{name}] {line}")

    def _waiting(self, part: Part, child: Child) -> Callable[[], str | None]:
        """The part's probe, saying every WAIT_SAY_S what is still awaited (and relaying decision lines meanwhile)."""
        started, said = time.monotonic(), [time.monotonic()]

        def probe() -> str | None:
            missing = part.ready(child)
            self.relay_decisions()
            now = time.monotonic()
            if missing is not None and now - said[0] >= WAIT_SAY_S:
                said[0] = now
                last = child.log_since_start(1 << 16).strip().splitlines()
                self.say(f"dvi up: waiting for {part.name} ({now - started:.0f} s of at most {part.ready_timeout_s:.0f}): {missing}"
                         + (f"; its log: {last[-1][:160]}" if last else ""))
            return missing

        return probe

    def start(self, held: Callable[[Part], bool] = lambda _part: False) -> None:
        """Start every part, each once the parts it needs are ready (`Part.needs`) and `held` no longer holds it back
        (`held` may raise DviError: the start fails), and wait until all are; on a failure, stop what started and raise
        DviError."""
        names = [p.name for p in self.parts]
        needs = {p.name: names[:i] if p.needs is None else [n for n in p.needs if n in names] for i, p in enumerate(self.parts)}
        ready: set[str] = set()
        starting: dict[str, tuple[Callable[[], str | None], float]] = {}  # part -> its probe, its deadline
        try:
            while len(ready) < len(self.parts):
                for part in self.parts:
                    # `held` first: a hold that fails (the pair could not be prepared) fails the start at once
                    if (part.name not in ready and part.name not in starting and not held(part)
                            and all(n in ready for n in needs[part.name])):
                        child = self.children[part.name] = self._spawn(part)
                        starting[part.name] = (self._waiting(part, child), time.monotonic() + part.ready_timeout_s)
                for part in [p for p in self.parts if p.name in starting]:
                    child, (probe, deadline) = self.children[part.name], starting[part.name]
                    if look_ready(child, probe, deadline, part.ready_timeout_s, f"dvi {part.name}"):
                        del starting[part.name]
                        ready.add(part.name)
                        self.say(f"dvi up: {part.name} ready (pid {child.pid}, log {child.log_path})")
                if len(ready) < len(self.parts):
                    time.sleep(0.25)
        except BaseException:
            self.stop()
            raise

    def tick(self) -> None:
        """One look at every part: report and schedule the restart of one that exited, start one that is due."""
        self.relay_decisions()
        now = time.monotonic()
        for part in self.parts:
            name = part.name
            child = self.children.get(name)
            if child is not None and not child.running:
                pid, uptime, status = child.pid, child.uptime_s, child.stop()
                left = self._stop_leftovers(below=pid)
                delay = self._backoff[name] = next_backoff(self._backoff[name], uptime)
                del self.children[name]
                self._starting.pop(name, None)
                self._due[name] = now + delay
                self.say(f"dvi up: {name} exited (status {status}) after {uptime:.0f} s; restarting in {delay:.0f} s; "
                         f"log {child.log_path}" + (f"; stopped what it left running: {', '.join(left)}" if left else ""))
            elif child is None and name in self._due and now >= self._due[name]:
                del self._due[name]
                self.children[name] = self._spawn(part)
                self.restarts[name] += 1
                self._starting[name] = now + part.ready_timeout_s
            elif child is not None and name in self._starting:
                if part.ready(child) is None:
                    del self._starting[name]
                    self.say(f"dvi up: {name} ready again (pid {child.pid}, restart {self.restarts[name]})")
                elif now > self._starting[name]:
                    del self._starting[name]
                    self.say(f"dvi up: {name} not ready {part.ready_timeout_s:.0f} s after its restart; stopping it")
                    child.stop()

    def restarting(self, name: str) -> bool:
        """Whether part `name` was restarted and is not ready yet."""
        return name in self._starting

    def stop(self) -> None:
        for part in reversed(self.parts):
            child = self.children.pop(part.name, None)
            if child is not None:
                status = child.stop(grace_s=30)
                self.say(f"dvi up: {part.name} stopped (status {status})")
        self._due.clear()
        if left := self._stop_leftovers():
            self.say(f"dvi up: stopped what the parts left running: {', '.join(left)}")

    def _stop_leftovers(self, below: int | None = None) -> list[str]:
        """Processes the parts spawned that outlived them (all, or those below the part `below`), stopped; under a
        registry of processes ($DVI_CHILDREN_DIR, `dvi.procs`) only."""
        folder = os.environ.get(REGISTRY_ENV)
        return stop_leftovers(Path(folder), below=below) if folder else []


def pid_file(cache: Path) -> Path:
    """Where a running `dvi up` writes its pid (`dvi down` reads it)."""
    return cache / "up.pid"


def children_dir(cache: Path) -> Path:
    """Where the processes of a running `dvi up` (its parts, and what they spawn) are recorded until stopped."""
    return cache / "up.children"


def running_pid(cache: Path) -> int | None:
    """The pid of the `dvi up` running on this cache, or None (a stale pid file is ignored, and so is one whose pid now
    belongs to another process: the file holds the start time too)."""
    try:
        pid, *start = pid_file(cache).read_text().split()
        pid = int(pid)
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid if not start or start[0] == start_time(pid) else None


def ports(cfg, parts: list[Part]) -> dict[str, int]:
    """The local TCP port each part of the plan listens on."""
    by_part = {"broker": cfg.stream.port, "mlflow": cfg.tracking.port, "serve": cfg.serve.port}
    return {p.name: by_part[p.name] for p in parts if p.name in by_part}


def check_not_running(cfg, parts: list[Part], cache: Path) -> None:
    """DviError when a stack already runs on this cache or something listens on one of the plan's ports."""
    pid = running_pid(cache)
    if pid is not None:
        raise DviError(f"dvi up is already running (pid {pid}, {pid_file(cache)}; logs {cache / 'logs'}): "
                       "`dvi down` stops it, `dvi status` shows it")
    busy = [f"{name} on 127.0.0.1:{port}" for name, port in ports(cfg, parts).items() if port_in_use(port)]
    if busy:
        raise DviError(f"already in use: {', '.join(busy)}: a dvi stack (or something else) is already running there; "
                       "`dvi down` stops a detached one, or choose other ports (stream.port, tracking.port, serve.port)")


def detach(args: argparse.Namespace, cache: Path, timeout_s: float = 900) -> int:
    """Start `dvi up` (the same arguments, without --detach) in the background, its output in <cache>/logs/up.log;
    return once it says the stack is ready (its banner printed), or fail with the end of its log."""
    argv = [*(["-v"] if args.verbose else []), "up", *(["--only", args.only] if args.only else []),
            *(["--no-train"] if args.no_train else []), *overrides_of(args)]
    log_path = cache / "logs" / "up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "dvi.cli", *argv], stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline, shown = time.monotonic() + timeout_s, 0
    while True:
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        lines = text.splitlines()
        for line in lines[shown:]:
            if line.startswith("dvi up:") or line.startswith("  "):
                out(line, flush=True)
        shown = len(lines)
        if READY_LINE in text:
            out(f"dvi up: detached (pid {proc.pid}); logs {cache / 'logs'}; `dvi down` stops it", flush=True)
            return 0
        if proc.poll() is not None:
            raise DviError(f"dvi up exited at start (status {proc.returncode}); its log {log_path}: {lines[-3:]}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise DviError(f"dvi up was not ready within {timeout_s:.0f} s; stopped it; log {log_path}")
        time.sleep(0.5)


def down(args: argparse.Namespace) -> int:
    """Stop the `dvi up` running on this cache the way Ctrl-C does (SIGTERM: parts stopped in reverse order)."""
    cfg = load_config(overrides_of(args))
    cache = cache_dir(cfg.model)
    pid = running_pid(cache)
    if pid is None:
        out(f"dvi down: no dvi up is running on {cache} (no live pid in {pid_file(cache)})")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while running_pid(cache) == pid and time.monotonic() < deadline:
        time.sleep(0.25)
    if running_pid(cache) == pid:
        raise DviError(f"dvi up (pid {pid}) did not stop within {args.timeout:.0f} s; its log: {cache / 'logs' / 'up.log'}")
    out(f"dvi down: stopped dvi up (pid {pid}); logs {cache / 'logs'}")
    return 0


class PairPrep:
    """The configured pair's directories, fetched and built once before two parts race to do it, and its device and
    dtype checked (one clear line, not a restart loop of parts): `dvi models fetch --pair` in a child process, whose
    waits and warnings pass through as they come, read on a thread so that the broker and MLflow start meanwhile. This
    process never loads torch (a supervisor stays small, and torch's import visits every core the process may use,
    `dvi.hardware`). DviError with the child's reason."""

    def __init__(self, overrides: list[str], verbose: bool = False, say: Callable[[str], None] | None = None):
        self.say = say  # told the directories once they are prepared (`done`)
        cmd = [sys.executable, "-m", "dvi.cli", *(["-v"] if verbose else []), "models", "fetch", "--pair", *overrides]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     errors="replace")
        self._reason: str | None = None
        self._lines: list[str] = []
        self._reading = threading.Thread(target=self._read, name="pair-prep", daemon=True)
        self._reading.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # until the child ends; its stdout is the two directories, nothing more
            if line.startswith(ERROR_PREFIX):
                self._reason = line.removeprefix(ERROR_PREFIX).strip()
            else:
                sys.stderr.write(line)
        self._lines = self.proc.stdout.read().splitlines()
        self.proc.wait()

    def done(self) -> bool:
        """Whether the pair is prepared (False: not yet); DviError where it could not be."""
        if self._reading.is_alive():
            return False
        code, lines = self.proc.returncode, self._lines
        if code != 0 or len(lines) < 2:
            said = self._reason or (f"exit status {code}" if code else f"it printed {lines!r}, not the two directories")
            raise DviError(f"the model pair could not be prepared (dvi models fetch --pair): {said}")
        if self.say is not None:
            self.say(f"dvi up: target {lines[-2]}, drafter {lines[-1]}")
            self.say = None
        return True

    def wait(self) -> tuple[str, str]:
        """The (target, drafter) directories, once prepared; DviError where they could not be."""
        self._reading.join()
        self.done()
        return self._lines[-2], self._lines[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Hold:
    """Stops a supervised part (SIGSTOP to its process group) and lets it go on (SIGCONT). `held_s`: how long it was
    stopped in all. A launch that replaced the stopped one (a restart) runs, and is not stopped until it is ready."""

    def __init__(self, supervisor: Supervisor, name: str):
        self.supervisor, self.name = supervisor, name
        self.held_pid: int | None = None  # the launch stopped now
        self.since = 0.0
        self.held_s = 0.0
        self._lock = threading.Lock()

    def set(self, stopped: bool) -> None:
        with self._lock:
            child = self.supervisor.children.get(self.name)
            if (stopped and child is not None and child.running and self.held_pid != child.pid
                    and not self.supervisor.restarting(self.name)):
                self._release()
                if signal_group(child.pid, signal.SIGSTOP):  # spawn: its own session and process group
                    self.held_pid, self.since = child.pid, time.monotonic()
            elif not stopped:
                self._release()

    def _release(self) -> None:
        if self.held_pid is not None:
            signal_group(self.held_pid, signal.SIGCONT)
            self.held_s += time.monotonic() - self.since
            self.held_pid = None


class DutyCycle:
    """Whether to hold a part while serving is busy, so that it still runs `share` of the time under continuous load
    (`trainer.pause_share`). Each second it is held earns it share / (1 - share) seconds of running; each second it
    runs (between requests, or on what it earned) spends one. Held while busy until it has earned `share x window_s`;
    then it runs, busy or not, until that is spent. Under continuous load that is (1 - share) x window_s held, then
    share x window_s running, however short the gaps between requests; under paced load the gaps spend what it
    earns and it is held only while busy. share 0: held whenever busy. A run the part has no use for ends early
    (`forfeit`): what it had earned is gone, and it earns the next one from nothing.

    The part may claim less than its share (`claim`, a fraction of it: `dvi.busy.ClaimFile`, a trainer whose candidates
    keep losing to the serving drafter): it then earns at share x claim, its runs as long as before and further apart
    (a run shorter than a trainer's step would stop it mid-step every time)."""

    def __init__(self, share: float = 0.0, window_s: float = DUTY_WINDOW_S):
        self.share, self.window_s = share, window_s
        self.earned = 0.0  # seconds of running it is owed
        self.spending = False  # running on what it earned, busy or not
        self.held = False
        self.last: float | None = None

    def hold(self, busy_now: bool, now: float, claim: float = 1.0) -> bool:
        dt = 0.0 if self.last is None else max(0.0, now - self.last)
        self.last = now
        if self.held:
            share = self.share * min(max(claim, 0.0), 1.0)
            self.earned += dt * share / (1 - share)
        else:
            self.earned = max(0.0, self.earned - dt)
        if self.spending and self.earned <= 0:
            self.spending = False
        if not self.spending and busy_now and self.share > 0 and self.earned >= self.share * self.window_s:
            self.spending = True
        self.held = busy_now and not self.spending
        return self.held

    def stand(self, now: float) -> None:
        """The time up to `now` counts neither as held nor as running: the part was stopped for another reason."""
        self.last = now

    def forfeit(self, busy_now: bool, now: float) -> bool:
        """The part has nothing to do: the run it is on ends now, and what it had earned is dropped; whether to hold it."""
        self.last, self.earned, self.spending, self.held = now, 0.0, False, busy_now
        return self.held


class HoldWhileBusy(threading.Thread):
    """Keeps `hold` stopped while serving has a request in flight (`dvi.busy` files in `directory`), looking every
    `every_s`, but for the share of the time `duty` lets it run, and whenever `also()` says so (the duty's clock
    standing still meanwhile: benchmarks.drift's other sides' turns); `close()` ends the watch and lets the part go on.

    The share it runs however busy serving is, it runs alone: that is the part's turn (`dvi.busy.Turn`), which serving
    takes between two steps; the part goes on once serving waits, or after TURN_GRACE_S (a step that does not end
    soon: a long prefill), and is stopped again before serving goes on. Beside serving's steps, two processes each using
    every core slow each other several-fold: in benchmarks.sharing a paused trainer's 25% share beside back-to-back
    requests trained 4.2 positions a second, and 75 in the gaps between paced ones (about half the time). Serving
    waiting is not enough: vLLM's worker spun on its queue through each turn until its readers were made to sleep
    soon (`dvi.cli.vllm.loop.park_idle_readers`; benchmarks.turn_cpu shows who runs in the turns). A turn ends early
    where the part says, `IDLE_AFTER_S` into it, that it has nothing to do (`dvi.busy.idle`: a trainer whose trigger is
    not active, or with no fresh record to train on): serving then waits that long, not the whole share, and the duty
    cycle starts earning the next turn afresh (`DutyCycle.forfeit`). The part's turns come as often as it claims
    (`dvi.busy.claimed`, read while it earns its next one: `DutyCycle`).
    """

    TURN_GRACE_S = 0.5
    IDLE_AFTER_S = 0.3  # resumed in the middle of waiting for records, a trainer reads what came while it was stopped

    def __init__(self, hold: Hold, directory: Path, every_s: float = 0.02, duty: DutyCycle | None = None,
                 also: Callable[[], bool] | None = None):
        super().__init__(name="dvi-hold-while-busy", daemon=True)
        self.hold, self.directory, self.every_s, self.also = hold, directory, every_s, also
        self.duty = duty or DutyCycle()
        self.turn = Turn(directory)
        self.turn_since = 0.0  # when the part's turn began
        self._closed = threading.Event()

    def run(self) -> None:
        while not self._closed.wait(self.every_s):
            self.look(time.monotonic())

    def look(self, now: float) -> None:
        """One look at serving: the part stopped or let go, its turn given or taken back."""
        if self.also is not None and self.also():
            self.duty.stand(now)
            self.hold.set(True)
            self.turn.give(False)
            return
        serving = busy(self.directory)
        held = self.duty.hold(serving, now, claimed(self.directory) if self.duty.held else 1.0)  # read where it earns
        if not self.duty.spending:
            self.hold.set(held)
            self.turn.give(False)  # after the stop: the part never runs beside serving's steps
            return
        if not self.turn.given:
            self.turn.give(True)
            self.turn_since = now
        elif now - self.turn_since >= self.IDLE_AFTER_S and idle(self.directory):  # a turn it has no use for
            self.hold.set(self.duty.forfeit(serving, now))
            self.turn.give(False)
            return
        self.hold.set(serving and not self.turn.taken() and now - self.turn_since < self.TURN_GRACE_S)

    def close(self) -> None:
        self._closed.set()
        if self.is_alive():
            self.join(timeout=5)
        self.turn.give(False)
        self.hold.set(False)


def train_share(trainer: TrainerConfig, priority: Pick) -> str:
    """How the trainer shares the machine with serving, for the banner: its cores and CPU priority (`priority`, what
    `trainer.cpu_priority` settled to: `dvi.cli.args.trainer_priority`), and why."""
    cores = "every core" if trainer.cpu_bind == "auto" else f"cores {trainer.cpu_bind} (trainer.cpu_bind)"
    least = "" if trainer.pause_share_min >= trainer.pause_share else \
        f"; down to {trainer.pause_share_min:.1%} while the gate refuses its candidates: trainer.pause_share_min"
    duty = "" if trainer.pause_share == 0 else \
        f" but for {trainer.pause_share:.0%} of every {DUTY_WINDOW_S:g} s (trainer.pause_share{least}), which it runs alone " \
        "while serving waits (a turn ends early where it has nothing to do)"
    how = {"normal": "running beside requests", "nice": "nice 19, running beside requests",
           "idle": "SCHED_IDLE: the CPU time serving leaves",
           "pause": f"stopped while the server has a request in flight{duty}, training between requests"}[priority.value]
    return f"{cores}, CPU priority {priority.value} ({priority.why}): {how}"


def up(args: argparse.Namespace) -> int:
    overrides = overrides_of(args)
    cfg = load_config(overrides)
    only = set(args.only.split(",")) if args.only else None
    priority = stack_priority(cfg, only, train=not args.no_train)
    parts = plan(cfg, only, train=not args.no_train, priority=priority)
    cache = cache_dir(cfg.model)
    if running_pid(cache) is None and (left := stop_leftovers(children_dir(cache))):
        # a dvi up that died without stopping its parts (SIGKILL, out of memory): what it left holds ports and files
        out(f"dvi up: stopped what an earlier dvi up left running: {', '.join(left)}", flush=True)
    check_not_running(cfg, parts, cache)
    if args.detach:
        return detach(args, cache)
    os.environ[REGISTRY_ENV] = str(children_dir(cache))  # every process the stack spawns, recorded until stopped
    names = {p.name for p in parts}
    pausing = priority is not None and priority.value == "pause"
    if pausing:  # the server says in files there whether it has a request in flight; the trainer is stopped while it has
        os.environ[BUSY_ENV] = str(cache / "busy")
    supervisor = Supervisor(parts, overrides, cache / "logs", say=lambda line: out(line, flush=True))
    watch = HoldWhileBusy(Hold(supervisor, "train"), cache / "busy", duty=DutyCycle(cfg.trainer.pause_share)) if pausing else None
    pid_path = pid_file(cache)
    pid_path.parent.mkdir(parents=True, exist_ok=True)
    pid_path.write_text(f"{os.getpid()} {start_time(os.getpid())}\n")
    with sigterm_interrupts():
        prep = None
        try:
            if any(p.name in PAIR_PARTS for p in parts):  # prepared while the broker and MLflow start
                out("dvi up: preparing the model pair (a first run fetches and converts it: minutes)", flush=True)
                prep = PairPrep(overrides, verbose=args.verbose, say=lambda line: out(line, flush=True))
            supervisor.start(held=lambda part: part.name in PAIR_PARTS and not prep.done())
            if watch:
                watch.start()
            lines = ["dvi up: running " + ", ".join(p.name for p in parts) + f"; {READY_LINE}"]
            if "serve" in names:
                views = ("vLLM's server; the loop's health, metrics: /dvi/health, /dvi/metrics"
                         if pick_engine(cfg.serve.engine).value == "vllm-server" else "health, metrics: /health, /metrics")
                lines.append(f"  API     http://{cfg.serve.host}:{cfg.serve.port}/v1  ({views})")
            if cfg.tracking.enabled:
                lines.append(f"  MLflow  {find_experiment_link(cfg.tracking)}  (experiment "
                             f"'{cfg.tracking.experiment}': runs trainer, serve-<host>-<port>; model '{cfg.tracking.registry_model}')")
                if login := local_login(cfg.tracking):
                    lines.append(f"          login: user and password in {login}")
            if "broker" in names:
                lines.append(f"  Kafka   {cfg.stream.bootstrap}  (topic {cfg.stream.topic}; `dvi stream tail`)")
            if "train" in names:  # how it shares the machine with serving (trainer.cpu_bind, trainer.cpu_priority)
                lines.append(f"  trainer {train_share(cfg.trainer, priority)}")
            lines.append(f"  logs    {cache / 'logs'}")
            out("\n".join(lines), flush=True)
            while True:
                time.sleep(0.5)
                supervisor.tick()
        except KeyboardInterrupt:
            pass
        finally:
            if prep is not None:
                prep.stop()
            if watch:
                watch.close()  # before the parts stop: a stopped trainer would not hear them
            supervisor.stop()
            if running_pid(cache) == os.getpid():
                pid_path.unlink(missing_ok=True)
    out("dvi up: stopped", flush=True)
    return 0
