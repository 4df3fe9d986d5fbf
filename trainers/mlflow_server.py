"""The local MLflow server: SQLite runs and registry plus local artifacts under one root folder.

`LocalMlflow(root, port)` launches `mlflow server` on 127.0.0.1:<port> (backend `sqlite:///<root>/mlflow.db`,
artifacts proxied by the server into `<root>/artifacts`, so clients on other machines can log artifacts too),
waits until `/health` answers, and stops the whole process group on exit (SIGTERM, SIGKILL if it lingers).
`cmd_mlflow` is `dvi mlflow`: the same server in the foreground until Ctrl-C. A team server is just
`tracking.uri`. This module knows how to run MLflow, not what is logged to it.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from dvi.errors import DviError
from streams.broker import HOST, _port_in_use

log = logging.getLogger("dvi.trainers.mlflow_server")

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local probe never goes via a proxy


def default_root(root: str | None) -> Path:
    """Where the local server keeps its database and artifacts: `tracking.root`, or <cache>/mlflow."""
    from dvi.models import default_cache_dir

    return Path(root).expanduser() if root else default_cache_dir() / "mlflow"


class LocalMlflow:
    """An `mlflow server` process on 127.0.0.1:<port>; a context manager (start on enter, stop on exit)."""

    def __init__(self, root: Path, port: int, startup_timeout_s: float = 60.0):
        self.root = Path(root).resolve()
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            # proxied artifacts: runs get mlflow-artifacts:/ locations that any client can upload to
            "--artifacts-destination", str(self.root / "artifacts"),
            "--host", HOST, "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip

    def start(self) -> LocalMlflow:
        """Launch the server and return once /health answers (DviError otherwise)."""
        if self.running:
            return self
        if _port_in_use(self.port):
            raise DviError(f"port {self.port} on {HOST} is already in use (another MLflow?): stop it or set tracking.port=<free port>")
        try:
            (self.root / "artifacts").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DviError(f"cannot create the MLflow root {self.root} ({e}): set tracking.root=<writable folder>") from e
        self._log = tempfile.NamedTemporaryFile(prefix="dvi-mlflow-", suffix=".log", delete=False)
        # no telemetry; no job runner (a dozen worker processes for GenAI features dvi does not use)
        env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
        # own session (and process group): Ctrl-C reaches dvi only, and stop() reaches the server's workers too
        self._proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, cwd=self.root, start_new_session=True,
        )  # fmt: skip
        atexit.register(self.stop)  # a process that forgets to stop its server does not leave it running
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("mlflow server (pid %d) ready on %s, root %s", self._proc.pid, self.uri, self.root)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise DviError(f"the MLflow server exited at start (status {self._proc.returncode}): {self.log_tail()}")
            try:
                with _NO_PROXY.open(f"{self.uri}/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (urllib.error.URLError, OSError) as e:
                last = str(getattr(e, "reason", e))
            time.sleep(0.2)
        raise DviError(f"the MLflow server on {self.uri} did not answer /health within {self.startup_timeout_s:.0f} s ({last}); log: {self.log_tail()}")

    def log_tail(self, chars: int = 800) -> str:
        if self._log is None:
            return ""
        try:
            return Path(self._log.name).read_text(errors="replace")[-chars:].strip() or "(empty log)"
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server's process group: SIGTERM, SIGKILL if anything is still there after `grace_s`."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is not None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("mlflow server (pid %d) ignored SIGTERM for %.0f s: killing it", proc.pid, grace_s)
            _signal_group(proc, signal.SIGKILL)  # the uvicorn worker may outlive its parent: no stray processes
            proc.wait()
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None

    def __enter__(self) -> LocalMlflow:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the server's pid
    except ProcessLookupError:
        pass


def cmd_mlflow(args: argparse.Namespace) -> int:
    """`dvi mlflow`: the local MLflow server in the foreground on 127.0.0.1:tracking.port until Ctrl-C or SIGTERM."""
    from dvi.cli import overrides_of
    from dvi.config import load_config

    cfg = load_config(overrides_of(args)).tracking
    if cfg.uri:
        raise DviError(
            f"tracking.uri is set ({cfg.uri}): runs go to that MLflow, not a local one; run `dvi mlflow tracking.uri=null` for a local one"
        )
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with LocalMlflow(default_root(cfg.root), cfg.port) as server:
            print(f"dvi mlflow: MLflow on {server.uri}, data in {server.root}; Ctrl-C stops it", flush=True)
            try:
                while not stop.wait(0.5):
                    if not server.running:
                        raise DviError(f"the MLflow server exited unexpectedly: {server.log_tail()}")
            except KeyboardInterrupt:
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("dvi mlflow: stopped", flush=True)
    return 0
