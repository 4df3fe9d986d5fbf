"""Speculation only where it pays: the engine-wide K schedule (`dvi.planner.StepPlanner`), the step costs it plans with
(`CostTable.observe_step`), the per-request routing of dvi's engine, and what `auto` settles to (`dvi.hardware`)."""

from __future__ import annotations

import random

import pytest

from dvi import hardware
from dvi.config import SpecConfig
from dvi.engine_api import TimedSteps
from dvi.planner import CostTable, KController, StepPlanner
from dvi.speculative import expected_tokens_per_round, ideal_speedup

SPEC = SpecConfig(k=4, k_min=1, k_max=6, probe_every=8, min_speedup=1.0)


def measured_costs(step_s: float = 0.1, draft_s: float = 0.02, slope: float = 0.05, batches=(1, 8)) -> CostTable:
    """A cost table as vLLM's steps fill it: K = 0 steps (with a proposer pass of 5 ms), then steps at every K."""
    costs = CostTable(SPEC)
    for b in batches:
        for _ in range(3):
            costs.observe_step(b, 0, 0, step_s + 0.005, 0.005)
        for k in range(1, SPEC.k_max + 1):
            costs.observe_step(b, k, k, step_s * (1 + slope * k) + 0.005 + k * draft_s, 0.005 + k * draft_s)
    return costs


def planner_of(spec: SpecConfig, max_batch: int, costs: CostTable, **kw) -> StepPlanner:
    """A planner past its first steps, which draft nothing to measure plain decoding (the calibration test's subject)."""
    planner = StepPlanner(spec, max_batch, costs, **kw)
    if costs.spec.cost_ratio is None:  # measured_costs() timed three plain steps at batch sizes 1 and 8
        assert all(costs.samples[("verify", (b, 0))] >= StepPlanner.CALIBRATE_SAMPLES for b, _ in costs.verify)
    return planner


def test_a_step_splits_into_verify_and_draft_costs_around_the_proposer_pass_every_step_pays():
    costs = CostTable(SPEC)
    costs.observe_step(1, 0, 0, step_s=0.105, propose_s=0.005)  # drafting nothing: the proposer's pass is part of a step
    assert costs.propose0[1] == pytest.approx(0.005) and costs.verify[(1, 0)] == pytest.approx(0.105)
    costs.observe_step(1, 3, 3, step_s=0.2, propose_s=0.065)  # verified 3, proposed 3 drafts for 60 ms beyond the pass
    assert costs.verify[(1, 3)] == pytest.approx(0.2 - 0.065 + 0.005)
    assert costs.draft[1] == pytest.approx(0.02)
    c, v = costs.plan(1)
    assert c == pytest.approx(0.02 / 0.105) and v[3] == pytest.approx(0.14 / 0.105) and v[0] == 1.0


def test_the_realized_speedups_noise_is_the_standard_error_of_its_average_and_a_new_drafter_starts_without_it():
    costs = CostTable(SPEC)
    for _ in range(20):
        costs.observe_rate(1, False, 1, 0.1)  # plain decoding: 10 tokens a second
    for i in range(300):
        costs.observe_rate(1, True, 1 + i % 3, 0.1)  # drafting: 10, 20 and 30 in turn (variance 200 / 3)
    w = CostTable.RATE_WEIGHT
    assert costs.realized_speedup(1) == pytest.approx(2.0, rel=0.05)
    assert costs.realized_noise(1) == pytest.approx((200 / 3 * w / (2 - w)) ** 0.5 / 10, rel=0.15)
    costs.forget_drafting_rates()
    assert costs.realized_speedup(1) is None and costs.realized_noise(1) == 0.0


def test_a_step_that_stalls_does_not_move_the_costs_and_a_lasting_change_does():
    """Each cost is the median of its last observations: one drafter step that stalled for 80 ms among steady ones of
    2 ms leaves the plan as it was (a moving average of weight 0.2 put it at 0.18 target steps from 0.02); a
    change that lasts is followed within half the window."""
    costs = CostTable(SPEC)
    for _ in range(8):
        costs.observe_step(1, 0, 0, step_s=0.1, propose_s=0.0)
        costs.observe_step(1, 4, 4, step_s=0.12 + 4 * 0.002, propose_s=4 * 0.002)
    c = costs.plan(1)[0]
    assert c == pytest.approx(0.02)
    costs.observe_step(1, 4, 4, step_s=0.12 + 4 * 0.08, propose_s=4 * 0.08)  # one step's drafter stalls
    costs.observe_step(1, 0, 0, step_s=0.4, propose_s=0.0)  # and one plain step
    assert costs.plan(1)[0] == pytest.approx(c) and costs.plan(1)[1][4] == pytest.approx(0.12 / 0.1)
    for _ in range(CostTable.WINDOW // 2 + 1):  # the drafter is slower for good
        costs.observe_step(1, 4, 4, step_s=0.12 + 4 * 0.004, propose_s=4 * 0.004)
    assert costs.plan(1)[0] == pytest.approx(0.04)


def test_a_fresh_drafter_drafts_k_until_its_rounds_are_seen():
    planner = planner_of(SPEC, 8, measured_costs())
    lookup, changes = planner.schedule(1)
    assert lookup == [0] + [SPEC.k] * 8 and changes == []


def test_plain_decoding_is_measured_at_each_batch_size_before_anything_is_planned_there():
    """Every prediction is in units of a step of plain decoding at the batch's size: at a bucket with fewer than
    CALIBRATE_SAMPLES plain steps timed, steps draft nothing (one calibrate decision per bucket; at most twice as many
    tries, where steps that prefill are not timed); then a fresh drafter drafts serve.spec.k; and while drafting is on,
    one step in RECALIBRATE_EVERY drafts nothing again."""
    costs = CostTable(SPEC)
    planner = StepPlanner(SPEC, 8, costs)
    lookup, changes = planner.schedule(1)
    assert lookup == [0] * 9 and [c.decision for c in changes] == ["calibrate"]
    for _ in range(StepPlanner.CALIBRATE_SAMPLES - 1):
        assert planner.schedule(1) == ([0] * 9, [])  # said once
        costs.observe_step(1, 0, 0, step_s=0.1, propose_s=0.004)  # the step after it verified nothing: timed
    assert planner.schedule(1) == ([0] * 9, [])
    costs.observe_step(1, 0, 0, step_s=0.1, propose_s=0.004)
    lookups = [planner.schedule(1)[0] for _ in range(3 * StepPlanner.RECALIBRATE_EVERY)]
    plain = [i for i, lookup in enumerate(lookups) if lookup == [0] * 9]
    assert all(lookup == [0] + [SPEC.k] * 8 for i, lookup in enumerate(lookups) if i not in plain)
    assert len(plain) == 3 and plain[1] - plain[0] == plain[2] - plain[1] == StepPlanner.RECALIBRATE_EVERY
    # batch 8, another bucket: measured on its own, and where no plain step can be timed, drafting resumes after 6 tries
    lookup, changes = planner.schedule(8)
    assert lookup == [0] * 9 and [(c.decision, c.batch) for c in changes] == [("calibrate", 8)]
    assert [planner.schedule(8)[0][8] for _ in range(2 * StepPlanner.CALIBRATE_SAMPLES)] == [0] * 5 + [SPEC.k]

def test_a_drafter_that_stays_off_sleeps_twice_as_long_each_time_and_a_new_one_starts_over():
    planner = planner_of(SPEC, 8, measured_costs())
    sleeps = []
    for _ in range(5):
        while planner.awake:  # measuring: the probes' rounds are all rejected
            lookup, changes = planner.schedule(1)
            if lookup[1]:
                planner.observe(lookup[1], 0)
        sleeps.append(planner.sleep_left)
        while not planner.awake:
            planner.schedule(1)
    assert sleeps == [128, 256, 512, 1024, 2048] == [min(StepPlanner.SLEEP_STEPS << i, StepPlanner.SLEEP_MAX) for i in range(5)]
    planner.reset()  # a new drafter: found again soon if it pays
    assert planner.sleep_steps == StepPlanner.SLEEP_STEPS


def test_drafting_goes_off_where_it_cannot_pay_measures_again_then_puts_the_drafters_pass_to_sleep():
    planner = planner_of(SPEC, 8, measured_costs())
    for _ in range(300):  # a drafter the target never agrees with
        planner.observe(4, 0)
    lookup, changes = planner.schedule(1)
    assert lookup == [0] * 9
    # off at every batch size, and measured well enough: the drafter's pass is put to sleep at once
    assert [(c.decision, c.batch, c.k) for c in changes] == [("off", b, 0) for b in range(1, 9)] + [("sleep", 1, 0)]
    assert "<= 1.00" in changes[0].why and "measured" in changes[0].why
    assert not planner.awake and planner.sleep_left == StepPlanner.SLEEP_STEPS
    asleep = [planner.schedule(1) for _ in range(StepPlanner.SLEEP_STEPS - 1)]
    assert all(lookup == [0] * 9 and not changes for lookup, changes in asleep) and not planner.awake
    lookup, changes = planner.schedule(1)
    assert planner.awake and changes[0].decision == "wake" and planner.measured_awake == 0
    # awake again, off everywhere: probes at K = serve.spec.k, FAST_PROBES times as often (here every step), until
    # WAKE_TOKENS are measured
    probes = [lookup] if lookup[1] else []
    planner.observe(lookup[1], 0)
    while planner.awake:
        lookup, changes = planner.schedule(1)
        if lookup[1]:
            assert lookup == [0] + [SPEC.k] * 8 and changes[-1].decision == "probe"
            probes.append(lookup)
            planner.observe(SPEC.k, 0)  # the probe's round, on a request with a whole drafter cache
    assert len(probes) * SPEC.k >= StepPlanner.WAKE_TOKENS > (len(probes) - 1) * SPEC.k
    assert changes[-1].decision == "sleep"
    spec = SpecConfig(k=4, k_min=1, k_max=6, probe_every=32)
    planner = planner_of(spec, 8, measured_costs())
    for _ in range(5):
        planner.observe(4, 0)
    assert planner.schedule(1)[0] == [0] * 9 and planner.awake  # 20 tokens measured: awake, measuring
    assert not any(planner.schedule(1, whole=0)[0][1] for _ in range(16))  # no request with a whole cache: no probe
    assert any(planner.schedule(1)[0][1] for _ in range(spec.probe_every // StepPlanner.FAST_PROBES))


def test_where_drafting_pays_at_other_batch_sizes_a_probe_drafts_the_cheapest_k_now_and_then():
    costs = CostTable(SPEC)
    for _ in range(3):
        costs.observe_step(1, 0, 0, 0.1, 0.0)
        costs.observe_step(8, 0, 0, 0.1, 0.0)
    for k in range(1, SPEC.k_max + 1):
        costs.observe_step(1, k, k, 0.1 + k * 0.002, k * 0.002)  # drafting is nearly free at batch 1 ...
        costs.observe_step(8, k, k, 0.1 + k * 0.1, k * 0.08)  # ... and dear at batch 8
    planner = planner_of(SPEC, 8, costs)
    for _ in range(300):
        planner.observe(4, 1)
    lookup, _ = planner.schedule(8)
    assert lookup[1] > 0 and lookup[8] == 0
    seen = [planner.schedule(8) for _ in range(2 * SPEC.probe_every)]
    probes = [(lookup, changes) for lookup, changes in seen if lookup[8]]
    assert len(probes) == 2 and planner.awake  # drafting pays somewhere: the pass stays awake
    c, v = costs.plan(8)
    cheapest = min(range(1, SPEC.k_max + 1), key=lambda k: k * c + v[k])
    assert probes[0][0] == [0] + [cheapest] * 8 and probes[0][1][-1].decision == "probe"
    assert planner.planned[8] == 0  # what is planned, the probe aside


def test_a_drafter_the_target_agrees_with_drafts_the_k_with_the_best_predicted_speedup():
    costs = measured_costs()
    planner = planner_of(SPEC, 8, costs)
    for _ in range(300):
        planner.observe(4, 4)
    lookup, changes = planner.schedule(8)
    a = planner.acceptance_by_position()
    for b in (1, 8):
        c, v = costs.plan(b)
        best = max(range(1, SPEC.k_max + 1), key=lambda k: ideal_speedup(a, k, c, v[k]))
        assert lookup[b] == best > 1
    assert changes == []  # it was on already


def test_a_bursty_drafter_is_planned_from_its_acceptance_at_each_position():
    # half the rounds accept all 4 drafts, half none: one rate over all positions (4 of 5 tests pass) predicts 3.36
    # tokens a round at K = 4 where the rounds give 3, and 1.8 at K = 1 where they would give 1.5; by position (0.5,
    # then 1, 1, 1) the plan predicts what the rounds give
    costs = CostTable(SpecConfig(cost_ratio=0.1, verify_slope=0.1, k_min=1, k_max=6, k=4))
    planner = planner_of(SPEC, 1, costs)
    for _ in range(200):
        planner.observe(4, 4)
        planner.observe(4, 0)
    by_position = planner.acceptance_by_position()
    assert by_position[0] == pytest.approx(0.5, abs=0.03) and all(a > 0.95 for a in by_position[1:4])
    assert planner.acceptance() == pytest.approx(0.8, abs=0.01)
    assert expected_tokens_per_round(by_position, 4) == pytest.approx(3.0, abs=0.1)  # decayed: the last round weighs most
    assert expected_tokens_per_round(by_position, 1) == pytest.approx(1.5, abs=0.03)
    assert expected_tokens_per_round(planner.acceptance(), 4) > 3.3 and expected_tokens_per_round(planner.acceptance(), 1) > 1.75
    lookup, _ = planner.schedule(1)
    assert lookup[1] == SPEC.k_max  # untested positions 5 and 6 take position 4's rate


def test_drafting_that_went_off_comes_back_only_with_a_margin():
    costs = CostTable(SpecConfig(cost_ratio=0.2, verify_slope=0.1, k_min=1, k_max=6, k=4))  # fixed costs: c 0.2, v 1 + 0.1 k
    planner = planner_of(SPEC, 1, costs)
    for _ in range(300):
        planner.observe(1, 0)
    assert planner.schedule(1)[0][1] == 0
    # at a = 0.33, K = 1 predicts (1 + a) / (0.2 + 1.1) = 1.02: past 1.0 but not the 5% margin
    planner.by_position = ([33.0] + [0.0] * 5, [100.0] + [0.0] * 5)
    assert 1.0 < ideal_speedup(planner.acceptance_by_position(), 1, 0.2, 1.1) < 1.05
    lookup, changes = planner.schedule(1)
    assert lookup[1] in (0, SPEC.k) and not [c for c in changes if c.decision == "on"]  # off (or a probe at K)
    assert planner.planned[1] == 0
    planner.by_position = ([60.0] + [0.0] * 5, [100.0] + [0.0] * 5)
    lookup, changes = planner.schedule(1)
    assert lookup[1] > 0 and "on" in [c.decision for c in changes]


def test_drafting_that_went_off_comes_back_only_on_what_the_rounds_show_not_on_the_prior():
    """Off, a few probes that accept nothing are no evidence that drafting pays: on vLLM's server with a cheap drafter
    (a step 0.02 of a plain one, a verify of K=1 costing 1.0-1.1) the estimate shrunk towards the prior (0.5) stayed at
    0.11 on 15 rounds and predicted 1.05-1.07x at K=1, and drafting went on and off every few seconds. Turning it on
    rests on the acceptance the rounds show."""
    planner = planner_of(SPEC, 8, measured_costs(draft_s=0.002, slope=0.001))
    planner.on = [False] * 9  # off everywhere, as after the first steps of a drafter that accepts nothing
    planner.by_position = ([0.0] * 6, [15.0] + [0.0] * 5)  # ... seen on 15 probe rounds since
    planner.accepted, planner.trials = 0.0, 15.0
    assert planner.acceptance() == pytest.approx(2 / 19)  # the prior's pull
    k, speedup, _ = planner.plan(1)
    assert speedup > 1.05  # on the prior's estimate, drafting would go on again
    k, shown, why = planner.plan(1, proven=True)
    assert shown < 1.0 and "shown" in why
    decisions = [c.decision for _ in range(200) for c in planner.schedule(1)[1]]
    assert "on" not in decisions, decisions
    planner.by_position = ([9.0] + [0.0] * 5, [15.0] + [0.0] * 5)  # 9 of 15 accepted: shown, it pays
    planner.accepted, planner.trials = 9.0, 15.0
    planner.awake, planner.sleep_left = True, 0
    assert "on" in [c.decision for c in planner.schedule(1)[1]]


def test_a_drafter_on_trial_is_probed_at_k_often_until_its_window_is_drafted():
    spec = SpecConfig(k=4, k_min=1, k_max=6, probe_every=32)
    planner = planner_of(spec, 8, measured_costs(), trial_tokens=200)
    for _ in range(300):
        planner.observe(4, 0)
    planner.reset()  # a new drafter: on trial
    assert planner.trials == 0 and planner.trial_left == 200
    for _ in range(25):
        planner.drafted(4)  # its first rounds: every one counts for the judge's window ...
        planner.observe(4, 0)  # ... those with a whole cache for its acceptance too
    assert planner.trial_left == 100 and planner.schedule(1)[0][1] == 0
    every = spec.probe_every // StepPlanner.FAST_PROBES
    probes = [lookup for lookup, changes in (planner.schedule(1, whole=0) for _ in range(4 * every)) if lookup[1]]
    assert len(probes) == 4 and all(p[1] == spec.k for p in probes)  # on trial, probed with or without a whole cache
    for _ in range(25):
        planner.drafted(4)  # its window drafted: the trial is over
    assert planner.trial_left == 0 and planner.awake


def test_a_request_of_dvis_engine_routes_itself_and_says_so():
    ctrl = KController(SPEC)
    costs = measured_costs()
    c, v = costs.plan(1)
    assert ctrl.next_k(0, c, v, True) == SPEC.k and ctrl.routed is None  # no round seen yet
    for _ in range(40):
        ctrl.observe(4, 0)
    assert ctrl.next_k(10, c, v, True) == 0 and ctrl.routed.decision == "off"
    assert ctrl.next_k(11, c, v, True) == 0 and ctrl.routed is None
    assert ctrl.next_k(10 + SPEC.probe_every, c, v, True) > 0 and ctrl.routed.decision == "probe"
    for _ in range(40):
        ctrl.observe(4, 4)
    assert ctrl.next_k(60, c, v, True) > 0 and ctrl.routed.decision == "on"


def test_auto_dtype_is_bf16_only_where_the_hardware_has_it(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_bf16_flags", lambda: ())
    assert hardware.pick_dtype("auto", "cpu").value == "float32"
    assert "no native bf16" in hardware.pick_dtype("auto", "cpu").why
    assert hardware.pick_dtype("auto", "cuda").value == "bfloat16"
    assert hardware.pick_dtype("float16", "cpu") == hardware.Pick("float16", "model.dtype")
    monkeypatch.setattr(hardware, "cpu_bf16_flags", lambda: ("amx_bf16",))
    assert hardware.pick_dtype("auto", "cpu") == hardware.Pick("bfloat16", "auto: this CPU has native bf16 (amx_bf16)")


def test_the_cpu_flags_are_read_from_the_first_flags_line(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    real = hardware.Path
    monkeypatch.setattr(hardware, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real(p))
    hardware.cpu_bf16_flags.cache_clear()
    try:
        assert hardware.cpu_bf16_flags() == ("avx512_bf16",)
    finally:
        hardware.cpu_bf16_flags.cache_clear()


def test_auto_engine_is_vllm_only_at_the_release_dvi_reads(monkeypatch):
    monkeypatch.setattr(hardware, "vllm_version", lambda: None)
    assert hardware.pick_engine("auto").value == "dvi" and "not installed" in hardware.pick_engine("auto").why
    monkeypatch.setattr(hardware, "vllm_version", lambda: "0.33.1")
    assert hardware.pick_engine("auto").value == "dvi" and "0.33.1" in hardware.pick_engine("auto").why
    monkeypatch.setattr(hardware, "vllm_version", lambda: hardware.VLLM_RELEASE + ".0")
    assert hardware.pick_engine("auto").value == "vllm-server"  # vLLM's own server, dvi's loop as its plugin
    assert hardware.pick_engine("dvi") == hardware.Pick("dvi", "serve.engine")
    assert hardware.pick_engine("vllm-server") == hardware.Pick("vllm-server", "serve.engine")  # named: as named, installed or not


def test_drafting_stays_on_only_while_the_steps_that_draft_yield_more_tokens_per_second():
    """The cost model can be wrong (noisy per-K costs at a large batch): once a bucket has RATE_SAMPLES drafting steps
    and PLAIN_RATE_SAMPLES plain ones, drafting there goes off when the drafting steps' tokens per second do not beat plain decoding's, whatever
    the model predicts, and the drafter's pass is skipped there; a new drafter starts over."""
    costs = measured_costs()
    planner = planner_of(SPEC, 8, costs)
    for _ in range(300):  # a drafter the model says pays: every draft accepted
        planner.observe(4, 4)
    assert planner.schedule(8)[0][8] > 0
    for _ in range(CostTable.RATE_SAMPLES):
        costs.observe_rate(8, False, tokens=8, seconds=0.10)  # plain steps: 80 tokens/s
        costs.observe_rate(8, True, tokens=20, seconds=0.30)  # drafting steps: 66.7 tokens/s
    assert costs.realized_speedup(8) == pytest.approx(20 / 0.30 / 80) and costs.realized_speedup(1) is None
    lookup, changes = planner.schedule(8)
    assert lookup[8] == 0 and lookup[1] > 0  # off where it was measured not to pay, on where it was not measured
    off = [c for c in changes if c.decision == "off"]
    assert {c.batch for c in off} == {5, 6, 7, 8} and "realized speedup 0.83" in off[0].why
    # only a new drafter turns it back on there: the drafter's pass at K = 0 is skipped at those batch sizes alone
    assert planner.awake and planner.skips_pass(8, lookup) and not planner.skips_pass(1, lookup)
    assert not planner.skips_pass(8, [0] + [SPEC.k] * 8)  # a step that drafts (a probe) runs it
    planner.reset()  # a new drafter: its yield is its own
    assert costs.realized_speedup(8) is None and not planner.skips_pass(8, lookup)


def test_drafting_is_weighed_against_target_only_decoding_without_the_drafters_pass():
    """A plain step's rate leaves out the drafter's time in it (`observe_step`'s return): where the realized gate turns
    drafting off, the pass is skipped too, so drafting that beats plain decoding only while plain decoding pays for the
    pass does not pay."""
    costs = measured_costs()  # plain decoding: 0.1 s a step, and a pass of 5 ms at K = 0
    assert costs.observe_step(1, 0, 0, step_s=0.105, propose_s=0.005) == pytest.approx(0.005)  # the pass
    assert costs.observe_step(1, 0, 3, step_s=0.165, propose_s=0.065) == pytest.approx(0.065)  # and drafts for the next
    assert costs.observe_step(1, 3, 3, step_s=0.2, propose_s=0.065) == 0.0  # a step that verified drafts: all drafting's
    planner = planner_of(SPEC, 8, costs)
    for _ in range(300):  # the model says drafting pays
        planner.observe(4, 4)
    for _ in range(CostTable.RATE_SAMPLES):
        costs.observe_rate(1, False, 1, 0.105 - costs.observe_step(1, 0, 0, step_s=0.105, propose_s=0.005))
        costs.observe_rate(1, True, tokens=2, seconds=0.205)  # 9.76 tokens/s: 1.02x a plain step with its pass
    assert costs.realized_speedup(1) == pytest.approx(2 / 0.205 / 10.0)  # 0.976x target-only decoding
    lookup, changes = planner.schedule(1)
    assert lookup[1] == 0 and planner.skips_pass(1, lookup)
    assert any(c.decision == "off" and c.batch == 1 and "realized speedup 0.98 <= 1.00" in c.why for c in changes)
    # off on what the steps yielded, it comes back on only with a margin (probes keep the drafting steps' yield current)
    for _ in range(100):
        costs.observe_rate(1, True, tokens=2, seconds=2 / 10.3)  # 1.03x target-only decoding
    assert planner.schedule(1)[0][1] == 0 and planner.skips_pass(1, [0] * 9)
    for _ in range(100):
        costs.observe_rate(1, True, tokens=2, seconds=2 / 10.7)  # 1.07x
    lookup, changes = planner.schedule(1)
    # on again at batch 1 (off there, it was off at every size: the drafter's pass slept, and wakes)
    assert lookup[1] > 0 and [c.decision for c in changes if c.batch == 1] == ["on", "wake"]


def test_drafts_a_plain_step_proposed_are_paid_by_the_step_that_verifies_them():
    """A probe proposes its drafts in a step that verifies none, whose rate is target-only decoding's (no drafter's
    time in it): the drafts' seconds beyond the pass go to the step that verifies them, once."""
    costs = CostTable(SPEC)
    costs.observe_step(1, 0, 0, step_s=0.105, propose_s=0.005)  # a plain step: the drafter's pass, 5 ms
    extra = costs.observe_step(1, 0, 4, step_s=0.145, propose_s=0.045)  # a probe: 4 drafts, 40 ms beyond the pass
    assert extra == pytest.approx(0.045)
    costs.observe_rate(1, False, tokens=1, seconds=0.145 - extra)
    assert costs.rate[(1, False)] == pytest.approx(10.0)  # target-only decoding: 10 tokens/s
    assert costs.observe_step(1, 4, 0, step_s=0.11, propose_s=0.005) == 0.0  # the step that verifies them
    costs.observe_rate(1, True, tokens=2, seconds=0.11)
    assert costs.rate[(1, True)] == pytest.approx(2 / 0.15)  # with the probe's drafts: 13.3 tokens/s, not 18.2
    costs.observe_rate(1, True, tokens=2, seconds=0.11)  # drafts a drafting step proposed are in its own seconds
    assert costs.rate[(1, True)] == pytest.approx((2 / 0.15 + 2 / 0.11) / 2)
    costs.observe_step(1, 0, 4, step_s=0.145, propose_s=0.045)
    costs.observe_step(1, 0, 0, step_s=0.105, propose_s=0.005)  # the drafts went unverified (their request left)
    assert costs.owed == 0.0


def test_speed_over_target_only_is_the_drafting_steps_yield_over_plain_decodings_at_each_batch_size():
    """Where drafting steps have been measured RATE_SAMPLES times: their tokens per second over plain decoding's, from
    plain steps where PLAIN_RATE_SAMPLES ran, else from the measured plain step time (a row's token per step)."""
    costs = CostTable(SpecConfig())
    costs.observe_verify(1, 0, 0.05)  # a plain step at batch 1: 20 tokens/s
    for _ in range(CostTable.RATE_SAMPLES - 1):
        costs.observe_rate(1, True, tokens=3, seconds=0.1)  # drafting at batch 1: 30 tokens/s
        costs.observe_rate(8, True, tokens=16, seconds=0.2)  # drafting at batch 8: 80 tokens/s
    assert costs.speed_vs_target_only() == {}  # too few drafting steps to say
    costs.observe_rate(1, True, tokens=3, seconds=0.1)
    costs.observe_rate(8, True, tokens=16, seconds=0.2)
    assert costs.speed_vs_target_only() == {1: pytest.approx(1.5)}  # batch 8: no target-only figure yet
    for _ in range(CostTable.PLAIN_RATE_SAMPLES):
        costs.observe_rate(8, False, tokens=8, seconds=0.08)  # plain at batch 8: 100 tokens/s
    assert costs.speed_vs_target_only() == {1: pytest.approx(1.5), 8: pytest.approx(0.8)}


def test_a_requests_target_only_tokens_are_its_share_of_the_measured_plain_rate_at_its_batch_size():
    costs = CostTable(SPEC)
    assert costs.target_only_tokens(1, 1.0) is None  # nothing measured: nothing to compare with
    costs.observe_verify(1, 0, 0.05)  # a start-up plain step at batch 1: 20 tokens a second
    assert costs.target_only_tokens(1, 0.5) == pytest.approx(10.0)
    for _ in range(CostTable.PLAIN_RATE_SAMPLES):
        costs.observe_rate(8, False, 8, 0.2)  # live plain steps at batch 8: 40 tokens a second, 5 for each request
    assert costs.target_only_tokens(8, 1.0) == pytest.approx(5.0)
    assert costs.target_only_tokens(5, 1.0) == pytest.approx(5.0)  # batch 5, bucket 8: one token a request a plain step
    assert costs.target_only_tokens(4, 1.0) is None  # another bucket, unmeasured
    timed = TimedSteps()
    timed.add(3, None)  # a step at an unmeasured batch size says nothing
    timed.add(6, costs.target_only_tokens(8, 1.0))
    assert (timed.timed_tokens, timed.target_only_tokens) == (6, pytest.approx(5.0))


def simulate(acceptance: float, batch: int, steps: int = 3000, draft_s: float = 0.1, pass_s: float = 0.05,
             slope: float = 0.04, seed: int = 0, request_tokens: int = 128, stalls: float = 0.0) -> tuple[float, dict[str, int]]:
    """vLLM's steps under a StepPlanner on the default spec, one plain step taking 1 s (10% noise): a step verifies the
    drafts the one before proposed (each accepted with probability `acceptance`, in order, for each of `batch` requests;
    a verify of K + 1 tokens costs 1 + slope x K x batch), then proposes the K planned, paying the drafter's pass
    (`pass_s`) unless skipped and `draft_s` per draft. As `dvi.cli.vllm.engine` keeps them: a request's drafter cache
    is whole until a step skips the pass, and only whole requests' rounds are measured; a request ends after
    `request_tokens` tokens and the next takes its place. A share `stalls` of the steps stalls for as long as a plain
    step, in the proposer (a busy machine's hiccup). Returns (tokens per second over plain decoding's, decisions)."""
    rng = random.Random(seed)
    costs = CostTable(SpecConfig())
    planner = StepPlanner(SpecConfig(), 8, costs)
    seconds = tokens = 0.0
    decisions: dict[str, int] = {}
    verify_k = 0
    whole, emitted_by = [True] * batch, [0] * batch
    for _ in range(steps):
        lookup, changes = planner.schedule(batch, sum(whole))
        for c in changes:
            decisions[c.decision] = decisions.get(c.decision, 0) + 1
        k, skip = lookup[batch], planner.skips_pass(batch, lookup, sum(whole))
        if skip:
            whole = [False] * batch
        emitted = 0
        for i in range(batch):
            n = 0
            while n < verify_k and rng.random() < acceptance:
                n += 1
            emitted += n + 1
            if verify_k:
                planner.drafted(verify_k)
                if whole[i]:
                    planner.observe(verify_k, n)
            emitted_by[i] += n + 1
            if emitted_by[i] >= request_tokens:  # it ends; the next one is whole until a step skips the pass
                whole[i], emitted_by[i] = True, 0
        propose_s = (0.0 if skip else pass_s) + draft_s * k + (1.0 if rng.random() < stalls else 0.0)
        step_s = (1 + slope * verify_k * batch) * (1 + 0.1 * (rng.random() - 0.5)) + propose_s
        extra = costs.observe_step(batch, verify_k, k, step_s, propose_s)  # as dvi.cli.vllm.engine times it
        costs.observe_rate(batch, verify_k > 0, emitted, step_s - extra)
        seconds, tokens, verify_k = seconds + step_s, tokens + emitted, k
    return tokens / seconds / batch, decisions


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("acceptance", [0.03, 0.1])
def test_a_drafter_that_does_not_pay_costs_the_planners_decisions_under_three_percent(acceptance, batch):
    """Speculation never costs more than its probes: with an untrained drafter (acceptance 0.03) or a weak one (0.1) the
    planner's calibration, probes and sleeps keep decoding within 3% of plain decoding's speed, by the cost model above
    (what the engine's own costs add beyond it, such as a first step at a new shape, it does not model), and it falls
    asleep at both batch sizes: its probes are measured on requests whose drafter cache the pass kept whole (at batch 1
    the realized gate skipped the pass between probes, no probe was ever measured, and it probed every request)."""
    speed, decisions = simulate(acceptance, batch)
    assert speed >= 0.97, (speed, decisions)
    assert decisions.get("sleep", 0) >= 1, decisions  # off everywhere: the drafter's pass is skipped too


def test_a_drafter_that_pays_at_batch_one_keeps_drafting():
    speed, decisions = simulate(0.6, 1)
    assert speed > 1.3 and decisions.get("off", 0) == 0, (speed, decisions)


@pytest.mark.parametrize("seed", range(4))
def test_a_drafter_that_pays_keeps_drafting_through_steps_that_stall(seed):
    """One step in fifty stalls for a plain step's length, in the drafter: costs that are medians leave those steps out,
    and the realized gate turns drafting off only on a yield under the line by more than its noise, so a drafter that
    pays by a fifth stays on (with moving-average costs and the bare gate it went off 16-32 times in 3,000 steps)."""
    speed, decisions = simulate(0.35, 1, draft_s=0.03, pass_s=0.02, stalls=0.02, seed=seed)
    assert decisions.get("off", 0) == 0 and speed > 1.15, (speed, decisions)


def test_drafting_is_on_at_a_batch_size_only_where_it_is_on_at_every_smaller_one():
    """Off at batch 1 on what its steps yielded, drafting stays off at the sizes no step measured, whatever the model
    predicts there from borrowed costs; on at batch 1 and off at batch 2, it is off above too."""
    costs = measured_costs()
    planner = planner_of(SPEC, 8, costs)
    for _ in range(300):  # the model says drafting pays at every size
        planner.observe(4, 4)
    assert all(planner.schedule(1)[0][1:])
    for _ in range(CostTable.RATE_SAMPLES):
        costs.observe_rate(1, False, tokens=1, seconds=0.10)
        costs.observe_rate(1, True, tokens=2, seconds=0.25)  # 0.8x target-only decoding at batch 1
    lookup, changes = planner.schedule(1)
    assert lookup == [0] * 9
    assert [c.why.split(",")[0] for c in changes if c.batch == 2] == ["drafting is off at batch size 1"]
    planner.reset()  # a new drafter: batch 1 unmeasured again
    for _ in range(300):
        planner.observe(4, 4)
    for _ in range(CostTable.RATE_SAMPLES):
        costs.observe_rate(2, False, tokens=2, seconds=0.10)
        costs.observe_rate(2, True, tokens=3, seconds=0.25)  # 0.6x at batch 2
    lookup, _ = planner.schedule(1)
    assert lookup[1] > 0 and lookup[2:] == [0] * 7
