"""benchmarks.readers' figures from its answers (pure)."""

from __future__ import annotations

import pytest

from benchmarks.readers import summary


def test_seconds_and_drafts_per_round_and_the_median_latency_ratio():
    rows = {"parked": [{"seconds": 2.0, "rounds": 20, "drafted": 40}, {"seconds": 1.0, "rounds": 20, "drafted": 20},
                       {"seconds": 3.0, "rounds": 10, "drafted": 0}],
            "vllm": [{"seconds": 1.0, "rounds": 10, "drafted": 30}, {"seconds": 1.0, "rounds": 10, "drafted": 30},
                     {"seconds": 2.0, "rounds": 20, "drafted": 40}]}
    out = summary(rows)
    assert out["parked"] == {"answers": 3, "seconds_per_round": pytest.approx(6.0 / 50), "drafts_per_round": pytest.approx(60 / 50)}
    assert out["vllm"]["seconds_per_round"] == pytest.approx(4.0 / 40) and out["vllm"]["drafts_per_round"] == pytest.approx(2.5)
    assert out["latency_parked_vs_vllm"] == pytest.approx(1.5)  # ratios 2.0, 1.0, 1.5
    assert summary({"parked": [], "vllm": []})["latency_parked_vs_vllm"] is None
