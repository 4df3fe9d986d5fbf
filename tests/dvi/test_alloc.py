"""dvi.alloc against glibc itself: threads that allocate at once get arenas of their own, unless capped.

Each case runs in a fresh interpreter (an arena, once made, stays for the life of the process) and counts the
heaps that glibc's `malloc_info` reports after eight threads allocated side by side. Linux with glibc only."""

from __future__ import annotations

import os
import subprocess
import sys

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
