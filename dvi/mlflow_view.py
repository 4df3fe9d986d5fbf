"""What a person sees first in MLflow: the experiment's saved view of dvi's runs, as MLflow's UI stores one.

MLflow's experiment page keeps its layout (the runs table's columns, the charts beside it) in the browser, and
shares a layout as an experiment tag: `mlflow.sharedViewState.<id>`, whose value is a JSON envelope
`{"name", "createdAt", "state"}` with the page's state as a JSON string, opened by the page address
`#/experiments/<id>/runs?viewStateShareKey=<id>` (MLflow 3.17; `view_path`). dvi writes one such view, `dvi`:

- the runs table shows the loop's key figures as columns (`COLUMNS`: live acceptance, speed and requests of each
  serve run; published versions, last gate and loss of the trainer);
- the charts, against wall-clock time, put what is compared on one chart with shared axes (`CHARTS`): acceptance
  by domain, acceptance by drafter version, the overall rate beside the cumulative one, swaps / promotions /
  rollbacks as step counters (each step is where one happened), the trainer's gate (candidate and serving) and
  its publishes.

A chart names the metric keys it plots, so the view is rebuilt as new keys appear (a new domain, a new drafter
version): `view_state(keys)` is a pure function of the metric keys seen so far, and `merged_keys` joins the keys
of the view already stored (another replica's) with this process's. The Tracker (`dvi.tracking`) writes it.

This module knows MLflow's UI state format and dvi's metric names; it does not talk to MLflow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

VIEW_ID = "dvi"
VIEW_NAME = "dvi: the loop at a glance"
TAG_PREFIX = "mlflow.sharedViewState."
TAG_KEY = TAG_PREFIX + VIEW_ID
MAX_KEYS_PER_CHART = 16  # a long-lived replica sees hundreds of versions: the chart keeps the newest
X_AXIS = "time"  # wall-clock time: runs that started at different moments line up

# the runs table's metric columns, in order (a run shows "-" where it has no such metric)
COLUMNS = ("total/acceptance_rate", "interval/acceptance_rate", "interval/tokens_per_s", "total/requests",
           "count/published", "count/records", "gate/candidate_acceptance", "gate/serving_acceptance", "loss")


@dataclass(frozen=True)
class Chart:
    """One line chart: the keys matching `pattern` share its axes."""

    section: str
    title: str
    pattern: str

    def keys(self, seen: Iterable[str]) -> list[str]:
        """The keys this chart plots, in a stable order (versions in the order their names sort, newest last)."""
        match = re.compile(self.pattern).fullmatch
        return sorted({k for k in seen if match(k)})[-MAX_KEYS_PER_CHART:]


CHARTS = (
    Chart("Acceptance", "acceptance by domain (interval)", r"interval/acceptance\.[^/]+"),
    Chart("Acceptance", "acceptance by drafter version (since swapped in)", r"version/[^/]+/acceptance_rate"),
    Chart("Acceptance", "acceptance: interval and since start", r"(interval|total)/acceptance_rate"),
    Chart("Acceptance", "tokens/s (interval)", r"interval/tokens_per_s"),
    Chart("Speed", "requests' speed over target-only decoding by drafter version (above 1: speculation pays)",
          r"version/[^/]+/vs_target_only"),
    Chart("Speed", "requests' speed over target-only decoding by drafter version and domain",
          r"version/[^/]+/vs_target_only\.[^/]+"),
    Chart("Speed", "the engine's speed over target-only decoding by batch size (its last steps)", r"interval/vs_target_only\.b\d+"),
    Chart("Loop", "swaps, promotions, rollbacks (each step is one)", r"events/(swap|promote|rollback)"),
    Chart("Loop", "trainer gate: candidate vs serving (acceptance as served)", r"gate/(candidate|serving)_acceptance"),
    Chart("Loop", "trainer gate: candidate on the bootstrap's held-out slice, in all and per domain, vs the start",
          r"gate/anchor_(?!expected)[a-z_]+"),
    Chart("Loop", "drafters published, retrains requested", r"count/(published|retrains)"),
    Chart("Loop", "trainer loss", r"loss"),
)


def view_path(experiment_id: str) -> str:
    """The page address (after the server's `#`) that opens the view."""
    return f"/experiments/{experiment_id}/runs?viewStateShareKey={VIEW_ID}"


def _column(key: str) -> str:
    return f"metrics.`{key}`"  # MLflow's canonical column key


def _section_id(section: str) -> str:
    return f"dvi-{section.lower()}"


def view_state(keys: Iterable[str]) -> dict:
    """The experiment page's state (search facets and UI state) for the metric keys seen so far."""
    seen = set(keys)
    sections, charts = [], []
    for name in dict.fromkeys(c.section for c in CHARTS):
        sections.append({"uuid": _section_id(name), "name": name, "display": True, "isReordered": False})
    for i, chart in enumerate(CHARTS):
        plotted = chart.keys(seen)
        if not plotted:
            continue
        charts.append({
            "uuid": f"dvi-chart-{i}", "type": "LINE", "runsCountToCompare": 10, "metricSectionId": _section_id(chart.section),
            "deleted": False, "isGenerated": False, "displayName": chart.title, "metricKey": plotted[0],
            "selectedMetricKeys": plotted, "lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear",
            "range": {}, "xAxisKey": X_AXIS, "selectedXAxisMetricKey": "", "yAxisKey": "metric", "yAxisExpressions": [],
            "ignoreOutliers": False, "useGlobalXaxisKey": False, "useGlobalLineSmoothing": False,
        })  # fmt: skip
    return {
        # search facets: newest runs first, active ones only
        "searchFilter": "", "orderByKey": "attributes.start_time", "orderByAsc": False, "startTime": "ALL",
        "lifecycleFilter": "Active", "modelVersionFilter": "All Runs", "datasetsFilter": [],
        # UI state: the table beside the charts, every run visible
        "selectedColumns": [_column(k) for k in COLUMNS],
        "runsPinned": [], "runsHidden": [], "runsExpanded": {}, "runsVisibilityMap": {}, "runsHiddenMode": "SHOW_ALL",
        "compareRunCharts": charts, "compareRunSections": sections, "isAccordionReordered": True,
        "viewMaximized": False, "runListHidden": False, "groupBy": None, "groupsExpanded": {},
        "useGroupedValuesInCharts": True, "hideEmptyCharts": True, "autoRefreshEnabled": True,
        "globalLineChartConfig": {"xAxisKey": X_AXIS, "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }  # fmt: skip


def tag_value(keys: Iterable[str], created_at_ms: int) -> str:
    """The experiment tag's value: MLflow's saved-view envelope around `view_state(keys)`."""
    return json.dumps({"name": VIEW_NAME, "createdAt": int(created_at_ms),
                       "state": json.dumps(view_state(keys), separators=(",", ":"))}, separators=(",", ":"))


def plotted_keys(keys: Iterable[str]) -> frozenset[str]:
    """The keys among `keys` that some chart plots: the view changes only when this set grows."""
    seen = set(keys)
    return frozenset(k for c in CHARTS for k in c.keys(seen))


def merged_keys(stored: str | None, keys: Iterable[str]) -> set[str]:
    """`keys` plus those plotted by the view stored as `stored` (a tag value; None, or not a view dvi can read,
    adds nothing: the view is then rebuilt from `keys` alone)."""
    out = set(keys)
    try:
        state = json.loads(json.loads(stored)["state"]) if stored else {}
        for chart in state.get("compareRunCharts") or []:
            out.update(k for k in chart.get("selectedMetricKeys") or [] if isinstance(k, str))
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    return out
