"""The C allocator's settings for dvi's long-running processes (`dvi serve`, `dvi train`, the parts of `dvi up`).

glibc gives each thread that meets a locked heap an arena of its own, up to eight per core. Memory freed into
an arena stays with it, so a process whose threads take turns allocating (the decode or training loop, the Kafka
client's network thread, DeepSpeed's and the HTTP server's threads) spreads its tensors over many arenas, and
its resident memory creeps up with their fragments. In a 30-minute soak of `dvi serve` and `dvi train` the
trainer grew about 5 MiB per minute with glibc's default; with two arenas, its lowest resident memory stayed
flat for 27 minutes. Two arenas is what `limit_arenas` sets, once, before the process starts its threads.

The variable MALLOC_ARENA_MAX, when set, is glibc's own setting and wins. Knows nothing about what runs in
the process; on a C library without `mallopt` or `malloc_trim` (musl, macOS) each function does nothing.

Freed memory also stays in the heap when it lies below memory still in use: glibc gives back only the top of a
heap (and, once a large block served from mmap is freed, serves blocks up to that size from the heap too, so a
training step's tensors land there). `dvi drafter distill` alone on 600 records of a soak's topic, 60 steps:
resident memory 3,396 MiB (median of the first half, after two minutes) then 3,696 MiB (second half), still
rising. With `release_free` (glibc's `malloc_trim`: every whole free page back to the system) after every step:
3,155 then 3,108 MiB, its low points at about 2,000 MiB, for 6% more time per step (the pages freed are faulted
in again). The trainer (`dvi train`, `dvi drafter distill`) calls it after a step at most once a minute,
and on an idle turn of its loop after a step (`trainers.triggers.release_due`). (glibc's
mmap threshold fixed at 128 KiB held it at 2,100 MiB too, but took 1.7x as long per step.)

`heap_figures` tells the two apart in a running process: memory the program keeps, or fragments the heap keeps
(the trainer logs them to MLflow as `system/heap_*`).

Memory torch keeps: a bf16 matmul on a CPU runs through oneDNN, and two caches keep what was built for each new
shape (oneDNN's primitive cache and torch's own LRU cache of ideep computations), 1,024 entries each by default.
The trainer's bf16 target forward (an EAGLE-3 drafter's features) meets a new shape with nearly every batch, its
token count varying, so both fill: in the two-hour soak the trainer's heap in use rose about 5 MiB a minute, with
its record queues flat. A bf16 Linear(576, 1536) over 600 distinct row counts kept 385 MiB (0.65 MiB a shape); with
both caches at 16 entries its heap stayed within 1 MiB over 1,200 such forwards, no slower (each new shape is built
anyway). `benchmarks/bench_kernel_cache.py` measures the trainer's own forward. `limit_kernel_caches` sets both
capacities (`KERNEL_CACHE_ENTRIES`) where the user set none; torch reads them at its first bf16 matmul, so the
trainer (`dvi.cli.args.train`) sets them before torch loads. fp32 matmuls keep nothing per shape. `dvi serve`
(vLLM's processes, dvi's engine) is left with the defaults: not measured there.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_ARENA_MAX = -8  # glibc malloc.h
ARENAS = 2
RELEASE_EVERY_S = 60.0  # a long-running loop gives freed heap memory back (`release_free`) at most this often
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, torch's (ideep computations)
KERNEL_CACHE_ENTRIES = 64  # a batch's four layer shapes at 16 token counts; full, 40 MiB of a Linear(576, 1536)'s


def _libc(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas`; True when the cap was set by this call."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, arenas) == 1


def limit_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> list[str]:
    """Cap the per-shape caches of torch's bf16 CPU matmuls at `entries` each (see the module's docstring); returns
    the variables set by this call (one the environment already holds is the user's, and wins). Takes effect where it
    runs before the process's first bf16 matmul, and in the processes it starts."""
    unset = [name for name in KERNEL_CACHES if name not in os.environ]
    for name in unset:
        os.environ[name] = str(entries)
    return unset


def release_free() -> bool:
    """Give every whole free page of the heaps back to the system (glibc's `malloc_trim(0)`); True when some was.
    A few milliseconds; meant for a loop's quiet point, such as the end of a training step."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim(0) == 1


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_figures() -> dict[str, float] | None:
    """Where the process's C heap stands, in MiB (glibc's `mallinfo2`, over every arena): `in_use` (blocks handed out
    and not freed, the heaps' and mmap's), `free` (freed blocks the heaps still hold: fragments below memory in use,
    until `release_free` gives whole pages of them back), `mmap` (the part of `in_use` served by mmap: blocks of 128
    KiB and more, at first), and `py_blocks`, the interpreter's own allocated objects (its small-object arenas lie
    outside the C heap). Resident memory that rises with `in_use` is memory kept by the program; with `free`, heap
    fragmentation. None on a C library without `mallinfo2` (glibc before 2.33, musl, macOS). Locks each arena for a
    moment: meant for a metrics interval, not a hot loop."""
    info = _libc("mallinfo2")
    if info is None:
        return None
    info.argtypes, info.restype = [], _Mallinfo2
    m, mib = info(), float(1 << 20)
    return {"in_use": (m.uordblks + m.hblkhd) / mib, "free": m.fordblks / mib, "mmap": m.hblkhd / mib,
            "py_blocks": float(sys.getallocatedblocks())}
