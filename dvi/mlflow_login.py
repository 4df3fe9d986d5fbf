"""The login dvi presents to MLflow: the MLflow client's own variables, or the local server's login file.

The mlflow client, dvi's REST calls (`auth_headers`) and the local server's admin account (`dvi.mlflow_server`) all
read MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN for a team server). Where the
environment does not set them and the local server asks for a login (`tracking.auth`, `tracking.uri` null), they are
set from `<tracking.root>/login.env` (`local_login`, `use_login`), which the first process that needs it makes: user
`dvi`, a random password, 0600.

This module knows the login's variables and file; it does not talk to MLflow (`dvi.tracking`) or run it
(`dvi.mlflow_server`).
"""

from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path

from dvi.config import TrackingConfig, mlflow_root
from dvi.errors import DviError
from dvi.files import write_once
# the MLflow client's login variables: dvi's REST calls (`auth_headers`) and the local server's admin account use them too
USER_VAR, PASSWORD_VAR, TOKEN_VAR = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"
LOGIN_FILE = "login.env"  # the local server's login, in its folder (`local_login`)
_logins: dict[Path, tuple[str, str]] = {}  # the login files this process took its login from


def local_login(cfg: TrackingConfig) -> Path | None:
    """Log this process in to the local server when it asks for a login (`tracking.auth`, `tracking.uri` null):
    `use_login` of its folder. None when no local login is used."""
    if not (cfg.enabled and cfg.auth and cfg.uri is None):
        return None
    return use_login(mlflow_root(cfg))


def use_login(root: Path) -> Path | None:
    """The mlflow client and `auth_headers` read USER_VAR / PASSWORD_VAR, so those are set (unless the environment
    sets them both) from LOGIN_FILE in the local server's folder `root`, which the first process that needs it makes
    (user `dvi`, a random password, 0600). Returns that file (None when the environment gives the login). A user
    reads it (or sources it: it is an env file) to log in to the UI or use the mlflow client."""
    path = Path(root) / LOGIN_FILE
    if os.environ.get(USER_VAR) and os.environ.get(PASSWORD_VAR):
        return path if _logins.get(path) == (os.environ[USER_VAR], os.environ[PASSWORD_VAR]) else None
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_once(path, f"{USER_VAR}=dvi\n{PASSWORD_VAR}={secrets.token_urlsafe(24)}\n".encode(), mode=0o600)
        except OSError as e:
            raise DviError(f"cannot write the local MLflow's login {path} ({e}): set tracking.root=<writable folder>") from None
    try:
        pairs = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    except OSError as e:
        raise DviError(f"cannot read the local MLflow's login {path} ({e})") from None
    if not pairs.get(USER_VAR) or not pairs.get(PASSWORD_VAR):
        raise DviError(f"{path} is not a login ({USER_VAR}=... and {PASSWORD_VAR}=... lines): remove it to make a new one")
    os.environ[USER_VAR], os.environ[PASSWORD_VAR] = _logins[path] = pairs[USER_VAR], pairs[PASSWORD_VAR]
    return path


def auth_headers() -> dict[str, str]:
    """The login the mlflow client would present, from its own variables: a bearer token (TOKEN_VAR), or basic auth
    (USER_VAR / PASSWORD_VAR); none when they are not set."""
    if token := os.environ.get(TOKEN_VAR):
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get(USER_VAR), os.environ.get(PASSWORD_VAR)
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    return {}
