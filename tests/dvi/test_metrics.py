"""ServingMetrics as pure bookkeeping: the swap judge's baseline follows the traffic of now."""

from __future__ import annotations

from types import SimpleNamespace

from dvi.metrics import (OTHER_DOMAIN, VERSIONS_KEPT, Point, ServingMetrics, VersionSpeed, drift_plot, speed_over_target_only,
                         version_spans)


def result(version: str, rounds: list[tuple[int, int]], timed: tuple[int, float] = (0, 0.0)):
    """A finished request as the metrics read it: rounds of (drafted, accepted) by one drafter version; `timed`: its
    (timed tokens, target-only tokens) (`Result.vs_target_only`)."""
    rs = [SimpleNamespace(drafter_version=version, k=k, accepted=a) for k, a in rounds]
    return SimpleNamespace(rounds=rs, prompt_ids=[1, 2, 3], token_ids=[0] * sum(a + 1 for _, a in rounds), seconds=1.0,
                           drafter_versions=[version] if any(k for k, _ in rounds) else [], timed_tokens=timed[0],
                           target_only_tokens=timed[1])


def counts(m: ServingMetrics, version: str, tokens: int) -> tuple[int, int]:
    """(drafted, accepted) of the latest rounds `recent_rounds_of` gives the swap judge."""
    rounds = m.recent_rounds_of(version, tokens)
    return sum(k for k, _ in rounds), sum(a for _, a in rounds)


def test_recent_acceptance_covers_the_latest_tokens_while_the_lifetime_figure_remembers_old_traffic():
    m = ServingMetrics()
    m.observe(result("d1", [(4, 4)] * 100), "code")  # 400 drafted, all accepted: the old domain
    m.observe(result("d1", [(4, 1)] * 25 + [(0, 0)] * 5), "prose")  # 100 drafted at 0.25; plain rounds draft nothing
    assert m.acceptance_of("d1") == (500, 425)  # lifetime: 0.85
    assert counts(m, "d1", 100) == (100, 25)  # the traffic of now: 0.25
    assert counts(m, "d1", 102) == (104, 29)  # whole rounds: it covers at least the tokens asked for
    assert counts(m, "d1", 10_000) == (500, 425)  # asked for more than it has: everything
    assert counts(m, "d2", 100) == (0, 0)
    assert m.recent_rounds_of("d1", 100) == [(4, 1)] * 25  # the rounds themselves, oldest first, for the judge
    assert m.recent_rounds_of("d1", 102) == [(4, 4)] + [(4, 1)] * 25 and m.recent_rounds_of("d2", 100) == []


def test_figures_by_version_are_kept_for_the_latest_versions_and_the_serving_one():
    m = ServingMetrics()
    m.serving("d00")
    for i in range(VERSIONS_KEPT + 8):
        m.observe(result(f"d{i:02d}", [(4, 2)] * 3), "code")
    kept = list(m.by_version)
    assert len(kept) == VERSIONS_KEPT and len(m.recent_rounds) <= VERSIONS_KEPT
    assert "d00" in kept  # serving: kept however old
    assert kept[1:] == [f"d{i:02d}" for i in range(9, VERSIONS_KEPT + 8)]  # then the newest
    assert {v for v, _ in m.by_domain} == set(kept)
    assert m.acceptance_of("d01") == (0, 0) and counts(m, "d01", 100) == (0, 0)
    assert m.total.drafted == 4 * 3 * (VERSIONS_KEPT + 8)  # the totals keep every round
    assert sum(k.startswith("version/") for k in m.interval()) == 2 * VERSIONS_KEPT


def test_domains_beyond_the_cap_count_as_other():
    """A client that tags every request with a new domain cannot grow the figures, /metrics or MLflow."""
    m = ServingMetrics(max_domains=4)
    for i in range(100):
        m.observe(result("d1", [(4, 2)]), f"tenant-{i}")
    domains = {d for _, d in m.by_domain}
    assert domains == {"tenant-0", "tenant-1", "tenant-2", "tenant-3", OTHER_DOMAIN}
    assert m.by_domain[("d1", OTHER_DOMAIN)].drafted == 4 * 96  # their traffic still counts
    assert m.acceptance_of("d1") == (400, 200)
    assert set(m.interval()) >= {f"interval/acceptance.{OTHER_DOMAIN}"}
    assert sum(k.startswith("interval/acceptance.") for k in m.interval()) == 0  # the interval just closed


def test_drift_plot_shades_each_versions_span_and_leaves_idle_intervals_empty(tmp_path):
    t0 = 1_800_000_000.0
    series = [Point(t0, 0.02, 9.0, "init", {"code": 0.01, "prose": 0.03}), Point(t0 + 60, 0.03, 9.5, "init", {"code": 0.03}),
              Point(t0 + 120, None, 0.0, "init"),  # no traffic: a gap, not a zero
              Point(t0 + 180, 0.30, 20.0, "d0001", {"code": 0.40, "prose": 0.18}, {1: 1.1, 8: 0.9}),
              Point(t0 + 240, 0.33, 21.0, "d0001", {}, {1: 1.2, 8: 0.95}, VersionSpeed(1.15, {"code": 1.3, "prose": 1.0}))]
    assert version_spans(series) == [(t0, t0 + 120, "init"), (t0 + 120, t0 + 240, "d0001")]
    path = tmp_path / "drift.png"
    drift_plot(series, [(t0 + 150, "swap", "d0001"), (t0 + 230, "promote", "d0001")], str(path), "test")
    assert path.stat().st_size > 10_000


def test_prometheus_counters_add_up_as_vllm_defines_them_and_histograms_count_requests():
    from prometheus_client.parser import text_string_to_metric_families

    m = ServingMetrics(model_name="m1")
    m.observe(result("d1", [(4, 4), (4, 1), (0, 0)]), "code")
    m.observe(result("d1", [(2, 0), (3, 3)]), "prose")
    m.observe(result("d2", [(4, 2)]), None)
    m.observe_latency(queued_s=0.01, first_token_s=0.2, total_s=1.5, gaps=[(0.3, 3), (0.1, 1)])
    m.observe_latency(queued_s=0.02, first_token_s=None, total_s=0.5, gaps=[])
    text = m.prometheus({"sent": 7, "dropped": 1}, waiting=2, running=3)
    got = {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}

    def total(name: str, **labels) -> float:
        return sum(v for (n, *kv), v in got.items() if n == name and set(labels.items()) <= set(kv))

    assert all(dict(kv).get("model_name") == "m1" for n, *kv in got if n.startswith("dvi_"))
    assert total("dvi_spec_decode_num_drafts_total", drafter_version="d1") == 4  # the plain round drafted nothing
    assert total("dvi_spec_decode_num_draft_tokens_total", drafter_version="d1") == 13
    assert total("dvi_spec_decode_num_accepted_tokens_total", drafter_version="d1") == 8
    assert total("dvi_spec_decode_num_accepted_tokens_total", domain="code") == 5
    assert [total("dvi_spec_decode_num_accepted_tokens_per_pos_total", drafter_version="d1", position=str(j)) for j in (1, 2, 3, 4)] == [3, 2, 2, 1]
    assert [total("dvi_spec_decode_num_drafts_per_pos_total", drafter_version="d1", position=str(j)) for j in (1, 2, 3, 4)] == [4, 4, 3, 2]
    assert total("dvi_mean_accepted_length", drafter_version="d1") == 1 + 8 / 4  # vLLM's: 1 + accepted / drafts
    assert total("dvi_rounds_total", drafter_version="d1") == 5
    assert total("dvi_prompt_tokens_total") == 9 and total("dvi_requests_total") == 3
    assert total("dvi_num_requests_running") == 3 and total("dvi_num_requests_waiting") == 2
    assert total("dvi_records_sent_total") == 7 and total("dvi_records_dropped_total") == 1
    assert total("dvi_e2e_request_latency_seconds_count") == 2 and total("dvi_time_to_first_token_seconds_count") == 1
    assert total("dvi_inter_token_latency_seconds_count") == 4 and abs(total("dvi_inter_token_latency_seconds_sum") - 0.4) < 1e-9
    assert total("dvi_request_queue_time_seconds_count") == 2
    assert total("process_resident_memory_bytes") > 0


def test_the_engines_speed_over_target_only_goes_to_health_mlflow_and_the_plot_series():
    m = ServingMetrics()
    m.speeds({1: 1.25, 8: 0.875})
    assert m.snapshot()["vs_target_only"] == {"1": 1.25, "8": 0.875}
    interval = m.interval()
    assert interval["interval/vs_target_only.b1"] == 1.25 and interval["interval/vs_target_only.b8"] == 0.875
    assert m.series[-1].vs_target_only == {1: 1.25, 8: 0.875}


def test_speed_over_target_only_is_tokens_over_target_only_tokens_by_domain_and_in_all():
    timed = {("d1", "code"): [300, 200.0], ("d1", "prose"): [90, 100.0], ("d2", "code"): [10, 0.0], ("none", "qa"): [50, 50.0],
             ("d3", "all"): [30, 10.0], ("d3", "code"): [10, 10.0]}  # a domain tagged "all" is a domain like any other
    out = speed_over_target_only(timed)
    assert out == {"d1": VersionSpeed((300 + 90) / (200 + 100), {"code": 1.5, "prose": 0.9}), "none": VersionSpeed(1.0, {"qa": 1.0}),
                   "d3": VersionSpeed(2.0, {"all": 3.0, "code": 1.0})}
    assert speed_over_target_only({}) == {}


def test_requests_speed_over_target_only_by_version_and_domain_reaches_health_mlflow_and_the_plot():
    m = ServingMetrics()
    m.serving("d1")
    m.observe(result("d1", [(4, 3)] * 10, timed=(36, 24.0)), "code")  # 1.5x
    m.observe(result("d1", [(4, 0)] * 10, timed=(9, 10.0)), "prose")  # 0.9x
    m.observe(result("d1", [(0, 0)] * 8, timed=(8, 8.0)), "prose")  # drafting planned off: the serving version's, 1.0x
    m.observe(result("d1", [(4, 4)] * 2), "code")  # no step timed: it says nothing of speed
    by = m.snapshot()["vs_target_only_by_version"]
    assert by == {"d1": {"all": round(53 / 42, 3), "by_domain": {"code": 1.5, "prose": round(17 / 18, 3)}}}
    interval = m.interval()
    assert interval["version/d1/vs_target_only"] == 53 / 42 and interval["version/d1/vs_target_only.code"] == 1.5
    assert m.series[-1].version_vs_target_only == VersionSpeed(53 / 42, {"code": 1.5, "prose": 17 / 18})
    m.serving("d2")  # a new version: its own figures, the old one's kept
    m.observe(result("d2", [(4, 4)] * 5, timed=(20, 8.0)), "code")
    by = m.snapshot()["vs_target_only_by_version"]
    assert by["d2"] == {"all": 2.5, "by_domain": {"code": 2.5}} and "d1" in by
