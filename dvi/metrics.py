"""Serving metrics as data: what the server decoded, by drafter version and domain, and what happened to drafters.

`ServingMetrics.observe(result, domain)` folds one finished request (`dvi.engine_api.Result`) in, round by round,
so a request that spanned a hot swap counts each round for the drafter that drafted it. Readers take what they
need: `prometheus(...)` renders the /metrics page (prometheus_client: vLLM-shaped spec-decode counters by drafter
version, domain and position, latency histograms fed by `observe_latency`, process metrics, a `model_name` label), `interval()` the points for MLflow since the last call,
`recent_rounds_of(version, tokens)` and `acceptance_of(version)` feed the swap judge, `snapshot` and `interval` also
give each version's requests' speed over target-only decoding as the engine timed their steps (`Result.vs_target_only`,
`speed_over_target_only`), and `series` / `markers` the drift plot (`drift_plot`).
Events (swaps, refusals, rollbacks, promotions) are counted with `event(kind, ...)`.
Figures by version are kept for the VERSIONS_KEPT versions most recently seen (the serving one always): a replica
that swaps every few minutes for weeks would otherwise grow them, its /metrics page and its MLflow points without
bound. An older version's rounds stay in the totals.

This module knows the engine's stats; not HTTP, Kafka or MLflow (its readers are in dvi.serving.replica).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from datetime import datetime
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dvi.engine_api import Result, SpecStats

NO_DRAFTER = "none"  # the version label of rounds decoded without a drafter
NO_DOMAIN = "none"
OTHER_DOMAIN = "other"  # the domains beyond the first max_domains seen
RECENT_ROUNDS = 4096  # drafting rounds kept per version for `recent_rounds_of`
VERSIONS_KEPT = 16  # versions whose figures are kept (a rollout compares the newest two)
# histogram buckets (seconds), vLLM's
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
               1920.0, 7680.0]


@dataclass
class Point:
    """One interval of the drift plot."""

    time: float
    acceptance: float | None  # accepted / drafted in the interval (None: nothing drafted)
    tokens_per_s: float  # generated tokens / wall seconds of the interval
    version: str | None  # the drafter serving at its end
    domains: dict[str, float] = field(default_factory=dict)  # acceptance by domain in the interval
    # decoding speed over target-only decoding's by batch-size bucket, as the engine measured it at the interval's
    # end (`dvi.planner.CostTable.speed_vs_target_only`)
    vs_target_only: dict[int, float] = field(default_factory=dict)
    # the serving version's requests' speed over target-only decoding so far, in all and by domain (None: untimed)
    version_vs_target_only: VersionSpeed | None = None


class ServingMetrics:
    """Thread-safe counters of one serving replica (see the module docstring)."""

    def __init__(self, history: int = 10_000, max_domains: int = 16, model_name: str = "model"):
        self._lock = threading.Lock()
        self.model_name = model_name  # the `model_name` label of every Prometheus series
        self.max_domains = max_domains  # domains tracked by name; traffic of any further one counts as OTHER_DOMAIN
        self.domains: set[str] = set()
        self.started = time.time()
        self.requests = 0
        self.tokens = 0  # generated
        self.prompt_tokens = 0
        self.decode_seconds = 0.0  # summed over requests (a batch's requests overlap)
        self.errors: Counter[str] = Counter()  # HTTP status -> count
        self.events: Counter[str] = Counter()  # swap, rollback, promote, refused:<reason>
        self.routing: Counter[str] = Counter()  # speculation routing decisions: on, off, probe, ... (dvi.planner.Routing)
        self.schedule: list[int] = []  # the K drafted at each batch size (index 0 unused), where the engine plans one
        self.vs_target_only: dict[int, float] = {}  # decoding speed over target-only's by batch-size bucket (`speeds`)
        self.total = SpecStats()
        self.by_version: dict[str, SpecStats] = {}
        self.by_domain: dict[tuple[str, str], SpecStats] = {}
        # (version, domain) -> [timed tokens, target-only tokens] of the requests it served (`Result.vs_target_only`)
        self.speed: dict[tuple[str, str], list[float]] = {}
        self.recent_rounds: dict[str, deque[tuple[int, int]]] = {}  # version -> its latest rounds' (drafted, accepted)
        self.recent_speed: deque[float] = deque(maxlen=256)  # tokens/s of recent requests
        self.series: deque[Point] = deque(maxlen=history)
        self.markers: deque[tuple[float, str, str]] = deque(maxlen=history)  # (time, event, version)
        self._interval = SpecStats()
        self._interval_domains: dict[str, SpecStats] = {}
        self._interval_tokens = 0
        self._interval_start = time.time()
        self.version: str | None = None  # the drafter serving now
        # the Prometheus registry of this replica: histograms observed as requests finish, the rest read at scrape
        self.registry = CollectorRegistry(auto_describe=False)
        self._scrape_lock = threading.Lock()
        self._scrape: tuple[dict, int, int] = ({}, 0, 0)

        def histogram(name: str, help_: str, buckets: list[float]):
            return Histogram(f"dvi_{name}", help_, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self._ttft = histogram("time_to_first_token_seconds", "Seconds from a request's arrival to its first token.", TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Seconds between tokens (a round's gap shared by its tokens).", ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "Seconds from a request's arrival to its last token.", E2E_BUCKETS)
        self._queue_time = histogram("request_queue_time_seconds", "Seconds a request waited for a batch slot.", E2E_BUCKETS)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

    # -- writers ---------------------------------------------------------------------------------

    def observe(self, result: Result, domain: str | None = None) -> None:
        domain = domain or NO_DOMAIN
        with self._lock:
            if domain not in self.domains:
                if len(self.domains) >= self.max_domains:
                    domain = OTHER_DOMAIN  # a client choosing new tags cannot grow /metrics, MLflow or the plot
                else:
                    self.domains.add(domain)
            self.requests += 1
            self.tokens += len(result.token_ids)
            self.prompt_tokens += len(result.prompt_ids)
            self._interval_tokens += len(result.token_ids)
            self.decode_seconds += result.seconds
            if result.seconds > 0:
                self.recent_speed.append(len(result.token_ids) / result.seconds)
            if result.target_only_tokens > 0:  # the version that served it last: drafting, or planned off
                served = (result.drafter_versions[-1] if result.drafter_versions else self.version) or NO_DRAFTER
                if served not in self.by_version:
                    self._forget_old_versions(keep=served)
                    self.by_version[served] = SpecStats()
                timed = self.speed.setdefault((served, domain), [0, 0.0])
                timed[0] += result.timed_tokens
                timed[1] += result.target_only_tokens
            for r in result.rounds:
                version = r.drafter_version or NO_DRAFTER
                if version not in self.by_version:
                    self._forget_old_versions(keep=version)
                for stats in (self.total, self._interval, self.by_version.setdefault(version, SpecStats()),
                              self.by_domain.setdefault((version, domain), SpecStats()),
                              self._interval_domains.setdefault(domain, SpecStats())):
                    stats.add(r.k, r.accepted)
                if r.k:
                    self.recent_rounds.setdefault(version, deque(maxlen=RECENT_ROUNDS)).append((r.k, r.accepted))

    def _forget_old_versions(self, keep: str) -> None:
        """Make room for `keep`: drop the figures of the versions seen longest ago, never the serving one."""
        seen = [v for v in self.by_version if v not in (keep, self.version)]
        for old in seen[: max(0, len(self.by_version) + 1 - VERSIONS_KEPT)]:
            del self.by_version[old]
            self.recent_rounds.pop(old, None)
            for table in (self.by_domain, self.speed):
                for key in [k for k in table if k[0] == old]:
                    del table[key]

    def error(self, status: int) -> None:
        with self._lock:
            self.errors[str(status)] += 1

    def event(self, kind: str, version: str | None = None) -> None:
        """Count an event; swaps, rollbacks and promotions also become markers on the drift plot."""
        with self._lock:
            self.events[kind] += 1
            if not kind.startswith("refused"):
                self.markers.append((time.time(), kind, version or NO_DRAFTER))

    def route(self, decision: str, schedule: list[int] | None = None) -> None:
        """Count a speculation routing decision (on, off, probe, ...: dvi.planner.Routing); `schedule`: the K per batch size it left."""
        with self._lock:
            self.routing[decision] += 1
            if schedule is not None:
                self.schedule = list(schedule)

    def serving(self, version: str | None) -> None:
        with self._lock:
            self.version = version

    def speeds(self, vs_target_only: dict[int, float]) -> None:
        """The engine's measured decoding speed over target-only decoding's, by batch-size bucket
        (`dvi.planner.CostTable.speed_vs_target_only`)."""
        with self._lock:
            self.vs_target_only = dict(vs_target_only)

    # -- readers ---------------------------------------------------------------------------------

    def acceptance_of(self, version: str) -> tuple[int, int]:
        """(drafted, accepted) of `version` since this replica started."""
        with self._lock:
            s = self.by_version.get(version)
            return (s.drafted, s.accepted) if s else (0, 0)

    def recent_rounds_of(self, version: str, tokens: int) -> list[tuple[int, int]]:
        """`version`'s latest drafting rounds, (drafted, accepted) each, oldest first: from the newest back until
        `tokens` drafted tokens are covered (fewer if it drafted fewer): the traffic of now, not of its whole life."""
        out, drafted = [], 0
        with self._lock:
            for k, a in reversed(self.recent_rounds.get(version, ())):
                if drafted >= tokens:
                    break
                out.append((k, a))
                drafted += k
        return out[::-1]

    def interval(self) -> dict[str, float]:
        """Metrics since the last call (for MLflow), and a point of the drift plot."""
        now = time.time()
        with self._lock:
            s, tokens, seconds = self._interval, self._interval_tokens, max(now - self._interval_start, 1e-9)
            domains = {d: st.acceptance_rate for d, st in self._interval_domains.items() if st.drafted}
            out = {"interval/tokens_per_s": tokens / seconds, "interval/rounds": s.rounds, "interval/drafted": s.drafted}
            if s.drafted:
                out["interval/acceptance_rate"] = s.acceptance_rate
                out["interval/mean_accepted_length"] = s.mean_accepted_length
                for j, a in enumerate(s.per_position_acceptance):
                    out[f"interval/acceptance_pos{j + 1}"] = a
                out.update({f"interval/acceptance.{d}": a for d, a in domains.items()})
            out.update({f"interval/vs_target_only.b{b}": x for b, x in self.vs_target_only.items()})
            by_version = speed_over_target_only(self.speed)
            serving = by_version.get(self.version or NO_DRAFTER)
            self.series.append(Point(now, s.acceptance_rate if s.drafted else None, tokens / seconds, self.version, domains,
                                     dict(self.vs_target_only), serving))
            self._interval, self._interval_domains, self._interval_tokens, self._interval_start = SpecStats(), {}, 0, now
            for version, st in self.by_version.items():
                if st.drafted:
                    out[f"version/{version}/acceptance_rate"] = st.acceptance_rate
                    out[f"version/{version}/mean_accepted_length"] = st.mean_accepted_length
            for version, speed in by_version.items():
                out[f"version/{version}/vs_target_only"] = speed.all
                out.update({f"version/{version}/vs_target_only.{d}": x for d, x in speed.by_domain.items()})
            out.update({"total/requests": self.requests, "total/tokens": self.tokens, "total/acceptance_rate": self.total.acceptance_rate,
                        "total/mean_accepted_length": self.total.mean_accepted_length,
                        **{f"events/{k}": v for k, v in self.events.items()}})
            return out

    def snapshot(self) -> dict:
        """A JSON-able summary (for /health and `dvi status`)."""
        with self._lock:
            speeds = sorted(self.recent_speed)
            return {
                "drafter_version": self.version,
                "uptime_s": round(time.time() - self.started, 1),
                "requests": self.requests,
                "tokens": self.tokens,
                "acceptance_rate": round(self.total.acceptance_rate, 6),
                "mean_accepted_length": round(self.total.mean_accepted_length, 6),
                "median_tokens_per_s": round(speeds[len(speeds) // 2], 3) if speeds else None,
                "by_version": {v: s.to_dict() for v, s in self.by_version.items()},
                "events": dict(self.events),
                "routing": dict(self.routing),
                "schedule": {str(b): k for b, k in enumerate(self.schedule) if b},
                "vs_target_only": {str(b): round(x, 3) for b, x in self.vs_target_only.items()},
                "vs_target_only_by_version": {v: speed.to_dict() for v, speed in speed_over_target_only(self.speed).items()},
                "errors": dict(self.errors),
            }

    def observe_latency(self, *, queued_s: float, first_token_s: float | None, total_s: float,
                        gaps: list[tuple[float, int]]) -> None:
        """One finished request's latencies, as a client saw them: seconds waiting for a batch slot, to its first
        token and in all, and (seconds, tokens) between successive token emissions (each token of a round gets
        its share of the gap)."""
        self._queue_time.observe(queued_s)
        if first_token_s is not None:
            self._ttft.observe(first_token_s)
        self._e2e.observe(total_s)
        for seconds, tokens in gaps:
            for _ in range(tokens):
                self._itl.observe(seconds / tokens)

    def prometheus(self, producer: dict | None = None, waiting: int = 0, running: int = 0) -> str:
        """The Prometheus text exposition (`producer`: the decision producer's stats; `waiting`, `running`: requests
        queued and in the batch now)."""
        with self._scrape_lock:
            self._scrape = (producer or {}, waiting, running)
            return generate_latest(self.registry).decode()

    def _collect(self):
        """The counters and gauges of a scrape (a prometheus_client collector's `collect`)."""
        producer, waiting, running = self._scrape
        model = self.model_name

        def family(kind, name: str, help_: str, labels: tuple[str, ...], samples):
            fam = kind(f"dvi_{name}", help_, labels=("model_name",) + labels)
            for values, value in samples:
                fam.add_metric((model,) + tuple(values), value)
            return fam

        c, g = CounterMetricFamily, GaugeMetricFamily
        with self._lock:
            versions = sorted(self.by_version.items())
            domains = sorted(self.by_domain.items())
            speeds = sorted(self.recent_speed)
            out = [
                family(c, "requests", "Requests decoded.", (), [((), self.requests)]),
                family(c, "prompt_tokens", "Prompt tokens of the requests decoded.", (), [((), self.prompt_tokens)]),
                family(c, "generation_tokens", "Tokens generated.", (), [((), self.tokens)]),
                family(c, "errors", "Requests answered with an HTTP error, by status.", ("status",),
                       [((k,), v) for k, v in sorted(self.errors.items())]),
                # vLLM's spec-decode counters, by drafter version (and domain for the token counts): rate() them
                family(c, "spec_decode_num_drafts", "Rounds that drafted at least one token.", ("drafter_version",),
                       [((v,), s.spec_rounds) for v, s in versions]),
                family(c, "spec_decode_num_draft_tokens", "Tokens drafted.", ("drafter_version", "domain"),
                       [((v, d), s.drafted) for (v, d), s in domains]),
                family(c, "spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.", ("drafter_version", "domain"),
                       [((v, d), s.accepted) for (v, d), s in domains]),
                family(c, "spec_decode_num_accepted_tokens_per_pos", "Rounds that accepted the token drafted at a position.",
                       ("drafter_version", "position"),
                       [((v, str(j + 1)), a) for v, s in versions for j, a in enumerate(s.position_accepted)]),
                family(c, "spec_decode_num_drafts_per_pos", "Rounds that drafted a token at a position (K adapts per round).",
                       ("drafter_version", "position"),
                       [((v, str(j + 1)), d) for v, s in versions for j, d in enumerate(s.position_drafted)]),
                family(c, "rounds", "Verification rounds, drafting or not.", ("drafter_version",), [((v,), s.rounds) for v, s in versions]),
                # ratios for a quick look (they cannot be summed across replicas; the counters above can)
                family(g, "acceptance_rate", "Accepted / drafted since start.", ("drafter_version", "domain"),
                       [((v, d), s.acceptance_rate) for (v, d), s in domains if s.drafted]),
                family(g, "mean_accepted_length", "1 + accepted / drafts, as vLLM defines it.", ("drafter_version",),
                       [((v,), 1 + s.accepted / s.spec_rounds) for v, s in versions if s.spec_rounds]),
                family(g, "position_acceptance", "Acceptance of the j-th drafted token of a round.", ("drafter_version", "position"),
                       [((v, str(j + 1)), a) for v, s in versions for j, a in enumerate(s.per_position_acceptance)]),
                family(g, "tokens_per_second", "Median decode speed of the last 256 requests.", (),
                       [((), speeds[len(speeds) // 2] if speeds else 0.0)]),
                family(g, "drafter_info", "The drafter serving now (value 1).", ("drafter_version",), [((self.version or NO_DRAFTER,), 1)]),
                family(c, "drafter_events", "Drafter swaps, rollbacks, promotions and refusals.", ("event",),
                       [((k,), v) for k, v in sorted(self.events.items())]),
                family(c, "spec_routing", "Speculation routing decisions: drafting turned on or off, probe steps while off.",
                       ("decision",), [((k,), v) for k, v in sorted(self.routing.items())]),
                family(g, "spec_k", "The K drafted at each batch size now (0: drafting off), where the engine plans one.",
                       ("batch_size",), [((str(b),), k) for b, k in enumerate(self.schedule) if b]),
            ]
        out += [
            family(g, "num_requests_running", "Requests in the running batch.", (), [((), running)]),
            family(g, "num_requests_waiting", "Requests waiting for a batch slot.", (), [((), waiting)]),
            family(c, "records_sent", "DecisionRecords acknowledged by Kafka.", (), [((), producer.get("sent", 0))]),
            family(c, "records_dropped", "DecisionRecords dropped (queue full, broker down, invalid).", (),
                   [((), producer.get("dropped", 0))]),
        ]
        return out


class _Collector:
    """prometheus_client's view of a ServingMetrics: its figures, read at each scrape."""

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics

    def collect(self):
        return self.metrics._collect()


@dataclass(frozen=True)
class VersionSpeed:
    """A drafter version's requests' speed over target-only decoding: in all and by domain (`speed_over_target_only`)."""

    all: float
    by_domain: dict[str, float]

    def to_dict(self) -> dict:
        return {"all": round(self.all, 3), "by_domain": {d: round(x, 3) for d, x in self.by_domain.items()}}


def speed_over_target_only(timed: dict[tuple[str, str], list[float]]) -> dict[str, VersionSpeed]:
    """Per version, from (version, domain) -> [timed tokens, target-only tokens]: the tokens its requests' timed steps
    emitted over those target-only decoding would have given them in the same seconds (> 1: speculation paid), in all
    and for each domain's requests; nothing where no step was timed."""
    by: dict[str, dict[str, float]] = {}
    totals: dict[str, list[float]] = {}
    for (version, domain), (tokens, target_only) in sorted(timed.items()):
        if target_only > 0:
            by.setdefault(version, {})[domain] = tokens / target_only
            total = totals.setdefault(version, [0, 0.0])
            total[0] += tokens
            total[1] += target_only
    return {v: VersionSpeed(totals[v][0] / totals[v][1], by[v]) for v in by}


def version_spans(series: list[Point]) -> list[tuple[float, float, str | None]]:
    """(start, end, version): the stretches of time each drafter version served, from the plot's points."""
    spans: list[list] = []
    for p in series:
        if spans and spans[-1][2] == p.version:
            spans[-1][1] = p.time
        else:
            start = spans[-1][1] if spans else p.time
            spans.append([start, p.time, p.version])
    return [tuple(s) for s in spans]


def drift_plot(series: list[Point], markers: list[tuple[float, str, str]], path: str, title: str = "dvi serving") -> None:
    """Acceptance (overall and by domain, one shared axis scaled to the data), tokens/s and the decoding speed over
    target-only decoding's (the engine's by batch-size bucket, and the serving version's requests' in all and by domain,
    the level 1 marked) against wall-clock time, each drafter version's span shaded and labelled with its mean acceptance, swap / rollback / promotion markers;
    intervals without traffic are left empty (a gap, not a zero), as a PNG."""
    import matplotlib  # heavy: only a replica that plots pays for it

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    nan = float("nan")

    def when(t: float):
        return datetime.fromtimestamp(t)

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [2, 1, 1]})
    xs = [when(p.time) for p in series]
    idle = [p.tokens_per_s <= 0 for p in series]
    ax1.plot(xs, [nan if p.acceptance is None else p.acceptance for p in series], "k.-", label="all domains", lw=1.6)
    for domain in sorted({d for p in series for d in p.domains}):
        ax1.plot(xs, [p.domains.get(domain, nan) for p in series], ".-", label=domain, alpha=0.75)
    ax2.plot(xs, [nan if i else p.tokens_per_s for p, i in zip(series, idle)], "b.-")
    for bucket in sorted({b for p in series for b in p.vs_target_only}):
        ax3.plot(xs, [nan if i else p.vs_target_only.get(bucket, nan) for p, i in zip(series, idle)], ".-", label=f"batch <= {bucket}")
    speeds = [None if i else p.version_vs_target_only for p, i in zip(series, idle)]
    if any(speeds):
        ax3.plot(xs, [v.all if v else nan for v in speeds], "k.-", lw=1.6, label="serving version's requests")
    for domain in sorted({d for v in speeds if v for d in v.by_domain}):
        ax3.plot(xs, [v.by_domain.get(domain, nan) if v else nan for v in speeds], ".--", lw=1.0,
                 label=f"serving version's requests: {domain}")
    ax3.axhline(1.0, color="grey", lw=1.0, ls=":")
    ax3.annotate("target-only", (0.0, 1.0), xycoords=("axes fraction", "data"), fontsize=7, color="grey", va="bottom",
                 xytext=(3, 1), textcoords="offset points")
    top = max([p.acceptance or 0.0 for p in series] + [v for p in series for v in p.domains.values()] + [0.05])
    ax1.set_ylim(0, min(1.0, top * 1.15))
    ax2.set_ylim(bottom=0)
    palette = plt.get_cmap("tab10")
    for i, (start, end, version) in enumerate(version_spans(series)):
        points = [p.acceptance for p in series if p.version == version and start <= p.time <= end and p.acceptance is not None]
        mean = f" {sum(points) / len(points):.3f}" if points else ""
        for ax in (ax1, ax2, ax3):
            ax.axvspan(when(start), when(end), color=palette(i % 10), alpha=0.12, lw=0)
        ax1.annotate(f"{version or 'no drafter'}{mean}", (when(start), 1.0), xycoords=("data", "axes fraction"), fontsize=8,
                     va="top", ha="left", xytext=(3, -3), textcoords="offset points")
    colours = {"swap": "green", "rollback": "red", "promote": "purple"}
    for t, kind, version in markers:
        for ax in (ax1, ax2, ax3):
            ax.axvline(when(t), color=colours.get(kind, "grey"), ls="--", lw=0.8)
        ax2.annotate(f"{kind} {version}", (when(t), 0.97), xycoords=("data", "axes fraction"), fontsize=7, rotation=90, va="top")
    ax1.set_ylabel("acceptance (accepted / drafted)")
    ax2.set_ylabel("tokens/s")
    ax3.set_ylabel("x target-only")
    ax3.set_ylim(bottom=0)
    if ax3.get_legend_handles_labels()[0]:
        ax3.legend(loc="upper right", fontsize=7)
    ax3.set_xlabel("wall-clock time (shaded: the drafter version serving, with its mean acceptance; gaps: no traffic)")
    ax3.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
    ax1.legend(loc="upper right", fontsize=7)
    ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
