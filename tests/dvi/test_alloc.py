"""dvi.alloc against glibc itself: threads that allocate at once get arenas of their own, unless capped; memory
freed below a block still in use stays resident until `release_free`.

Each case runs in a fresh interpreter (an arena, once made, stays for the life of the process): the arena cases
count the heaps that glibc's `malloc_info` reports after eight threads allocated side by side, the release case
reads the interpreter's resident memory. The kernel-cache case counts what torch's bf16 CPU matmuls keep per shape
(`limit_kernel_caches`). Linux with glibc only."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from dvi.alloc import KERNEL_CACHE_ENTRIES, KERNEL_CACHES, limit_kernel_caches

PROBE = r"""
import ctypes, sys, tempfile, threading
if sys.argv[1] == "cap":
    from dvi.alloc import limit_arenas
    print("set", limit_arenas())
barrier, keep = threading.Barrier(8), []
def work():
    barrier.wait()
    keep.extend(bytearray(64 * 1024) for _ in range(50))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w"); libc.malloc_info(0, fp); libc.fclose(fp)
    print("heaps", open(f.name).read().count("<heap nr="))
"""


def heaps(mode: str, **env: str) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=environ, capture_output=True, text=True, check=True).stdout
    return out, int(out.split("heaps")[1])


def test_the_cap_holds_threads_to_two_arenas():
    assert heaps("plain")[1] > 2  # the default: the threads spread over more arenas
    out, n = heaps("cap")
    assert "set True" in out and n <= 2


def test_malloc_arena_max_wins():
    out, n = heaps("cap", MALLOC_ARENA_MAX="1")
    assert "set False" in out and n == 1


TRIM_PROBE = r"""
import ctypes, os, sys
from dvi.alloc import release_free
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
# where glibc's own thresholds end up once a training loop has freed its first large blocks: blocks up to 32 MiB
# served from the heap, and the heap's top kept
libc.mallopt(-3, 32 << 20); libc.mallopt(-1, 1 << 30)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
blocks, pins = [], []
for _ in range(200):  # 1 MiB blocks, each followed by a small one that stays in use: none of them is the heap's top
    blocks.append(libc.malloc(1 << 20)); ctypes.memset(blocks[-1], 1, 1 << 20); pins.append(libc.malloc(64))
for b in blocks: libc.free(b)
before = rss()
released = release_free()
print("rss", before, rss(), released)
"""


def test_release_free_gives_pages_freed_below_a_live_block_back():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True).stdout
    before, after, released = out.split()[1:]
    assert int(before) >= 200 and int(before) - int(after) >= 150, out  # of the 200 MiB freed: glibc alone kept them
    assert released == "True"


FIGURES_PROBE = r"""
import ctypes, json
from dvi.alloc import heap_figures
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
seen = {"start": heap_figures()}
blocks = [libc.malloc(64 << 10) for _ in range(400)]  # 64 KiB blocks, from the heap
seen["small"] = heap_figures()
for b in blocks[::2]: libc.free(b)  # every other one: each freed block lies between two still in use
seen["freed"] = heap_figures()
big = libc.malloc(8 << 20)  # over the mmap threshold: its own mapping
seen["big"] = heap_figures()
print(json.dumps(seen))
"""


def test_heap_figures_tell_memory_in_use_from_freed_fragments():
    import json
    out = subprocess.run([sys.executable, "-c", FIGURES_PROBE], capture_output=True, text=True, check=True).stdout
    seen = json.loads(out)
    start, small, freed, big = seen["start"], seen["small"], seen["freed"], seen["big"]
    assert small["in_use"] - start["in_use"] >= 25, seen  # 400 x 64 KiB = 25 MiB handed out
    assert small["in_use"] - freed["in_use"] >= 12 and freed["free"] - small["free"] >= 12, seen  # now fragments
    assert big["mmap"] - freed["mmap"] >= 8 and big["in_use"] - freed["in_use"] >= 8, seen
    assert start["py_blocks"] > 0


KERNEL_PROBE = r"""
import sys

import torch
import torch
from dvi.alloc import heap_figures, limit_kernel_caches, release_free
torch.set_num_threads(1)
torch.ones(4, 4) @ torch.ones(4, 4)  # torch loaded and used before the caps: they hold from the first bf16 matmul
if sys.argv[1] == "cap":
    limit_kernel_caches()
lin = torch.nn.Linear(576, 1536).to(torch.bfloat16).requires_grad_(False)
def in_use():
    release_free()
    return heap_figures()["in_use"]
with torch.no_grad():
    lin(torch.ones(8, 576, dtype=torch.bfloat16))
    start = in_use()
    for rows in range(1, 201):  # a new shape each time, as the trainer's batches of varying token counts
        lin(torch.ones(rows, 576, dtype=torch.bfloat16))
print(in_use() - start)
"""


ONEDNN_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN runs this CPU's bf16 matmuls


def kept_by_shapes(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHES}
    out = subprocess.run([sys.executable, "-c", KERNEL_PROBE, mode], env=env, capture_output=True, text=True, check=True,
                         timeout=300).stdout
    return float(out.split()[-1])


def test_capped_kernel_caches_bound_what_new_shapes_of_a_bf16_matmul_keep():
    """torch's bf16 CPU matmuls keep kernels per shape (oneDNN's primitive cache and torch's own), 1,024 each by
    default. What one shape keeps depends on the CPU's kernel: 200 shapes kept 11 MiB on an AVX-512 CPU without
    native bf16 (oneDNN's `gemm:jit:bf16`), tens of MiB with native bf16. Capped by `limit_kernel_caches`, at most its
    entries' worth of what the plain run kept. A CPU without AVX-512 (AVX2 only) runs bf16 matmuls outside oneDNN,
    which keeps nothing per shape: there the capped run must still keep no more than a native run's bound."""
    plain, capped = kept_by_shapes("plain"), kept_by_shapes("cap")
    share = KERNEL_CACHE_ENTRIES / 200
    if ONEDNN_BF16:
        assert plain >= 5, plain  # at least 25 KiB a shape: what the cap is there to bound
        assert capped <= 1.25 * plain * share, (plain, capped)
    else:
        assert capped <= 1.25 * 60 * share, (plain, capped)


def test_kernel_cache_caps_leave_the_users_own_values(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "3")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert limit_kernel_caches(entries=5) == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "5" and os.environ["LRU_CACHE_CAPACITY"] == "3"


def test_the_trainers_command_line_check_caps_the_kernel_caches(monkeypatch):
    import argparse

    from dvi.cli import args

    for name in KERNEL_CACHES:
        monkeypatch.delenv(name, raising=False)
    args.train(argparse.Namespace(overrides=[]))
    assert all(os.environ[name] == str(KERNEL_CACHE_ENTRIES) for name in KERNEL_CACHES)
