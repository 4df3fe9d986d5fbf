"""The local MLflow server: SQLite runs and registry plus local artifacts under one root folder.

`LocalMlflow(root, port)` launches `mlflow server` on 127.0.0.1:<port> (backend `sqlite:///<root>/mlflow.db`,
artifacts proxied by the server into `<root>/artifacts`, so clients on other machines can log artifacts too),
waits until `/health` answers, and stops the whole process group on exit (dvi.procs); `dvi mlflow` runs it in the
foreground. A team server is just `tracking.uri`.

With `auth=True` (`tracking.auth`, the default) the server is MLflow's basic-auth app (the `mlflow[auth]` extra):
every request but `/health` needs a login, and the admin account is the one clients present, MLFLOW_TRACKING_USERNAME
and MLFLOW_TRACKING_PASSWORD (MLflow's own client variables, so dvi's parts, the mlflow client and `dvi status` all log
in with them): from the environment, or else from `<root>/login.env`, made once with a random password
(`dvi.mlflow_login.use_login`). The server gets them in its environment; its config (`<root>/basic_auth.ini`) holds no
secret and keeps users in `<root>/auth.db`; the Flask session key is new at every start. An admin account in
auth.db whose password is not the login's is one clear error at start.

This module knows how to run MLflow, not what is logged to it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import sys
import urllib.error
from pathlib import Path

from dvi.errors import DviError
from dvi.mlflow_login import LOGIN_FILE, PASSWORD_VAR, USER_VAR, use_login
from dvi.procs import HOST, ServerProcess, http_ok, port_in_use
from dvi.tracking import rest

log = logging.getLogger("dvi.mlflow_server")


AUTH_CACHE_S = 60  # how long the basic-auth app trusts a login it has checked (MLflow's own cache, keyed by an HMAC)


class LocalMlflow(ServerProcess):
    """An `mlflow server` process on 127.0.0.1:<port>; a context manager (start on enter, stop on exit; stopping
    signals its process group, the uvicorn worker too)."""

    # 180 s: restarted beside two serving engines on 2 cores, the server took about 70 s to answer (a 60 s limit
    # gave up on a start that was getting there, and the restart after it took as long again)
    def __init__(self, root: Path, port: int, startup_timeout_s: float = 180.0, auth: bool = False,
                 auth_cache_s: int = AUTH_CACHE_S):
        self.root = Path(root).resolve()
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.auth = auth
        self.auth_cache_s = auth_cache_s  # 0: every request's password is checked

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
        use_login(self.root)
        user, password = os.environ[USER_VAR], os.environ[PASSWORD_VAR]
        ini = self.root / "basic_auth.ini"
        ini.write_text("[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
                       f"database_uri = sqlite:///{self.root / 'auth.db'}\n"
                       "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                       # a password check costs 0.2 s on 2 cores (scrypt): a login that passed is trusted for a minute
                       f"auth_cache_ttl_seconds = {self.auth_cache_s}\n")
        return {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_USERNAME": user, "MLFLOW_AUTH_ADMIN_PASSWORD": password,
                "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32)}

    def _check_login(self) -> None:
        """The admin account MLflow keeps in auth.db (made at its first start) takes this login; DviError if not."""
        try:
            rest(self.uri, "experiments/get-by-name", {"experiment_name": "Default"}, timeout_s=10)
        except urllib.error.HTTPError as e:
            if e.code != 401:
                return
            self.stop()
            raise DviError(f"the local MLflow's admin account in {self.root / 'auth.db'} has another password than "
                           f"{USER_VAR} / {PASSWORD_VAR} ({LOGIN_FILE} in {self.root} unless the environment sets them): "
                           "give that password, or remove auth.db to make the account again") from None
        except OSError:
            return

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
        if self.auth:
            self._check_login()
        log.info("mlflow server (pid %d) ready on %s, root %s", self._child.pid, self.uri, self.root)
        return self
