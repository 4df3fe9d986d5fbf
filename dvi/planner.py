"""Where speculation pays: the cost model measured on this machine and the policies that choose K from it.

- `CostTable`: seconds of a verify forward of K + 1 tokens per batch-size bucket and K, of a drafter step, and the
  tokens per second steps that drafted and steps that did not yielded, fed by an engine's warm-up and live steps;
- `KController`: one request's K (dvi's own engine plans each row's K);
- `StepPlanner`: one K per step for a whole batch, per batch size (vLLM's batch-size schedule), with calibration,
  probes, hysteresis, sleep and the realized-speedup gate;
- `Routing`: each decision (drafting on or off at a batch size, a probe, sleep and wake) with its reason, for the log.

The arithmetic (acceptance estimates, expected tokens per round, the best K) is `dvi.speculative`'s; this module keeps
the state and the rules. It does not know how an engine decodes or times its steps.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass

from dvi.config import SpecConfig
from dvi.speculative import (
    acceptance_estimate,
    batch_bucket,
    cheapest_k,
    choose_k_from_costs,
    ideal_speedup,
    linear_verify_costs,
    moving_average,
    moving_variance,
    position_acceptance,
)


class CostTable:
    """Measured costs per batch-size bucket (`dvi.speculative.batch_bucket`): seconds of a verify forward of
    K + 1 tokens per (bucket, K) (K = 0 is a plain decoding step) and of one drafter step per bucket.

    Filled by `SpeculativeEngine.warm_up` at start-up and refreshed from live rounds: each cost is the median of its
    last `WINDOW` observations. A step's parts take about the same time every step, but now and then one stalls for
    tens of milliseconds (on two cores beside `dvi up`'s trainer, broker and MLflow): in a moving average one such
    drafter step moved the cost of a drafter step from 0.05 to 0.4 target steps, and drafting went off and on again
    within seconds, dozens of times in twelve minutes; a median leaves such a step out. `plan(batch)` turns them into
    the cost model's units. A K not measured at a bucket
    borrows its cost in target steps from the nearest bucket that has it, else the linear prior
    (`serve.spec.verify_slope`). With `serve.spec.cost_ratio` set nothing measured is used: c is that number
    and verify costs follow the linear model (a fixed, repeatable cost model).
    """

    WINDOW = 9  # observations each cost is the median of (a server's first and slowest step is one of them)

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.verify: dict[tuple[int, int], float] = {}  # (bucket, K) -> seconds
        self.draft: dict[int, float] = {}  # bucket -> seconds of one drafter step
        self.propose0: dict[int, float] = {}  # bucket -> seconds a step spends in a proposer drafting nothing (observe_step)
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, drafting) -> tokens per second (observe_rate)
        self.plain_step: dict[int, float] = {}  # bucket -> wall seconds of a plain decoding step (observe_rate)
        self.rate_var: dict[tuple[int, bool], float] = {}  # (bucket, True) -> the variance of a drafting step's tokens per second
        self.samples: Counter[tuple[str, object]] = Counter()  # (table, key) -> observations so far
        self._recent: dict[tuple[str, object], deque[float]] = {}  # (table, key) -> a cost's last WINDOW observations
        self.owed = 0.0  # seconds a step that verified no drafts spent proposing drafts for the next (observe_step)

    def _average(self, table: str, key, value: float, weight: float) -> None:
        """A new observation into `table` (rate or plain_step) at `key`: the mean of the first 1 / `weight`, a moving
        average after them."""
        values = getattr(self, table)
        self.samples[(table, key)] += 1
        values[key] = moving_average(values.get(key), value, max(weight, 1.0 / self.samples[(table, key)]))

    def _cost(self, table: str, key, seconds: float) -> None:
        """A new observation into the cost `table` (verify, draft or propose0) at `key`: the median of its last WINDOW."""
        recent = self._recent.setdefault((table, key), deque(maxlen=self.WINDOW))
        recent.append(seconds)
        self.samples[(table, key)] += 1
        getattr(self, table)[key] = statistics.median(recent)

    def observe_verify(self, batch: int, k: int, seconds: float) -> None:
        self._cost("verify", (batch_bucket(batch), k), seconds)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        if steps:
            self._cost("draft", batch_bucket(batch), seconds / steps)

    RATE_WEIGHT = 0.05  # of a new step in the tokens-per-second averages (about the last 20 steps; a step's yield varies)
    RATE_SAMPLES = 16  # drafting steps at a bucket before its realized speedup is trusted (their yield varies) ...
    PLAIN_RATE_SAMPLES = 3  # ... and plain ones (steady: StepPlanner's calibration steps give them)

    def observe_rate(self, batch: int, drafting: bool, tokens: int, seconds: float) -> None:
        """A step of decoding (no prefill) emitted `tokens` in `seconds` of wall time (from its start to the next step's:
        all it cost; for a step that verified no drafts, less the drafter's time in it, `observe_step`'s return),
        verifying drafts or not: tokens per second, by bucket and kind, whatever the cost model says
        (`realized_speedup`). A step that verified drafts also pays for proposing them, where a step that verified
        none did (`observe_step`: `owed`)."""
        if drafting:
            seconds, self.owed = seconds + self.owed, 0.0
        if seconds > 0:
            key, x = (batch_bucket(batch), drafting), tokens / seconds
            if drafting:  # the spread `realized_noise` reads, before the average moves
                self.rate_var[key] = moving_variance(self.rate_var.get(key), self.rate.get(key), x, self.RATE_WEIGHT)
            self._average("rate", key, x, self.RATE_WEIGHT)
            if not drafting:
                self._average("plain_step", batch_bucket(batch), seconds, self.RATE_WEIGHT)

    def realized_speedup(self, batch: int) -> float | None:
        """Tokens per second of steps that verified drafts over those that did not (target-only decoding: no drafter's
        time in them, `observe_step`), at this batch size's bucket, once there are RATE_SAMPLES and PLAIN_RATE_SAMPLES of
        them; None before."""
        b = batch_bucket(batch)
        if self.samples[("rate", (b, True))] < self.RATE_SAMPLES or self.samples[("rate", (b, False))] < self.PLAIN_RATE_SAMPLES:
            return None
        return self.rate[(b, True)] / self.rate[(b, False)]

    def realized_noise(self, batch: int) -> float:
        """The standard error of `realized_speedup` at this batch size's bucket, from the spread of the drafting steps'
        yield (a step's yield varies with what it accepts: the average of about the last 20 steps wanders by several
        percent around what drafting pays); 0 where it is not measured."""
        b = batch_bucket(batch)
        plain, var = self.rate.get((b, False)), self.rate_var.get((b, True))
        if not plain or var is None:
            return 0.0
        w = self.RATE_WEIGHT
        return (var * w / (2 - w)) ** 0.5 / plain

    def target_only_rate(self, bucket: int) -> float | None:
        """Tokens per second of plain decoding at `bucket`: its steps' measured yield once there are
        PLAIN_RATE_SAMPLES, else one token per row per measured plain step (`verify` at K = 0); None unmeasured."""
        if self.samples[("rate", (bucket, False))] >= self.PLAIN_RATE_SAMPLES:
            return self.rate[(bucket, False)]
        step = self.verify.get((bucket, 0))
        return bucket / step if step else None

    def target_only_tokens(self, batch: int, seconds: float) -> float | None:
        """The tokens one request of a batch of `batch` would get from target-only decoding in `seconds`: one a plain step,
        whatever the batch, so `seconds` over a plain step's wall time at the batch's bucket (its live plain steps once
        there are PLAIN_RATE_SAMPLES, else its timed plain step, `verify` at K = 0); None while that is unmeasured. A
        request's speed over target-only decoding is the tokens its timed steps emitted over this, summed over the same
        steps (`Result.target_only_tokens`)."""
        bucket = batch_bucket(batch)
        live = self.samples[("plain_step", bucket)] >= self.PLAIN_RATE_SAMPLES
        step = self.plain_step[bucket] if live else self.verify.get((bucket, 0))
        return seconds / step if step else None

    def speed_vs_target_only(self) -> dict[int, float]:
        """Per batch-size bucket with RATE_SAMPLES drafting steps and a target-only rate (`target_only_rate`): tokens
        per second of drafting steps over target-only decoding's (> 1: speculation pays there)."""
        out = {}
        for (bucket, drafting), rate in list(self.rate.items()):  # a copy: the decoding thread adds to it
            plain = self.target_only_rate(bucket) if drafting and self.samples[("rate", (bucket, True))] >= self.RATE_SAMPLES else None
            if plain:
                out[bucket] = rate / plain
        return dict(sorted(out.items()))

    def forget_drafting_rates(self) -> None:
        """A new drafter: what drafting yielded says nothing of it."""
        for key in [k for k in self.rate if k[1]]:
            del self.rate[key]
            self.rate_var.pop(key, None)
            self.samples.pop(("rate", key), None)

    def observe_step(self, batch: int, verified_k: int, proposed_k: int, step_s: float, propose_s: float) -> float:
        """One step of an engine that verifies and drafts in the same call (vLLM): it verified `verified_k` drafts per
        request in `step_s` seconds, `propose_s` of which went to proposing `proposed_k` drafts for the next step. The
        proposer's time at K = 0 (the drafter's pass over the step's new tokens, paid whatever K is) counts as part of
        every step; what proposing K drafts costs beyond it is K drafter steps.

        Returns the seconds of the step that target-only decoding would not have spent, which its rate leaves out
        (`observe_rate`): for a step that verified no drafts, all of `propose_s` (the drafter's pass, and any drafts for
        the next step, which the next step that verifies drafts pays: `owed`; left out of both, a probe's drafts were
        free, and an untrained drafter's probes measured it over the line again and again: drafting went on and off
        every few seconds); 0 for one that verified drafts (all of it is drafting's cost). Plain decoding's rate is then
        that of a server without a drafter, the one the realized gate weighs drafting against: where that gate turns
        drafting off, the drafter's pass is skipped too (`StepPlanner.skips_pass`), and a plain step that paid for it
        made drafting look up to a tenth better than it was (the pass is several percent of a step at batch 1 on a
        CPU, about a tenth at batch 8)."""
        b = batch_bucket(batch)
        if proposed_k == 0:
            self._cost("propose0", b, propose_s)
        base = self.propose0.get(b, 0.0)
        self.observe_verify(batch, verified_k, max(step_s - propose_s, 0.0) + base)
        if proposed_k:
            self.observe_draft(batch, proposed_k, max(propose_s - base, 0.0))
        if not verified_k:
            self.owed = max(propose_s - base, 0.0) if proposed_k else 0.0
        return 0.0 if verified_k else propose_s

    @property
    def measured(self) -> bool:
        return self.spec.cost_ratio is None and any(k == 0 for _, k in self.verify)

    def _nearest(self, bucket: int, have) -> int | None:
        found = [b for b in {b for b, _ in self.verify} | set(self.draft) if have(b)]
        return min(found, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b)) if found else None

    def plan(self, batch: int) -> tuple[float, list[float]]:
        """(c, [v_0 .. v_Kmax]) at this batch size, in target steps (v_0 = 1)."""
        s = self.spec
        prior = linear_verify_costs(s.verify_slope, s.k_max)
        if not self.measured:
            return (s.cost_ratio if s.cost_ratio is not None else 0.25), prior  # until measured: a small drafter's typical c
        bucket = batch_bucket(batch)
        v = []
        for k in range(s.k_max + 1):
            at = self._nearest(bucket, lambda b, k=k: (b, k) in self.verify and (b, 0) in self.verify)
            # a measured ratio below 1 is noise: verifying K + 1 tokens cannot cost less than verifying one
            v.append(max(1.0, self.verify[(at, k)] / self.verify[(at, 0)]) if at is not None else prior[k])
        draft_at = self._nearest(bucket, lambda b: b in self.draft and (b, 0) in self.verify)
        c = self.draft[draft_at] / self.verify[(draft_at, 0)] if draft_at is not None else 0.25
        return c, v

    # the figures the stats and tests read: one target step, one drafter step, c (at batch 1)
    @property
    def target_step(self) -> float | None:
        at = self._nearest(1, lambda b: (b, 0) in self.verify)
        return self.verify[(at, 0)] if at is not None else None

    @property
    def draft_step(self) -> float | None:
        at = self._nearest(1, lambda b: b in self.draft)
        return self.draft[at] if at is not None else None

    @property
    def ratio(self) -> float:
        return self.plan(1)[0]

    def to_dict(self) -> dict:
        return {"verify_s": {f"b{b}/k{k}": round(t, 6) for (b, k), t in sorted(self.verify.items())},
                "draft_step_s": {f"b{b}": round(t, 6) for b, t in sorted(self.draft.items())}}


@dataclass(frozen=True)
class Routing:
    """A decision about where drafting runs: `on` or `off` at a batch size, or a `probe` step while it is off."""

    decision: str  # on | off | probe; sleep | wake: the drafter's pass at K = 0 skipped or run again; calibrate (StepPlanner)
    batch: int
    k: int  # the K drafted from then on (on), for the probe (probe), 0 (off)
    why: str


class KController:
    """One request's K: fixed, or the K with the best predicted speedup for its measured acceptance and the
    engine's cost table; 0 (plain decoding, probing again every `probe_every` tokens) when no K is predicted
    to beat plain decoding."""

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.accepted = 0.0
        self.trials = 0.0
        self.off_at: int | None = None  # tokens generated when drafting was switched off
        self.routed: Routing | None = None  # the routing decision the last next_k took (on, off, probe), if any

    def acceptance(self) -> float:
        s = self.spec
        return acceptance_estimate(self.accepted, self.trials, s.prior_acceptance, s.prior_weight)

    def next_k(self, generated: int, cost_ratio: float, verify_cost: list[float], measured: bool = False) -> int:
        """verify_cost: [k_max + 1] in target steps; measured: the costs come from this machine's table, and a probe
        drafts the K whose round the table says is cheapest (with assumed costs: k_min).

        A request's first round drafts k whatever the costs say: it is the prompt's prefill, where K more
        positions cost little, and every request then measures the drafter (the live check after a swap and the
        trainer's records need drafted rounds)."""
        s = self.spec
        self.routed = None
        if not s.adaptive or not self.trials:
            return s.k
        a = self.acceptance()
        k = choose_k_from_costs(a, cost_ratio, verify_cost, s.k_min, s.k_max, s.min_speedup)
        why = f"acceptance {a:.3f}, drafter step {cost_ratio:.3f} target steps ({'measured' if measured else 'assumed'})"
        if k:
            if self.off_at is not None:
                self.routed = Routing("on", 0, k, why)
            self.off_at = None
            return k
        if self.off_at is None:
            self.off_at = generated
            self.routed = Routing("off", 0, 0, f"no K beats {s.min_speedup:g}x: {why}")
            return 0
        if generated - self.off_at >= s.probe_every:  # probe: the traffic, or the drafter, may have changed
            self.off_at = generated
            # the cheapest round that drafts, by this machine's table
            k = cheapest_k(cost_ratio, verify_cost, s.k_min, s.k_max) if measured else s.k_min
            self.routed = Routing("probe", 0, k, f"drafting has been off for {s.probe_every} tokens")
            return k
        return 0

    def observe(self, k: int, n: int) -> None:
        if k == 0:
            return
        self.accepted = self.accepted * self.spec.decay + n
        self.trials = self.trials * self.spec.decay + n + (n < k)


class StepPlanner:
    """K for every step of an engine that drafts one K for a whole batch (vLLM's batch-size schedule), the engine-wide
    counterpart of `KController`: from the live acceptance of the serving drafter and the cost table, the K with the
    best predicted speedup at each batch size, 0 (drafting off) where none beats `serve.spec.min_speedup`. Drafting off
    at a batch size comes back on only when the best K is predicted to beat plain decoding by `HYSTERESIS` more on the
    acceptance the rounds seen show (shrunk towards 0, not the prior: a few probes that accept nothing are no evidence
    that drafting pays), so that an estimate hovering at the line does not flip it every few steps. The model is
    checked against what the steps yield: once a bucket has `CostTable.RATE_SAMPLES` steps that drafted and a few that
    did not, drafting stays on there only while its tokens per second beat target-only decoding's, or fall short by no
    more than their noise (plain steps less the drafter's time in them: `CostTable.realized_speedup`, `_unpaid`; at
    batch 8 on a CPU the model, fed with noisy per-K costs, predicted 1.08x where the steps gave 0.85x).

    Acceptance is measured on the rounds of requests whose drafter cache is whole (`observe`; the engine says which),
    position by position (`position_acceptance`: a drafter that is right tends to stay right, which one rate over all
    positions misses, mispredicting what each K returns), decayed over about the last 100 drafting rounds, shrunk to the prior. While the batch about to step has drafting
    off, every `probe_every`-th step is a probe that drafts the cheapest K, so acceptance (which traffic or a new
    drafter may change) keeps being measured.

    Off at every batch size, even the drafter's pass over each step's new tokens (which keeps its cache whole, and
    which an engine pays at K = 0) is a cost: once `WAKE_TOKENS` drafted tokens have been measured since the planner
    last woke and drafting is still off everywhere, it *sleeps* (`awake` False: the engine skips that pass; requests
    then lose their drafter cache) for `SLEEP_STEPS` steps, then wakes to measure again on requests that start awake.
    While awake with drafting off everywhere, and for the first `trial_tokens` drafted tokens of a new drafter (the
    live judge's window after a swap), probes come `FAST_PROBES` times as often and draft `serve.spec.k`.

    No decision is taken on assumed costs. Every prediction is in units of a step of plain decoding at the batch's size
    (a verify of K tokens costs far more, relative to it, at batch 8 than at batch 1 on a CPU), which only a step that
    verifies no drafts measures (the step after one that proposed none). So the first steps at each batch-size bucket
    draft nothing (`calibrate`) until `CALIBRATE_SAMPLES` plain steps there are timed (more than one: a server's first
    decode step is its slowest; at most twice as many tries, where steps that prefill are not plain decoding), and so
    does one step in `RECALIBRATE_EVERY` while drafting is on (off, plain steps come anyway), which keeps the measure
    current for a share of the speedup under 1%.

    A sleep lasts `SLEEP_STEPS` steps, twice as long each time the drafter wakes to find drafting still off everywhere
    (up to `SLEEP_MAX`), and `SLEEP_STEPS` again once drafting is on or a new drafter serves: a drafter that cannot pay
    costs a shrinking share of probes, one that can is found again soon.

    Where drafting is off at a batch size on what its steps yielded (the realized gate above), it comes back on there
    only once the drafting steps' last yield beats target-only decoding's by `HYSTERESIS` more (plain steps keep
    moving the one, probes that a request whose cache is whole can take add to the other), or for a new drafter (whose
    yield is its own); until then that pass is skipped at that batch size alone (`skips_pass`), awake or not, while
    drafting is on at another: at batch 8 on a CPU it cost about a tenth of a plain step. The requests of such a step
    lose their drafter cache, as asleep, so that a frozen drafter stays off there for good unless the plain steps get
    slower. Off everywhere and awake, the planner is measuring the drafter before it sleeps: the pass runs wherever a
    request has a whole cache, or one may be admitted, so that the probes' rounds count (skipped there too, the rows
    lost their caches at every step between probes, and a server with an untrained drafter stayed awake probing for
    half a minute at a time, at 0.8x plain decoding's speed).

    Drafting is on at a batch size only where it is on at every smaller one: a draft gains less the larger the batch
    it is verified in, and sizes traffic does not reach are planned on costs borrowed from a neighbour and on a
    drafter step measured on a few probes, whose noise turned them on and off within a second (at batch 1 an untrained
    drafter was off on what its steps yielded, and batch sizes 2-8 flipped every few seconds, waking the drafter).

    `schedule(batch)` returns the dense K lookup for the next step (index = batch size, as vLLM's scheduler reads it)
    and the routing decisions it took. A fresh drafter (`reset`) drafts `serve.spec.k` until its first rounds are seen.
    """

    HYSTERESIS = 0.05
    NOISE_Z = 2.0  # standard errors the realized speedup must be under its line by to turn drafting off (`_unpaid`)
    CALIBRATE_SAMPLES = 3
    RECALIBRATE_EVERY = 128
    FAST_PROBES = 8
    # every request's rounds feed one estimate, and probes are few: it keeps about the last 100 drafting rounds
    # (serve.spec.decay is a request's own, over its last ten or so; with as few trials the prior would dominate)
    DECAY = 0.99
    WAKE_TOKENS = 32
    SLEEP_STEPS = 128
    SLEEP_MAX = 2048

    def __init__(self, spec: SpecConfig, max_batch: int, costs: CostTable, trial_tokens: int = 0):
        self.spec, self.max_batch, self.costs, self.trial_tokens = spec, max_batch, costs, trial_tokens
        self.accepted = 0.0  # decayed accepted drafts, all positions (the summary `acceptance`)
        self.trials = 0.0  # ... and tested drafts
        self.by_position = ([0.0] * spec.k_max, [0.0] * spec.k_max)  # decayed (accepted, tested) at each draft position
        self.steps_off = 0  # steps since the last one that drafted, at batch sizes with drafting off
        self.on = [True] * (max_batch + 1)  # drafting on at each batch size (index 0 unused)
        self.planned = [spec.k] * (max_batch + 1)  # the last lookup planned, probes aside
        self.trial_left = 0  # drafted tokens before the drafter serving now leaves its trial
        self.awake = True  # False: the engine skips the drafter's pass at K = 0
        self.measured_awake = 0  # drafted tokens measured since the planner last woke
        self.sleep_left = 0  # steps until it wakes
        self.sleep_steps = self.SLEEP_STEPS  # how long the next sleep lasts
        self.calibrations: Counter[int] = Counter()  # steps that drafted nothing to measure plain decoding, by bucket
        self.since_calibrated = 0  # steps since the last one that drafted nothing

    def reset(self) -> None:
        """A new drafter serves: what was measured of the last one says nothing about it; it is on trial."""
        self.accepted = self.trials = 0.0
        self.by_position = ([0.0] * self.spec.k_max, [0.0] * self.spec.k_max)
        self.steps_off = 0
        self.trial_left = self.trial_tokens
        self.measured_awake = 0
        self.sleep_steps = self.SLEEP_STEPS
        self.costs.forget_drafting_rates()

    def drafted(self, k: int) -> None:
        """A round of the serving drafter drafted `k` tokens, its cache whole or not (the judge counts them all)."""
        self.trial_left = max(0, self.trial_left - k)

    def observe(self, k: int, n: int) -> None:
        """A round of a request whose drafter cache is whole: `n` of `k` drafts accepted (k = 0: nothing learnt)."""
        if k == 0:
            return
        self.measured_awake += k
        d = self.DECAY
        self.accepted = self.accepted * d + n
        self.trials = self.trials * d + n + (n < k)
        accepted, tested = self.by_position
        for i in range(len(accepted)):  # draft i + 1 was tested when the i before it were accepted
            accepted[i] = accepted[i] * d + (n > i)
            tested[i] = tested[i] * d + (i < k and n >= i)

    def acceptance(self) -> float:
        """The per-token acceptance over all positions (what logs and tests summarise)."""
        s = self.spec
        return acceptance_estimate(self.accepted, self.trials, s.prior_acceptance, s.prior_weight)

    def acceptance_by_position(self, proven: bool = False) -> list[float]:
        """The acceptance at each draft position given the ones before it were accepted (what K is planned with), shrunk
        towards `serve.spec.prior_acceptance`, or with `proven` towards 0: what the rounds seen show, no more."""
        s = self.spec
        return position_acceptance(*self.by_position, 0.0 if proven else s.prior_acceptance, s.prior_weight)

    def plan(self, batch: int, costs: tuple[float, list[float]] | None = None, proven: bool = False) -> tuple[int, float, str]:
        """(K, predicted speedup, why) at this batch size (`costs`: `self.costs.plan(batch)`), without probing or hysteresis;
        `proven`: on the acceptance the rounds seen show (`acceptance_by_position`)."""
        s = self.spec
        if not self.trials:
            return s.k, 0.0, "no round of this drafter measured yet"
        c, v = costs or self.costs.plan(batch)
        a = self.acceptance_by_position(proven)
        k = choose_k_from_costs(a, c, v, s.k_min, s.k_max, 0.0)
        speedup = ideal_speedup(a, k, c, v[k])
        source = "measured" if self.costs.measured else "assumed"
        by_position = " ".join(f"{x:.2f}" for x in a[:k]) + (" shown" if proven else "")
        return k, speedup, (f"acceptance {self.acceptance():.3f} ({by_position} at positions 1-{k}), drafter step {c:.3f} "
                            f"and verify of K={k} {v[k]:.3f} target steps ({source})")

    def schedule(self, batch: int, whole: int | None = None) -> tuple[list[int], list[Routing]]:
        """The K lookup for the next step, the batch about to step having `batch` requests, `whole` of them with a whole
        drafter cache (None: all), and the decisions taken. A probe needs a request to measure on: with none whole,
        only a drafter on trial is probed (the judge counts every round of it)."""
        lookup = [0] * (self.max_batch + 1)
        changes: list[Routing] = []
        b = self._size(batch)
        if self._calibrating(batch, b, changes):
            return lookup, changes
        by_bucket = self._route(lookup, changes)
        self.planned = lookup
        if not lookup[b]:
            self.since_calibrated = 0  # this step drafts nothing: the next one measures plain decoding anyway
        everywhere_off = not any(lookup) and self.trials and not self.trial_left
        if any(lookup):
            self.sleep_steps = self.SLEEP_STEPS
        if self._sleeps(b, any(lookup), everywhere_off, changes):
            return lookup, changes
        if lookup[b]:
            self.steps_off = 0
            return lookup, changes
        self.steps_off += 1
        if not self.trial_left and whole == 0:
            return lookup, changes
        return self._probe(lookup, b, everywhere_off, by_bucket, changes), changes

    def _calibrating(self, batch: int, size: int, changes: list[Routing]) -> bool:
        """Whether the next step measures plain decoding (measured costs only: plain decoding is the unit, class
        docstring): its batch bucket has too few timed plain steps, or it is time to measure again."""
        if self.costs.spec.cost_ratio is not None or not self.awake:
            return False
        at = batch_bucket(size)
        self.since_calibrated += 1
        timed = self.costs.samples[("verify", (at, 0))]
        unmeasured = timed < self.CALIBRATE_SAMPLES and self.calibrations[at] < 2 * self.CALIBRATE_SAMPLES
        if not (unmeasured or self.since_calibrated >= self.RECALIBRATE_EVERY):
            return False
        if not self.calibrations[at]:
            changes.append(Routing("calibrate", size, 0,
                                   f"plain decoding at batch size {batch} is measured first: steps draft nothing "
                                   f"until {self.CALIBRATE_SAMPLES} are timed"))
        self.calibrations[at] += 1
        self.since_calibrated = 0
        return True

    def _route(self, lookup: list[int], changes: list[Routing]) -> dict[int, tuple[float, list[float]]]:
        """Fill `lookup` with each batch size's K (0: drafting off there), noting every size that turns on or off; returns
        the cost plan of each batch bucket."""
        s = self.spec
        by_bucket: dict[int, tuple[float, list[float]]] = {}
        below = True  # drafting on at every smaller batch size
        for b in range(1, self.max_batch + 1):
            bucket = batch_bucket(b)
            if bucket not in by_bucket:
                by_bucket[bucket] = self.costs.plan(b)
            # off, it turns on only on what the rounds seen show: shrunk towards the prior, the few probes of a drafter
            # that accepts nothing still predicted 1.05-1.07x at K=1, and drafting flipped on and off every few seconds
            k, speedup, why = self.plan(b, by_bucket[bucket], proven=not self.on[b])
            on = True
            if self.trials:
                need = s.min_speedup * (1.0 + (0.0 if self.on[b] else self.HYSTERESIS))
                on = speedup > need
                why = f"predicted speedup {speedup:.2f} {'>' if on else '<='} {need:.2f} at K={k}: {why}"
                realized = self._unpaid(b)
                if on and realized is not None:  # what the steps yield overrules the model
                    on = False
                    why = (f"realized speedup {realized:.2f} <= {self._realized_line(b):.2f} (tokens per second of the last "
                           f"steps that drafted over target-only decoding's), though {why}")
                if on and not below:  # a larger batch gains less from a draft: the model's noise, where no step says
                    on = False
                    why = f"drafting is off at batch size {b - 1}, though {why}"
            below = below and on
            if on != self.on[b]:
                self.on[b] = on
                changes.append(Routing("on" if on else "off", b, k if on else 0, why))
            lookup[b] = k if on else 0
        return by_bucket

    def _sleeps(self, b: int, drafting: bool, everywhere_off: bool, changes: list[Routing]) -> bool:
        """Wake, stay asleep or fall asleep (the drafter's pass skipped: class docstring); whether the step is asleep."""
        if not everywhere_off:
            if not self.awake:
                self._wake(changes, b, "drafting is on again" if drafting else "a new drafter")
        elif not self.awake:
            self.sleep_left -= 1
            if self.sleep_left > 0:
                return True
            self._wake(changes, b, f"drafting has been off for {self.sleep_steps} steps: measuring the drafter again")
            self.sleep_steps = min(2 * self.sleep_steps, self.SLEEP_MAX)  # if it is still off, the next sleep is longer
        elif self.measured_awake >= self.WAKE_TOKENS:
            self.awake, self.sleep_left = False, self.sleep_steps
            changes.append(Routing("sleep", b, 0, f"drafting off at every batch size after {self.measured_awake} drafted "
                                                   f"tokens measured: the drafter's pass skipped for {self.sleep_steps} steps"))
            return True
        return False

    def _probe(self, lookup: list[int], b: int, everywhere_off: bool, by_bucket: dict[int, tuple[float, list[float]]],
               changes: list[Routing]) -> list[int]:
        """`lookup`, or, when drafting has been off long enough at batch size `b`, a probe: every size drafts this step."""
        s = self.spec
        fast = self.trial_left or everywhere_off
        every = max(1, s.probe_every // self.FAST_PROBES) if fast else s.probe_every
        if self.steps_off < every:
            return lookup
        self.steps_off = 0
        if fast:
            k = s.k
            why = (f"a drafter on trial ({self.trial_left} drafted tokens to go)" if self.trial_left else
                   f"measuring the drafter before its pass is skipped ({self.measured_awake} of {self.WAKE_TOKENS} tokens)")
        else:
            c, v = by_bucket[batch_bucket(b)]
            k = cheapest_k(c, v, s.k_min, s.k_max) if self.costs.measured else s.k_min
            why = f"drafting has been off for {every} steps"
        changes.append(Routing("probe", b, k, why))
        return [0] + [k] * self.max_batch

    def skips_pass(self, batch: int, lookup: list[int], whole: int | None = None) -> bool:
        """Whether the step about to run at `batch` (drafting `lookup[batch]`, as `schedule` returned it, `whole` of the
        batch with a whole drafter cache as `schedule` was told) skips the drafter's pass over its new tokens: asleep;
        drafting off at this batch size on what its steps yielded while it is on at another; or, off everywhere and
        measuring the drafter before sleeping, no request of the step whole (see the class docstring)."""
        b = self._size(batch)
        if lookup[b]:
            return False
        if not self.awake:
            return True
        if not any(self.on[1:]):
            return whole == 0
        return not self.on[b] and self._unpaid(b) is not None

    def _size(self, batch: int) -> int:
        """A batch size as the lookup indexes it: 1 to max_batch."""
        return min(max(batch, 1), self.max_batch)

    def _realized_line(self, batch: int) -> float:
        """The realized speedup drafting must beat at this batch size: serve.spec.min_speedup while it is on there, and
        `HYSTERESIS` more while it is off (that yield is an average of the last 20 or so steps, which a plain rate moving
        by a few percent would otherwise carry back and forth over the line)."""
        on = self.on[self._size(batch)]
        return self.spec.min_speedup * (1.0 + (0.0 if on else self.HYSTERESIS))

    def _unpaid(self, batch: int) -> float | None:
        """The realized speedup at this batch size where it says drafting does not pay, else None (it pays, or too few
        steps are measured to say). While drafting is on there, it must be under `_realized_line` by `NOISE_Z` of its
        standard error (`CostTable.realized_noise`): at batch 1 a drafter that paid 1.3x plain vLLM's speed on chat
        requests yielded averages that dipped to 0.98-0.99 now and then, and drafting went off a dozen times in seven
        minutes. Off, it stays off while it is at most the line (with its hysteresis)."""
        realized = self.costs.realized_speedup(batch)
        if realized is None:
            return None
        margin = self.NOISE_Z * self.costs.realized_noise(batch) if self.on[self._size(batch)] else 0.0
        return realized if realized + margin <= self._realized_line(batch) else None

    def _wake(self, changes: list[Routing], batch: int, why: str) -> None:
        self.awake, self.measured_awake, self.sleep_left = True, 0, 0
        changes.append(Routing("wake", batch, 0, why))
