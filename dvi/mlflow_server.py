"""The local MLflow server: SQLite runs and registry plus local artifacts under one root folder.

`LocalMlflow(root, port)` launches `mlflow server` on 127.0.0.1:<port> (backend `sqlite:///<root>/mlflow.db`,
artifacts proxied by the server into `<root>/artifacts`, so clients on other machines can log artifacts too),
waits until `/health` answers, and stops the whole process group on exit (dvi.procs); `dvi mlflow` runs it in the
foreground. A team server is just `tracking.uri`.

With `auth=True` (`tracking.auth`) the server is MLflow's basic-auth app (the `mlflow[auth]` extra): every request
but `/health` needs a login, and the admin account is the one clients present, MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD from the environment (MLflow's own client variables, so dvi's parts, the mlflow client and
`dvi status` all log in with them; the server gets them in its environment, never in a file). Its config
(`<root>/basic_auth.ini`) keeps users in `<root>/auth.db`; the Flask session key is new at every start.

This module knows how to run MLflow, not what is logged to it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import sys
from pathlib import Path

from dvi.errors import DviError
from dvi.models import default_cache_dir
from dvi.procs import HOST, ServerProcess, http_ok, port_in_use
from dvi.tracking import PASSWORD_VAR, USER_VAR

log = logging.getLogger("dvi.mlflow_server")


def default_root(root: str | None) -> Path:
    """Where the local server keeps its database and artifacts: `tracking.root`, or <cache>/mlflow."""
    return Path(root).expanduser() if root else default_cache_dir() / "mlflow"


class LocalMlflow(ServerProcess):
    """An `mlflow server` process on 127.0.0.1:<port>; a context manager (start on enter, stop on exit; stopping
    signals its process group, the uvicorn worker too)."""

    def __init__(self, root: Path, port: int, startup_timeout_s: float = 60.0, auth: bool = False):
        self.root = Path(root).resolve()
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.auth = auth

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
            *(["--app-name", "basic-auth"] if self.auth else []),
        ]  # fmt: skip

    def _auth_env(self) -> dict[str, str]:
        """The basic-auth app's environment: its config file (no secret in it), the admin account (the clients'
        login) and a fresh session key."""
        if importlib.util.find_spec("flask_wtf") is None:
            raise DviError("tracking.auth=true needs MLflow's basic-auth app: pip install 'dvi[local]' (mlflow[auth])")
        user, password = os.environ.get(USER_VAR, ""), os.environ.get(PASSWORD_VAR, "")
        if not user or not password:
            raise DviError(f"tracking.auth=true: set {USER_VAR} and {PASSWORD_VAR} in the environment (the admin "
                           "account of the local MLflow, and the login every dvi part uses)")
        ini = self.root / "basic_auth.ini"
        ini.write_text("[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
                       f"database_uri = sqlite:///{self.root / 'auth.db'}\n"
                       "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
        return {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_USERNAME": user, "MLFLOW_AUTH_ADMIN_PASSWORD": password,
                "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32)}

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
        if self.auth:
            env.update(self._auth_env())
        self._launch("mlflow", self.command(), lambda: http_ok(f"{self.uri}/health"), self.startup_timeout_s,
                     f"the MLflow server on {self.uri}", env=env, cwd=self.root, interval_s=0.2)
        log.info("mlflow server (pid %d) ready on %s, root %s", self._child.pid, self.uri, self.root)
        return self
