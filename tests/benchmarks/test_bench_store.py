"""`benchmarks.bench_store`'s figure: the store's growth per 1,000 batches written, against a plain least-squares fit."""

from __future__ import annotations

import pytest

from benchmarks.bench_store import growth_per_1000, memory_kinds


def test_growth_is_the_slope_over_the_second_half_per_thousand_batches():
    # a start-up jump in the first half is left out; the second half rises 0.5 MiB per 1,000 batches
    samples = [{"batches": n, "store_mib": 10.0 + (n > 4000) * 10 + 0.0005 * n} for n in range(1000, 10001, 500)]
    half = samples[len(samples) // 2:]
    xs, ys = [s["batches"] / 1000 for s in half], [s["store_mib"] for s in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    reference = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert growth_per_1000(samples) == pytest.approx(reference) == pytest.approx(0.5)
    flat = [{"batches": n, "store_mib": 25.0} for n in range(0, 8000, 1000)]
    assert growth_per_1000(flat) == pytest.approx(0.0)
    assert growth_per_1000(flat[:6]) is None  # three in the second half: too few to fit


SMAPS = """\
55d0c0a00000-55d0c0c00000 r-xp 00000000 fd:01 1234                       /usr/bin/python3.11
Size:               2048 kB
Rss:                1024 kB
55d0c1000000-55d0c1400000 rw-p 00000000 00:00 0                          [heap]
Size:               4096 kB
Rss:                3072 kB
7f2480000000-7f2480300000 rw-p 00000000 00:00 0 
Size:               3072 kB
Rss:                2048 kB
7f2480300000-7f2484000000 ---p 00000000 00:00 0 
Size:              62464 kB
Rss:                   0 kB
7f2490100000-7f2490200000 rw-p 00000000 00:00 0 
Size:               1024 kB
Rss:                 512 kB
7f2490200000-7f2490242000 rw-p 00000000 00:00 0 
Size:                264 kB
Rss:                 256 kB
VmFlags: rd wr mr mw me ac sd
7ffd1e000000-7ffd1e021000 rw-p 00000000 00:00 0                          [stack]
Size:                132 kB
Rss:                 128 kB
"""


def test_memory_kinds_sorts_resident_memory_by_mapping():
    # a thread's arena starts at a multiple of 64 MiB (its reserved rest, ---p, holds nothing); a 1 MiB anonymous
    # mapping is one of CPython's object arenas; a 264 KiB one, a block malloc mapped
    assert memory_kinds(SMAPS) == {"heap": 3.0, "arenas": 2.0, "python": 0.5, "anon": 0.25, "files": 1.0, "other": 0.12}
    assert memory_kinds("") == dict.fromkeys(("heap", "arenas", "python", "anon", "files", "other"), 0.0)
