"""ServingMetrics as pure bookkeeping: the swap judge's baseline follows the traffic of now."""

from __future__ import annotations

from types import SimpleNamespace

from dvi.metrics import ServingMetrics


def result(version: str, rounds: list[tuple[int, int]]):
    """A finished request as the metrics read it: rounds of (drafted, accepted) by one drafter version."""
    rs = [SimpleNamespace(drafter_version=version, k=k, accepted=a) for k, a in rounds]
    return SimpleNamespace(rounds=rs, token_ids=[0] * sum(a + 1 for _, a in rounds), seconds=1.0)


def test_recent_acceptance_covers_the_latest_tokens_while_the_lifetime_figure_remembers_old_traffic():
    m = ServingMetrics()
    m.observe(result("d1", [(4, 4)] * 100), "code")  # 400 drafted, all accepted: the old domain
    m.observe(result("d1", [(4, 1)] * 25 + [(0, 0)] * 5), "prose")  # 100 drafted at 0.25; plain rounds draft nothing
    assert m.acceptance_of("d1") == (500, 425)  # lifetime: 0.85
    assert m.recent_acceptance_of("d1", 100) == (100, 25)  # the traffic of now: 0.25
    assert m.recent_acceptance_of("d1", 102) == (104, 29)  # whole rounds: it covers at least the tokens asked for
    assert m.recent_acceptance_of("d1", 10_000) == (500, 425)  # asked for more than it has: everything
    assert m.recent_acceptance_of("d2", 100) == (0, 0)
