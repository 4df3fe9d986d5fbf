"""Retrain triggers: each kind fires when it should and not otherwise (explicit clock, no sleeps)."""

from __future__ import annotations

import pytest

from dvi.config import TriggerConfig
from dvi.errors import DviError
from trainers.triggers import Claim, Trigger


def feed(trigger: Trigger, n: int, accepted: int, drafted: int = 10, now: float = 0.0) -> None:
    for _ in range(n):
        trigger.observe(accepted, drafted, now)


def test_continuous_is_always_active_and_never_starts_sessions():
    t = Trigger(TriggerConfig(kind="continuous"), now=0.0)
    assert t.active(0.0) and t.poll(0.0) is None
    t.request(1.0)  # a retrain request: gate and publish now, once; still no session
    reason = t.poll(1.0)
    assert reason and reason.startswith(Trigger.FORCED) and t.active(1.0) and not t.session_over()
    assert t.poll(2.0) is None


def test_threshold_waits_for_min_records_then_fires_once_and_cools_down():
    cfg = TriggerConfig(kind="threshold", acceptance_below=0.3, window=20, min_records=10, session_steps=2, cooldown_s=60)
    t = Trigger(cfg, now=0.0)
    feed(t, 9, accepted=1)  # acceptance 0.1, but only 9 records
    assert t.rolling_acceptance is None and t.poll(1.0) is None and not t.active(1.0)
    feed(t, 1, accepted=1)
    reason = t.poll(2.0)
    assert reason and reason.startswith("threshold: rolling acceptance 0.100 < 0.300")
    assert t.active(2.0) and t.poll(3.0) is None  # not again while the session runs
    t.step_done()
    assert not t.session_over()
    t.step_done()
    assert t.session_over()
    t.end_session(10.0, published=False)
    assert not t.active(10.0)
    assert t.poll(69.0) is None  # cooling down; acceptance is still low
    assert t.poll(70.0) is not None


def test_threshold_does_not_fire_on_healthy_acceptance():
    t = Trigger(TriggerConfig(kind="threshold", acceptance_below=0.3, window=20, min_records=5), now=0.0)
    feed(t, 50, accepted=5)
    assert t.rolling_acceptance == pytest.approx(0.5)
    assert t.poll(100.0) is None and not t.active(100.0)


def test_records_without_drafts_are_ignored():
    t = Trigger(TriggerConfig(kind="threshold", acceptance_below=0.3, min_records=3), now=0.0)
    feed(t, 10, accepted=0, drafted=0)
    assert t.rolling_acceptance is None and t.poll(1.0) is None


def test_drift_fires_on_a_drop_not_on_a_steady_stream():
    cfg = TriggerConfig(kind="threshold", drift_above=0.2, window=10, min_records=10, cooldown_s=0)
    t = Trigger(cfg, now=0.0)
    feed(t, 40, accepted=6)  # steady 0.6
    assert t.drift_score == 0.0 and t.poll(1.0) is None
    feed(t, 4, accepted=2)  # window: 6 x 0.6 + 4 x 0.2 = 0.44, drift (0.6 - 0.44) / 0.6 = 0.27
    assert t.drift_score == pytest.approx((0.6 - 0.44) / 0.6)
    reason = t.poll(2.0)
    assert reason and reason.startswith("drift: score 0.267 > 0.200")
    t.end_session(3.0, published=True)  # a publish resets the reference and the window
    assert t.drift_score == 0.0 and t.rolling_acceptance is None
    feed(t, 10, accepted=4)  # the new normal: 0.4, no drift against itself
    assert t.poll(4.0) is None


def test_schedule_fires_every_period_and_not_before():
    t = Trigger(TriggerConfig(kind="schedule", every_s=100, session_steps=1), now=0.0)
    assert t.poll(99.9) is None
    assert t.poll(100.0) == "schedule: every 100 s"
    t.step_done()
    t.end_session(120.0, published=True)
    assert t.poll(219.0) is None and t.poll(220.0) is not None


def test_manual_fires_only_on_request_and_any_kind_honours_requests():
    t = Trigger(TriggerConfig(kind="manual"), now=0.0)
    feed(t, 100, accepted=0)
    assert t.poll(1e6) is None and not t.active(1e6)
    t.request(5.0)
    assert t.poll(5.0) == "manual: retrain requested" and t.active(5.0)
    s = Trigger(TriggerConfig(kind="schedule", every_s=1000), now=0.0)
    s.request(1.0)
    assert s.poll(1.0) == "manual: retrain requested"


def test_threshold_needs_a_condition():
    with pytest.raises(DviError, match="at least one set"):
        TriggerConfig(kind="threshold")
    with pytest.raises(DviError, match="trigger.kind"):
        TriggerConfig(kind="sometimes")


def test_a_trainer_whose_candidates_keep_losing_claims_less_of_serving_s_time_until_something_changes():
    claim = Claim(floor=0.25)
    w = Claim.WINDOW
    assert claim.value == 1.0 and claim.acceptance is None
    assert not any(claim.observe(40, 100) for _ in range(w))  # nothing refused: nothing to drift from
    assert claim.acceptance == 0.4
    claim.refusal()
    assert claim.value == 0.5 and claim.acceptance_at == 0.4
    claim.refusal()
    claim.refusal()
    assert claim.value == 0.25 and claim.refused == 3  # halved per refusal in a row, down to the floor
    assert not claim.observe(3, 0)  # a record that drafted nothing says nothing
    drops = [claim.observe(30, 100) for _ in range(w)]  # the traffic moves: 0.4 -> 0.3 over the window
    first = drops.index(True)  # once the window's acceptance is a fifth below 0.4 (under 0.32), and not before
    assert claim.acceptance == 0.3 and (40 * (w - first - 1) + 30 * (first + 1)) / (100 * w) < 0.32
    assert (40 * (w - first) + 30 * first) / (100 * w) >= 0.32 and not any(drops[:first])
    claim.restore()
    assert claim.value == 1.0 and not claim.observe(1, 100)
    # refused before the window was full: the first figure after it stands for the one at the refusal
    fresh = Claim(floor=0.25)
    fresh.refusal()
    assert fresh.acceptance_at is None and not any(fresh.observe(50, 100) for _ in range(w))
    assert fresh.acceptance_at == 0.5 and not fresh.observe(45, 100)
    assert Claim(floor=1.0).value == 1.0 and Claim(floor=0.0).value == 1.0
    never = Claim(floor=1.0)
    never.refusal()
    assert never.value == 1.0  # pause_share_min at pause_share: no lower claim
