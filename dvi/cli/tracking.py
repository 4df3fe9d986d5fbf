"""`dvi mlflow`: the local MLflow server (`dvi.mlflow_server.LocalMlflow`) in the foreground until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse

from dvi.cli.output import out
from dvi.config import load_config, mlflow_root, overrides_of
from dvi.errors import DviError
from dvi.mlflow_login import local_login
from dvi.mlflow_server import LocalMlflow
from dvi.procs import run_foreground


def mlflow(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args)).tracking
    if cfg.uri:
        raise DviError(
            f"tracking.uri is set ({cfg.uri}): runs go to that MLflow, not a local one; run `dvi mlflow tracking.uri=null` for a local one"
        )
    server = LocalMlflow(mlflow_root(cfg), cfg.port, auth=cfg.auth)
    login = local_login(cfg)
    where = f", login in {login}" if login else ""
    return run_foreground("mlflow", "the MLflow server", server, lambda s: f"MLflow on {s.uri}, data in {s.root}{where}",
                          say=out)
