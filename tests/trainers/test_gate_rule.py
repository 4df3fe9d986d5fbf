"""The gate's rule (`trainers.gate.judge`), on figures written by hand: a candidate passes on all the held-out records,
or on one domain's while it is no lower on all of them."""

from __future__ import annotations

import pytest

from trainers.gate import Figures, by_domain, group_by_domain, judge, pooled


def figures(realized: list[float], positions: int = 100) -> list[Figures]:
    """One record per rate: `positions` teacher positions each, realized acceptance `rate` (the other figures alike)."""
    return [Figures(r * positions, r * positions, positions, r * positions) for r in realized]


OLD, NEW = ["code"] * 12, ["math"] * 4  # after a drift: most held-out records are the old domain's


def test_a_candidate_better_over_all_records_passes_on_them():
    verdict = judge(figures([0.5] * 16), figures([0.45] * 16), OLD + NEW, min_gain=0.02, min_records=4)
    assert verdict.passes and verdict.domain is None
    assert verdict.domains == {"code": (pytest.approx(0.5), pytest.approx(0.45), 12),
                               "math": (pytest.approx(0.5), pytest.approx(0.45), 4)}


def test_what_a_candidate_learnt_of_a_new_domain_passes_on_its_records_though_pooled_it_is_below_the_gain():
    serving = figures([0.6] * 12 + [0.3] * 4)
    candidate = figures([0.6] * 12 + [0.36] * 4)  # +0.06 on math, +0.015 pooled
    assert pooled(candidate)["realized"] - pooled(serving)["realized"] == pytest.approx(0.015)
    verdict = judge(candidate, serving, OLD + NEW, min_gain=0.02, min_records=4)
    assert verdict.passes and verdict.domain == "math"
    assert not judge(candidate, serving, OLD + NEW, min_gain=0.02, min_records=4, per_domain=False).passes


def test_a_domain_gain_paid_for_with_a_loss_over_all_records_is_refused():
    serving = figures([0.6] * 12 + [0.3] * 4)
    candidate = figures([0.57] * 12 + [0.36] * 4)  # +0.06 on math, -0.03 on code: -0.0075 pooled
    assert pooled(candidate)["realized"] - pooled(serving)["realized"] == pytest.approx(-0.0075)
    assert not judge(candidate, serving, OLD + NEW, min_gain=0.02, min_records=4).passes


def test_a_domain_needs_min_records_held_out_records_and_a_gain_above_min_gain():
    serving = figures([0.6] * 13 + [0.3] * 3)
    candidate = figures([0.6] * 13 + [0.4] * 3)
    domains = ["code"] * 13 + ["math"] * 3
    assert not judge(candidate, serving, domains, min_gain=0.2, min_records=3).passes  # +0.1: not more than 0.2
    assert not judge(candidate, serving, domains, min_gain=0.02, min_records=4).passes  # 3 records of 4 needed
    assert judge(candidate, serving, domains, min_gain=0.02, min_records=3).domain == "math"


def test_where_several_domains_gain_the_largest_gain_names_the_verdict():
    serving = figures([0.5] * 4 + [0.3] * 4 + [0.7] * 8)
    candidate = figures([0.54] * 4 + [0.4] * 4 + [0.66] * 8)  # prose +0.04, math +0.1, code -0.04: pooled +0.005
    domains = ["prose"] * 4 + ["math"] * 4 + ["code"] * 8
    assert judge(candidate, serving, domains, min_gain=0.02, min_records=4).domain == "math"


def test_records_without_a_domain_count_over_all_only():
    assert group_by_domain(["code", None, "", "code"], [1, 2, 3, 4]) == {"code": [1, 4]}
    serving, candidate = figures([0.3] * 8), figures([0.3] * 4 + [0.4] * 4)
    assert by_domain(candidate, serving, ["code"] * 4 + [None] * 4) == {"code": (pytest.approx(0.3), pytest.approx(0.3), 4)}
    verdict = judge(candidate, serving, ["code"] * 4 + [None] * 4, min_gain=0.1, min_records=4)
    assert not verdict.passes  # untagged records gained 0.1, pooled 0.05: no domain to pass on
