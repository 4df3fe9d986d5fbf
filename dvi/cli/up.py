"""`dvi up`: the whole local loop as supervised child processes.

Owns the plan (which parts run, in what order, how each says it is ready) and their supervision. The parts are
`dvi broker` (unless `stream.bootstrap_servers` names a Kafka), `dvi mlflow` (unless `tracking.uri` names a
server or tracking is off), `dvi serve` and `dvi train`, each run with this interpreter and the same overrides,
so each loads exactly the config `dvi up` loaded. They start in that order, each waited on until ready; a part
that exits is reported and restarted after a backoff (1 s, doubling to 30 s, back to 1 s once a run lasted a
minute); Ctrl-C or SIGTERM stops them in reverse order. Child logs go to <cache>/logs/<part>.log. The drift
benchmark (benchmarks/drift.py) runs its replicas with the same `Supervisor`.

It knows how to start, watch and stop the parts, not what they do.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dvi.config import load_config, overrides_of
from dvi.errors import DviError
from dvi.models import cache_dir, pair_dirs, resolve_device, resolve_dtype
from dvi.procs import Child, http_ok, sigterm_interrupts, spawn, wait_ready

PARTS = ("broker", "mlflow", "serve", "train")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a run that lasted this long was healthy: the next crash starts the backoff over


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


def banner(prefix: str) -> Callable[[Child], str | None]:
    """A probe: ready once the child's log (since it started) has a line starting with `prefix`."""

    def probe(child: Child) -> str | None:
        return None if any(line.startswith(prefix) for line in child.log_since_start().splitlines()) else f"no '{prefix}' yet"

    return probe


def plan(cfg, only: set[str] | None = None, train: bool = True) -> list[Part]:
    """The parts to run for a loaded `DviConfig`, in start order."""
    unknown = sorted((only or set()) - set(PARTS))
    if unknown:
        raise DviError(f"--only {','.join(unknown)}: unknown part(s); the parts are {', '.join(PARTS)}")
    serve_url = f"http://{cfg.serve.host}:{cfg.serve.port}"
    parts = []
    if cfg.stream.bootstrap_servers is None:
        parts.append(Part("broker", ["broker"], banner("dvi broker:"), 60))  # its banner comes once the topics exist
    if cfg.tracking.enabled and cfg.tracking.uri is None:
        parts.append(Part("mlflow", ["mlflow"], lambda _: http_ok(f"{cfg.tracking.tracking_uri}/health"), 120))
    parts.append(Part("serve", ["serve"], lambda _: http_ok(f"{serve_url}/health"), 300))
    if train:
        parts.append(Part("train", ["train"], banner("dvi train:"), 300))
    return [p for p in parts if only is None or p.name in only]


class Supervisor:
    """Starts the parts in order, restarts those that exit, stops them all in reverse order."""

    def __init__(self, parts: list[Part], overrides: list[str], log_dir: Path, say: Callable[[str], None] = print):
        self.parts = parts
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
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return spawn(part.name, cmd, log_path=self.log_dir / f"{part.name}.log", env=env)

    def start(self) -> None:
        """Start every part and wait until each is ready; on a failure, stop what started and raise DviError."""
        try:
            for part in self.parts:
                child = self.children[part.name] = self._spawn(part)
                wait_ready(child, lambda: part.ready(child), part.ready_timeout_s, f"dvi {part.name}", interval_s=0.25)
                self.say(f"dvi up: {part.name} ready (pid {child.pid}, log {child.log_path})")
        except BaseException:
            self.stop()
            raise

    def tick(self) -> None:
        """One look at every part: report and schedule the restart of one that exited, start one that is due."""
        now = time.monotonic()
        for part in self.parts:
            name = part.name
            child = self.children.get(name)
            if child is not None and not child.running:
                uptime, status = child.uptime_s, child.stop()
                delay = self._backoff[name] = next_backoff(self._backoff[name], uptime)
                del self.children[name]
                self._starting.pop(name, None)
                self._due[name] = now + delay
                self.say(f"dvi up: {name} exited (status {status}) after {uptime:.0f} s; restarting in {delay:.0f} s; "
                         f"log {child.log_path}")
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

    def stop(self) -> None:
        for part in reversed(self.parts):
            child = self.children.pop(part.name, None)
            if child is not None:
                status = child.stop(grace_s=30)
                self.say(f"dvi up: {part.name} stopped (status {status})")
        self._due.clear()


def up(args: argparse.Namespace) -> int:
    overrides = overrides_of(args)
    cfg = load_config(overrides)
    only = set(args.only.split(",")) if args.only else None
    parts = plan(cfg, only, train=not args.no_train)
    cache = cache_dir(cfg.model)
    if any(p.name in ("serve", "train") for p in parts):
        resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))  # one clear line here, not a restart loop of parts
        target, drafter = pair_dirs(cfg.model)  # fetched and built once, before two parts race to do it
        print(f"dvi up: target {target}, drafter {drafter}", flush=True)
    supervisor = Supervisor(parts, overrides, cache / "logs", say=lambda line: print(line, flush=True))
    with sigterm_interrupts():
        try:
            supervisor.start()
            names = {p.name for p in parts}
            lines = ["dvi up: running " + ", ".join(p.name for p in parts) + "; Ctrl-C stops everything"]
            if "serve" in names:
                lines.append(f"  API     http://{cfg.serve.host}:{cfg.serve.port}/v1  (health, metrics: /health, /metrics)")
            if cfg.tracking.enabled:
                lines.append(f"  MLflow  {cfg.tracking.tracking_uri}  (experiment '{cfg.tracking.experiment}', "
                             f"model '{cfg.tracking.registry_model}')")
            if "broker" in names:
                lines.append(f"  Kafka   {cfg.stream.bootstrap}  (topic {cfg.stream.topic}; `dvi stream tail`)")
            lines.append(f"  logs    {cache / 'logs'}")
            print("\n".join(lines), flush=True)
            while True:
                time.sleep(0.5)
                supervisor.tick()
        except KeyboardInterrupt:
            pass
        finally:
            supervisor.stop()
    print("dvi up: stopped", flush=True)
    return 0
