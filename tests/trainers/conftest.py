"""Shared fixtures of the trainer tests: the DeepSpeed process group (one per process, so one per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ds_world() -> tuple[int, int]:
    """(rank, world size) after `trainers.ds.init_distributed()`: a world of one over gloo in a plain pytest run.

    It leaves RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in this process's environment: a test that starts
    a trainer subprocess must drop or blank them, or the child takes them for a launcher's and joins this
    process's rendezvous port.
    """
    from trainers.ds import init_distributed

    return init_distributed()
