"""`benchmarks.bench_store`'s figure: the store's growth per 1,000 batches written, against a plain least-squares fit."""

from __future__ import annotations

import pytest

from benchmarks.bench_store import growth_per_1000


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
