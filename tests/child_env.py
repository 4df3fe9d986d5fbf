"""The environment for a `dvi` child process a test starts (train, serve): this process's, without the DeepSpeed
world that the in-process `ds_world` fixture leaves in it (RANK, WORLD_SIZE, ...). A child that inherited those
would take them for a launcher's and join this process's rendezvous port; it starts a world of its own."""

from __future__ import annotations

import os

DISTRIBUTED = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the distributed variables, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k not in DISTRIBUTED}, **extra}
