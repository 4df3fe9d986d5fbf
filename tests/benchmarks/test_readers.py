"""benchmarks.readers' figures from its answers (pure)."""

from __future__ import annotations

import pytest

from benchmarks.drift import Sample
from benchmarks.readers import summary


def answer(seconds: float, rounds: int, drafted: int) -> Sample:
    return Sample(slot=0, phase=0, domain="code", side="parked", t=0.0, version=None, rounds=rounds, drafted=drafted,
                  accepted=0, tokens=48, seconds=seconds)


def test_seconds_and_drafts_per_round_and_the_median_latency_ratio():
    rows = {"parked": [answer(2.0, 20, 40), answer(1.0, 20, 20), answer(3.0, 10, 0)],
            "vllm": [answer(1.0, 10, 30), answer(1.0, 10, 30), answer(2.0, 20, 40)]}
    out = summary(rows)
    assert out["parked"] == {"answers": 3, "seconds_per_round": pytest.approx(6.0 / 50), "drafts_per_round": pytest.approx(60 / 50)}
    assert out["vllm"]["seconds_per_round"] == pytest.approx(4.0 / 40) and out["vllm"]["drafts_per_round"] == pytest.approx(2.5)
    assert out["latency_parked_vs_vllm"] == pytest.approx(1.5)  # ratios 2.0, 1.0, 1.5
    assert summary({"parked": [], "vllm": []})["latency_parked_vs_vllm"] is None
