"""The local MLflow server: SQLite runs and registry plus local artifacts under one root folder.

`LocalMlflow(root, port)` launches `mlflow server` on 127.0.0.1:<port> (backend `sqlite:///<root>/mlflow.db`,
artifacts proxied by the server into `<root>/artifacts`, so clients on other machines can log artifacts too),
waits until `/health` answers, and stops the whole process group on exit (dvi.procs); `dvi mlflow` runs it in the
foreground. A team server is just `tracking.uri`. This module knows how to run MLflow, not what is logged to it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from dvi.errors import DviError
from dvi.models import default_cache_dir
from dvi.procs import HOST, ServerProcess, http_ok, port_in_use

log = logging.getLogger("dvi.mlflow_server")


def default_root(root: str | None) -> Path:
    """Where the local server keeps its database and artifacts: `tracking.root`, or <cache>/mlflow."""
    return Path(root).expanduser() if root else default_cache_dir() / "mlflow"


class LocalMlflow(ServerProcess):
    """An `mlflow server` process on 127.0.0.1:<port>; a context manager (start on enter, stop on exit; stopping
    signals its process group, the uvicorn worker too)."""

    def __init__(self, root: Path, port: int, startup_timeout_s: float = 60.0):
        self.root = Path(root).resolve()
        self.port = port
        self.startup_timeout_s = startup_timeout_s

    @property
    def uri(self) -> str:
        return f"http://{HOST}:{self.port}"

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
        if importlib.util.find_spec("flask") is None:  # mlflow-skinny (the client) has no server
            raise DviError("the local MLflow server needs the full mlflow package, which the base install leaves out: "
                           "pip install 'dvi[local]', or set tracking.uri to a running MLflow")
        if port_in_use(self.port):
            raise DviError(f"port {self.port} on {HOST} is already in use (another MLflow?): stop it or set tracking.port=<free port>")
        try:
            (self.root / "artifacts").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DviError(f"cannot create the MLflow root {self.root} ({e}): set tracking.root=<writable folder>") from e
        # no telemetry; no job runner (a dozen worker processes for GenAI features dvi does not use)
        env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
        self._launch("mlflow", self.command(), lambda: http_ok(f"{self.uri}/health"), self.startup_timeout_s,
                     f"the MLflow server on {self.uri}", env=env, cwd=self.root, interval_s=0.2)
        log.info("mlflow server (pid %d) ready on %s, root %s", self._child.pid, self.uri, self.root)
        return self
