"""The experiment's saved view (dvi.mlflow_view): pure functions of the metric keys seen, checked against the
layout MLflow's UI reads (a saved-view envelope whose state names columns and line charts)."""

from __future__ import annotations

import json

from dvi import mlflow_view as mv

SERVE = ["interval/acceptance.code", "interval/acceptance.prose", "interval/acceptance_rate", "interval/tokens_per_s",
         "version/init-L2-full/acceptance_rate", "version/d0001/acceptance_rate", "version/d0001/mean_accepted_length",
         "total/acceptance_rate", "events/swap", "events/promote", "records/sent", "version/d0001/vs_target_only",
         "version/init-L2-full/vs_target_only", "version/d0001/vs_target_only.code", "interval/vs_target_only.b1",
         "interval/vs_target_only.b8"]
TRAINER = ["loss", "gate/candidate_acceptance", "gate/serving_acceptance", "gate/passed", "count/published", "count/retrains", "count/records",
           "gate/anchor_acceptance", "gate/anchor_expected", "gate/anchor_start", "gate/anchor_code", "gate/anchor_markdown"]


def charts(state: dict) -> dict[str, list[str]]:
    return {c["displayName"]: c["selectedMetricKeys"] for c in state["compareRunCharts"]}


def test_charts_put_each_comparison_on_shared_axes_against_wall_clock_time():
    state = mv.view_state(SERVE + TRAINER)
    by_title = charts(state)
    assert by_title["acceptance by domain (interval)"] == ["interval/acceptance.code", "interval/acceptance.prose"]
    assert by_title["acceptance by drafter version (since swapped in)"] == [
        "version/d0001/acceptance_rate", "version/init-L2-full/acceptance_rate"]
    assert by_title["swaps, promotions, rollbacks (each step is one)"] == ["events/promote", "events/swap"]
    assert by_title["trainer gate: candidate vs serving (acceptance as served)"] == [
        "gate/candidate_acceptance", "gate/serving_acceptance"]
    assert by_title["trainer gate: candidate on the bootstrap's held-out slice, in all and per domain, vs the start"] == [
        "gate/anchor_acceptance", "gate/anchor_code", "gate/anchor_markdown", "gate/anchor_start"]
    assert by_title["requests' speed over target-only decoding by drafter version (above 1: speculation pays)"] == [
        "version/d0001/vs_target_only", "version/init-L2-full/vs_target_only"]
    assert by_title["requests' speed over target-only decoding by drafter version and domain"] == ["version/d0001/vs_target_only.code"]
    assert by_title["the engine's speed over target-only decoding by batch size (its last steps)"] == [
        "interval/vs_target_only.b1", "interval/vs_target_only.b8"]
    assert all(c["type"] == "LINE" and c["xAxisKey"] == "time" and not c["useGlobalXaxisKey"] and c["metricKey"] in
               c["selectedMetricKeys"] for c in state["compareRunCharts"])
    sections = {s["uuid"] for s in state["compareRunSections"]}
    assert {c["metricSectionId"] for c in state["compareRunCharts"]} <= sections
    assert len({c["uuid"] for c in state["compareRunCharts"]}) == len(state["compareRunCharts"])
    # a chart with nothing to plot is left out; the columns are the loop's key figures, as MLflow names columns
    assert "trainer loss" not in charts(mv.view_state(SERVE))
    assert state["selectedColumns"][0] == "metrics.`total/acceptance_rate`" and "metrics.`count/published`" in state["selectedColumns"]


def test_a_long_lived_replica_charts_its_newest_versions_and_the_tag_stays_within_mlflows_limit():
    keys = [f"version/d{i:04d}/acceptance_rate" for i in range(1, 2001)] + [f"interval/acceptance.domain{i}" for i in range(300)]
    by_title = charts(mv.view_state(keys))
    versions = by_title["acceptance by drafter version (since swapped in)"]
    assert len(versions) == mv.MAX_KEYS_PER_CHART and versions[-1] == "version/d2000/acceptance_rate"
    assert len(mv.tag_value(keys, 0)) < 20_000  # MLflow refuses longer experiment tag values


def test_the_tag_is_mlflows_saved_view_envelope_and_merging_keeps_another_runs_keys():
    value = mv.tag_value(SERVE, created_at_ms=1_700_000_000_000)
    envelope = json.loads(value)
    assert envelope["name"] == mv.VIEW_NAME and envelope["createdAt"] == 1_700_000_000_000
    assert json.loads(envelope["state"]) == mv.view_state(SERVE)
    merged = mv.merged_keys(value, TRAINER)
    assert merged >= set(TRAINER) and "version/d0001/acceptance_rate" in merged
    assert mv.plotted_keys(merged) == mv.plotted_keys(SERVE + TRAINER)
    # what dvi cannot read adds nothing (and does not raise): the view is rebuilt from this run's keys
    for stored in (None, "", "not json", '{"name": "x"}', '{"state": "[1]"}', '{"state": "{\\"compareRunCharts\\": 3}"}'):
        assert mv.merged_keys(stored, TRAINER) == set(TRAINER)
    assert mv.view_path("7") == "/experiments/7/runs?viewStateShareKey=dvi"
