"""When the trainer trains: the retrain triggers of `conf/trigger/` as pure logic over an explicit clock.

Kinds (`TriggerConfig.kind`):
- continuous: always active; the trainer steps on every fresh record and gates every `trainer.gate_every` steps
  and every `trainer.gate_every_s` seconds.
- threshold: a session starts when the stream's rolling acceptance (accepted / drafted over the last `window`
  records that drafted anything) falls below `acceptance_below`, or when the drift score crosses `drift_above`,
  once `min_records` such records were seen, never while a session runs, and not within `cooldown_s` of the
  end of the last one.
- schedule: a session starts every `every_s` seconds (the first one `every_s` after start).
- manual: a session starts only on request.
A retrain request (`dvi retrain`, via the control topic) starts a session whatever the kind; under continuous,
where the trainer is always training, `poll` returns the request's reason without starting a session and the
trainer gates and publishes at once (`Trigger.FORCED` prefixes that reason). A session lasts `session_steps` optimizer steps, then the
trainer gates and publishes and calls `end_session`.

Drift score: the reference is the highest rolling acceptance seen since the last publish (or since start);
drift = (reference - current) / reference, in [0, 1], 0 while there is no reference. A publish resets the
reference: the new drafter's acceptance is the new normal.

The trainer loop's other timing decisions are pure logic here too: how far apart timed gate checks are spaced when
they are slow (`next_gate_in`), when the loop gives freed heap memory back to the system (`release_due`), when
fresh records short of a batch step (`batch_ready`), and how much of its share of serving's busy time a paused
trainer claims (`Claim`).

This module knows acceptance counts and time; it knows nothing about records, Kafka or models.
"""

from __future__ import annotations

from collections import deque

from dvi.alloc import RELEASE_EVERY_S
from dvi.config import TriggerConfig


class RollingAcceptance:
    """Accepted over drafted tokens of the last `window` records that drafted anything (`add`), kept as running sums."""

    def __init__(self, window: int):
        self._records: deque[tuple[int, int]] = deque(maxlen=window)
        self.accepted = self.drafted = 0

    def add(self, accepted: int, drafted: int) -> None:
        if len(self._records) == self._records.maxlen:
            a, d = self._records[0]
            self.accepted -= a
            self.drafted -= d
        self._records.append((accepted, drafted))
        self.accepted += accepted
        self.drafted += drafted

    def __len__(self) -> int:
        return len(self._records)

    @property
    def full(self) -> bool:
        return len(self._records) == self._records.maxlen

    @property
    def value(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def clear(self) -> None:
        self._records.clear()
        self.accepted = self.drafted = 0


class Trigger:
    FORCED = "retrain requested"  # continuous: the reason `poll` returns for a request (gate and publish now)

    def __init__(self, cfg: TriggerConfig, now: float):
        self.cfg = cfg
        self._window = RollingAcceptance(cfg.window)
        self._seen = 0  # records with drafts since start
        self._reference: float | None = None
        self._requested = False
        self._in_session = False
        self._steps = 0
        self._quiet_until = now  # threshold: cooldown
        self._next_fire = now + cfg.every_s  # schedule

    # -- inputs ----------------------------------------------------------------------------------

    def observe(self, accepted: int, drafted: int, now: float) -> None:
        """One record's totals; records that drafted nothing carry no acceptance signal."""
        if drafted <= 0:
            return
        self._window.add(accepted, drafted)
        self._seen += 1
        current = self.rolling_acceptance
        if current is not None and (self._reference is None or current > self._reference):
            self._reference = current

    def request(self, now: float) -> None:
        """A retrain request: the next `poll` starts a session (unless one is running)."""
        self._requested = True

    # -- state -----------------------------------------------------------------------------------

    @property
    def rolling_acceptance(self) -> float | None:
        if self._seen < self.cfg.min_records:
            return None
        return self._window.value

    @property
    def drift_score(self) -> float:
        current, ref = self.rolling_acceptance, self._reference
        if current is None or not ref:
            return 0.0
        return max(0.0, (ref - current) / ref)

    def active(self, now: float) -> bool:
        return self.cfg.kind == "continuous" or self._in_session

    def snapshot(self) -> dict[str, float]:
        """For MLflow: rolling acceptance (-1 before min_records), drift score, whether a session runs."""
        ra = self.rolling_acceptance
        return {"rolling_acceptance": -1.0 if ra is None else ra, "drift_score": self.drift_score,
                "in_session": float(self._in_session)}

    # -- sessions --------------------------------------------------------------------------------

    def poll(self, now: float) -> str | None:
        """The reason a session starts now, or None (also None while one runs). Continuous never starts a session:
        a retrain request returns `FORCED ...` once (the trainer gates and publishes now), anything else None."""
        if self.cfg.kind == "continuous":
            requested, self._requested = self._requested, False
            return f"{self.FORCED}: gate and publish now (continuous trigger)" if requested else None
        if self._in_session:
            self._requested = False
            return None
        reason = self._reason(now)
        if reason is not None:
            self._requested = False
            self._in_session = True
            self._steps = 0
        return reason

    def _reason(self, now: float) -> str | None:
        c = self.cfg
        if self._requested:
            return "manual: retrain requested"
        if c.kind == "schedule" and now >= self._next_fire:
            return f"schedule: every {c.every_s:g} s"
        if c.kind == "threshold" and now >= self._quiet_until:
            current = self.rolling_acceptance
            if current is None:
                return None
            if c.acceptance_below is not None and current < c.acceptance_below:
                return f"threshold: rolling acceptance {current:.3f} < {c.acceptance_below:.3f} over {len(self._window)} records"
            if c.drift_above is not None and self.drift_score > c.drift_above:
                return (f"drift: score {self.drift_score:.3f} > {c.drift_above:.3f} (rolling acceptance {current:.3f}, "
                        f"reference {self._reference:.3f})")
        return None

    def step_done(self) -> None:
        if self._in_session:
            self._steps += 1

    def session_over(self) -> bool:
        return self._in_session and self._steps >= self.cfg.session_steps

    def end_session(self, now: float, published: bool) -> None:
        """Re-arm after a session: cooldown (threshold), next period (schedule), and a fresh drift reference
        after a publish (the window too: acceptance from the old drafter says nothing about the new one)."""
        self._in_session = False
        self._steps = 0
        self._quiet_until = now + self.cfg.cooldown_s
        if self.cfg.kind == "schedule":
            self._next_fire = now + self.cfg.every_s
        if published:
            self._reference = None
            self._window.clear()
            self._seen = 0


def next_gate_in(every_s: float, took_s: float, max_share: float) -> float:
    """Seconds from the start of a gate check that took `took_s` to the start of the next timed one: `every_s`, or
    longer where checks that slow would otherwise take more than `max_share` of the trainer's time
    (trainer.gate_max_share)."""
    return max(every_s, took_s / max_share)


def release_due(step: int, released_step: int, now: float, released_at: float) -> bool:
    """Whether the loop gives freed heap memory back now (`dvi.alloc.release_free`): a step ran since the last release
    (at step `released_step`, time `released_at`), and that was RELEASE_EVERY_S ago or more. Checked on every turn of
    the loop, stepping or idle: a trainer that goes idle after a step gives that step's memory back too, instead of
    holding it for as long as it idles."""
    return step != released_step and now - released_at >= RELEASE_EVERY_S


STREAM_PAUSE_S = 1.0  # a stream quiet this long: what is waiting steps as a short batch


def batch_ready(positions: int, budget: float, quiet_s: float, has_turn) -> bool:
    """Whether the fresh positions waiting (`positions`) step now: they fill the batch (`budget`), or the stream has been
    quiet for STREAM_PAUSE_S (`quiet_s`: since the last record), or the trainer has its turn on the CPU (`has_turn()`,
    asked last: serving waits for it, so no record comes until it stops, and waiting for the pause would waste the turn)."""
    return positions > 0 and (positions >= budget or quiet_s > STREAM_PAUSE_S or has_turn())


class Claim:
    """How much of its share of serving's busy time (`trainer.pause_share`, under `dvi up`'s pause policy) the trainer
    claims, as a fraction of that share (`value`, told to the supervisor through `dvi.busy.ClaimFile`): all of it at
    first, half as much after each gate in a row that refused its candidate, down to `floor`
    (`trainer.pause_share_min` over `pause_share`). While it runs, serving waits: a trainer whose candidates keep losing
    to the serving drafter costs requests that share and gains them nothing. It claims all of it again once a version
    publishes or is rolled back (the drafter it competes with changed), on a retrain request, or once the acceptance
    of the last `WINDOW` records (`observe`) is `DRIFT` below what it was at the last refusal: the traffic moved, and
    what the trainer learns from it may pay. Between requests it trains whatever it claims."""

    DRIFT = 0.2
    WINDOW = 16  # records (each up to stream.chunk_rounds rounds: hundreds of drafts in all) the acceptance is taken over

    def __init__(self, floor: float):
        self.floor = min(max(floor, 0.0), 1.0)
        self.refused = 0  # gates in a row that refused the candidate
        self.acceptance_at: float | None = None  # `acceptance` at the last refusal (or the first measured after it)
        self._recent = RollingAcceptance(self.WINDOW)

    @property
    def value(self) -> float:
        return max(self.floor, 0.5 ** self.refused)

    @property
    def acceptance(self) -> float | None:
        """Accepted over drafted tokens of the last WINDOW records that drafted anything; None before there are as many."""
        return self._recent.value if self._recent.full else None

    def refusal(self) -> None:
        """A gate refused the candidate."""
        self.refused += 1
        self.acceptance_at = self.acceptance

    def restore(self) -> None:
        self.refused, self.acceptance_at = 0, None

    def observe(self, accepted: int, drafted: int) -> bool:
        """One record's totals; whether the claim should be whole again: it is not, and `acceptance` has fallen `DRIFT`
        below what it was at the last refusal (the first figure measured after a refusal without one stands for it)."""
        if drafted <= 0:  # drafted nothing: no acceptance signal
            return False
        self._recent.add(accepted, drafted)
        now = self.acceptance
        if not self.refused or now is None:
            return False
        if self.acceptance_at is None:
            self.acceptance_at = now
        return now < (1.0 - self.DRIFT) * self.acceptance_at
