"""`dvi mlflow`: the local MLflow server (`dvi.mlflow_server.LocalMlflow`) in the foreground until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse

from dvi.config import load_config, overrides_of
from dvi.errors import DviError
from dvi.mlflow_server import LocalMlflow, default_root
from dvi.procs import run_foreground


def mlflow(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args)).tracking
    if cfg.uri:
        raise DviError(
            f"tracking.uri is set ({cfg.uri}): runs go to that MLflow, not a local one; run `dvi mlflow tracking.uri=null` for a local one"
        )
    server = LocalMlflow(default_root(cfg.root), cfg.port, auth=cfg.auth)
    return run_foreground("mlflow", "the MLflow server", server, lambda s: f"MLflow on {s.uri}, data in {s.root}")
