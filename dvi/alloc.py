"""The C allocator's settings for dvi's long-running processes (`dvi serve`, `dvi train`, the parts of `dvi up`).

glibc gives each thread that meets a locked heap an arena of its own, up to eight per core. Memory freed into
an arena stays with it, so a process whose threads take turns allocating (the decode or training loop, the Kafka
client's network thread, DeepSpeed's and the HTTP server's threads) spreads its tensors over many arenas, and
its resident memory creeps up with their fragments. In the 30-minute soak (tests/faults/test_soak.py) the
trainer grew about 5 MiB per minute with glibc's default; with two arenas, its lowest resident memory stayed
flat for 27 minutes. Two arenas is what `limit_arenas` sets, once, before the process starts its threads.

The variable MALLOC_ARENA_MAX, when set, is glibc's own setting and wins. Knows nothing about what runs in
the process; on a C library without `mallopt` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # glibc malloc.h
ARENAS = 2


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas`; True when the cap was set by this call."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, arenas) == 1
