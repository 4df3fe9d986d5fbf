"""The soak: the default stack under steady mixed traffic and a schedule of faults for hours (2 by default), watched
every 30 s and checked at the end: nothing lost, nothing growing.

The stack is what users run: `dvi up --detach` on the defaults (embedded broker, local MLflow, `dvi serve` on vLLM,
`dvi train`) plus a second serving replica that this benchmark supervises itself (`dvi.cli.up.Supervisor`, the one
`dvi up` runs), all on one cache of their own (<out>/cache; the demo models are linked in from the user's cache,
read only). The two replicas share the machine as the README says replicas on one machine should: each pins its
engine to its own half of the cores (`serve.vllm.cpu_bind`; unless the overrides name a binding): two engines pinned
to the same cores starve one that restarts beside the other (`benchmarks.bench_restart`); the second starts beside the
first, once `dvi up`'s broker is ready. The broker keeps its data
on disk (`stream.data_dir` in the cache): a killed broker comes back with what it acknowledged, which is what "every
acknowledged record is trained exactly once" is checked against. It keeps the decision topic's records
`--retention-hours` (0.5; the stack's default is a week): its store holds what that retention keeps, and is judged
at that size, within the run.

Traffic: chat and completion prompts of three domains (code, prose, qa; `benchmarks.workloads`), greedy and
sampled, a third of them streamed, some clients hanging up after the first streamed chunk; the number of clients
steps through 1, 2, 4, 8, 4, 2 every `--step-min` minutes; each request goes to a replica that answered its last
health check, round robin.

Faults, one every `--fault-every-min` minutes, in turn: the trainer, the broker, MLflow and the first replica
killed with SIGKILL (the part's own process: what it had started is left for `dvi up` to find), then `dvi up`
itself (SIGKILL, as an out-of-memory kill; a new `dvi up --detach` must stop what the dead one left and start
cleanly). Once, between the fourth and fifth fault, a hostile burst: malformed, oversized and compressed-bomb
records on the decision topic, an unsigned, a forged and a replayed control message, abusive HTTP.

Every `--interval-s` (30) a row: resident memory and open descriptors of every process (each part with its whole
process tree), request latency p50/p99 and errors by kind in the interval, records sent and dropped by the replicas,
the trainer's counters and consumer lag (from MLflow), dead-lettered records, versions published, swaps and
rollbacks, live acceptance and the served version of each replica. Written to <out>/soak.json, drawn to
<out>/soak.png.

A killed part that is not back within `--recover-max-min` (20) minutes, or a new `dvi up` that fails, is given up
on: the fault is recorded as never recovered and the run goes on. If the broker does not answer at the end, the
final check starts it alone on the run's data (which holds what it acknowledged) to read the topic.

Checked at the end (traffic stopped, the trainer given `--drain-min` to catch up), printed as a table and written
to <out>/soak.md: every killed part came back; every record on the topic is in the trainer's ledger exactly once (the
topic as read at the end and as followed through the run, every 30 s, by a reader with no group: a retention shorter
than the run, `stream.retention_hours`, removes records before the end); no request failed but those in
flight at a killed replica (which got an error) or sent to one that was down; per process, each life of it (a part
restarted is a new life), resident memory and descriptors flat over the last hour of that life after its warm-up
(in a run under two hours: as long as half the run), judged where the life covers at least half of that: the
second half's median within 5% of the first half's and the trend rising at most 5% across it; p99 latency of the last hour within 1.2x of the first
hour's after warm-up; the served drafter never a version the gate refused or a control message the signature
check refused; after the supervisor's kill nothing it had started was left running; nothing written outside the
cache directory (home, /tmp and the work tree looked at).

The stack compiles vLLM's graphs into its own cache at its first start (about 100 s of a replica's start on 2 cores);
`--compile-cache DIR` copies a compile cache that earlier starts left (`~/.cache/dvi/compile`) into the run's first,
for runs about faults rather than first starts (the suite's quick run; `dvi up`'s first start is tests/dvi/cli/test_up.py's).

Run (alone on the machine): .venv/bin/python -m benchmarks.soak [--minutes 120] [--quick] [--out DIR] [overrides]
`--quick`: 3.5 minutes, the five faults and the burst once each, a fault every 30 s (or, if later, once the one
before has recovered; the run goes on until the last has, at most 12 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from benchmarks.bench_restart import halves
from benchmarks.workloads import prompts
from dvi import store
from dvi.cli.up import Part, Supervisor, children_dir, running_pid
from dvi.config import load_config, scratch_dir
from dvi.drafters import shipped_version
from dvi.models import default_cache_dir
from dvi.procs import REGISTRY_ENV, free_port, http_ok, start_time

FAULTS = ("train", "broker", "mlflow", "serve", "up")  # killed in this order, one every fault_every_min
DOMAINS = ("code", "prose", "qa")
CONCURRENCY = (1, 2, 4, 8, 4, 2)  # clients, a step every step_min
FLAT = 0.05  # memory and descriptors: at most this growth over the checked window
P99_RATIO = 1.2  # p99 latency of the last hour against the first's
REPLICA_OF = {"serve": "r1", "r2:r2": "r2"}  # a replica's server process, by its name in the rows
HOSTILE_VERSION = "hostile-v1"  # the version the burst's unsigned and forged messages announce


@dataclass
class Options:
    minutes: float = 120.0
    fault_every_min: float = 20.0
    step_min: float = 2.0
    interval_s: float = 30.0
    warmup_min: float = 10.0
    drain_min: float = 15.0
    out: Path = field(default_factory=lambda: Path(f"/tmp/dvi-soak-{time.strftime('%Y%m%d-%H%M%S')}"))
    faults: tuple[str, ...] = FAULTS  # the kills, in turn
    max_minutes: float | None = None  # how long a fault still recovering may stretch the run (None: twice `minutes`)
    recover_max_min: float = 20.0  # a part not back this long after its kill is given up on (recorded; the run goes on)
    outside_ignore: tuple[str, ...] = ()  # path prefixes the writes check leaves out (another program's on the host)
    # the decision topic's retention (`stream.retention_hours`; the stack's default is a week): shorter than the run,
    # so that the broker's store reaches the size it keeps within it (a week's growth is not seen in two hours)
    retention_hours: float = 0.5
    compile_from: Path | None = None  # a compile cache copied into the run's before the stack starts (None: compile cold)

    @classmethod
    def quick(cls, out: Path | None = None) -> Options:
        """Each fault once, back to back: a kill once the one before has recovered, 30 s apart at the least (the
        trainer's, the broker's and MLflow's recoveries take 15 to 35 s; the longest, a replica's and `dvi up`'s, one
        and a half to three minutes with a warm compile cache, and the run lasts as long as they need)."""
        return cls(minutes=3.5, fault_every_min=0.5, step_min=0.5, interval_s=10.0, warmup_min=1.0, drain_min=5.0,
                   max_minutes=12.0, recover_max_min=8.0, **({"out": out} if out else {}))

    def fault_at(self) -> list[tuple[float, str]]:
        """(seconds from the start, fault) of the schedule: `faults` in turn, then again, while the run lasts; the
        hostile burst halfway between the fourth and the fifth (by then the control topic holds signed messages, one
        of which it replays)."""
        every, end = self.fault_every_min * 60, self.minutes * 60
        at = [(every * (i + 1), self.faults[i % len(self.faults)]) for i in range(int(end // every)) if every * (i + 1) < end - 30]
        return sorted(at + [(every * 4.5, "hostile")])


# ----------------------------------------------------------------------------------------------
# Pure figures.


def initial(version: str) -> bool:
    """A drafter a replica may serve without the gate: one it started with (the shipped bootstrap drafter, or one built
    untrained from the target)."""
    return version == shipped_version() or version.startswith("init-")


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, per minute."""
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60.0 * sum((t - mt) * (v - mv) for t, v in samples) / var if var else 0.0


def flatness(samples: list[tuple[float, float]]) -> dict | None:
    """How a (seconds, value) series over a window grows: the second half's median over the first half's, and the
    trend line's rise across the window as a share of the first half's median. None with under 4 samples."""
    if len(samples) < 4:
        return None
    samples = sorted(samples)
    t0, t1 = samples[0][0], samples[-1][0]
    mid = (t0 + t1) / 2
    first, second = [v for t, v in samples if t < mid], [v for t, v in samples if t >= mid]
    base = statistics.median(first)
    if not base:
        return {"median_ratio": 1.0, "growth": 0.0, "slope_per_min": 0.0, "first": 0.0, "second": statistics.median(second)}
    slope = slope_per_min(samples)
    return {"median_ratio": statistics.median(second) / base, "growth": slope * (t1 - t0) / 60 / base,
            "slope_per_min": slope, "first": base, "second": statistics.median(second)}


def is_flat(f: dict | None) -> bool | None:
    return None if f is None else f["median_ratio"] <= 1 + FLAT and f["growth"] <= FLAT


def lives(rows: list[dict], span_s: float, warmup_s: float) -> list[dict]:
    """Every process of a run's rows (a name and a pid: a restarted part is a new life) over the last `span_s` of
    its life after its warm-up: `warmup_s` from when it was first seen, and for a replica's server from when it was
    first seen serving and at least until its first swap (from then on it holds two drafters: the serving one and
    the one before, kept for a rollback). Memory and descriptors are judged (`flatness`) where those samples span at
    least half of `span_s`; otherwise "rss" and "fds" are None. Ordered by name, then by when each life began."""
    seen: dict[tuple[str, int], list] = defaultdict(list)
    warm_at: dict[tuple[str, int], float] = {}  # life -> when its warm-up ends
    serving: dict[tuple[str, int], tuple[float, str]] = {}  # a replica's server -> when it first served, and which drafter
    swapped: dict[tuple[str, int], float] = {}  # a replica's server -> when it first served another drafter
    for row in rows:
        for name, p in row["procs"].items():
            life = (name, p["pid"])
            seen[life].append((row["t"], p["rss_mib"], p["fds"]))
            if name not in REPLICA_OF:
                warm_at.setdefault(life, row["t"] + warmup_s)
            elif (health := (row.get("replicas") or {}).get(REPLICA_OF[name])) is not None:
                since, first = serving.setdefault(life, (row["t"], health.get("version")))
                if health.get("version") != first:
                    swapped.setdefault(life, row["t"])
                warm_at[life] = max(since + warmup_s, swapped.get(life, -math.inf))
    out = []
    for (name, pid), s in seen.items():
        warm = [x for x in s if x[0] >= warm_at.get((name, pid), math.inf)]
        mine = [x for x in warm if x[0] >= warm[-1][0] - span_s] if warm else []
        judged = bool(mine) and mine[-1][0] - mine[0][0] >= span_s / 2
        out.append({"name": name, "pid": pid, "first_t": s[0][0], "last_t": s[-1][0], "samples": len(mine),
                    "from_t": mine[0][0] if mine else None, "to_t": mine[-1][0] if mine else None,
                    "rss": flatness([(t, r) for t, r, _ in mine]) if judged else None,
                    "fds": flatness([(t, f) for t, _, f in mine]) if judged else None})
    return sorted(out, key=lambda p: (p["name"], p["first_t"]))


def last_hour(end: float, warmup_s: float) -> float:
    """Where the checked window of a run ending at `end` (seconds) begins: its last hour, its second half in a run
    under two hours, never inside the warm-up."""
    return max(end - 3600, end / 2, warmup_s)


def run_end(rows: list[dict], minutes: float) -> float:
    """When a run of `minutes` ended (seconds): later than planned while a fault was recovering."""
    return max(minutes * 60, rows[-1]["t"] if rows else 0.0)


def judged_lives(rows: list[dict], end: float, warmup_s: float) -> tuple[list[dict], list[str]]:
    """`lives` of a run's rows over as long as its checked window (`last_hour` of a run ending at `end`), and the
    names of which no life was long enough to judge."""
    procs = lives(rows, end - last_hour(end, warmup_s), warmup_s)
    return procs, sorted({p["name"] for p in procs} - {p["name"] for p in procs if p["rss"] is not None})


def all_flat(procs: list[dict], key: str) -> bool | None:
    """Whether every judged life (`lives`) is flat in `key` ("rss" or "fds"); None when none was judged."""
    judged = [is_flat(p[key]) for p in procs if p[key] is not None]
    return all(judged) if judged else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def exactly_once(topic: list[tuple[int, int, str]], ledger: list[tuple[str, str]], offsets: dict[int, int]) -> dict:
    """The trainer's ledger against the topic's records (partition, offset, record id), given the offsets its
    checkpoint committed (partition -> the next offset it reads). A record below its partition's committed offset
    must be in the ledger: if not, it is lost. One at or past it is pending: the next trainer start reads it (and
    its ledger skips one already trained). No id may be in the ledger twice, nor one that is not on the topic."""
    counts = Counter(rid for rid, _ in ledger)
    ids = {rid for _, _, rid in topic}
    lost = sorted(rid for p, o, rid in topic if o < offsets.get(p, 0) and rid not in counts)
    pending = [rid for p, o, rid in topic if o >= offsets.get(p, 0) and rid not in counts]
    twice = sorted(r for r, n in counts.items() if n > 1)
    return {"on_topic": len(topic), "in_ledger": len(counts), "lost": lost[:20], "lost_n": len(lost), "pending_n": len(pending),
            "twice": twice[:20], "twice_n": len(twice), "unknown_n": len(set(counts) - ids),
            "topic_duplicates": len(topic) - len(ids)}


# ----------------------------------------------------------------------------------------------
# Processes.


def unrecovered(faults: list[dict]) -> list[str]:
    """The kills of a run whose part never came back ('broker at 40.0 min'); the hostile burst is no kill."""
    return [f"{f['fault']} at {f['t'] / 60:.1f} min" for f in faults if f["fault"] != "hostile" and f.get("recovered_s") is None]


def tree(pid: int, apart: frozenset[int] = frozenset()) -> list[int]:
    """`pid` and every process below it (from /proc), but those in `apart` and theirs (counted on their own)."""
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    frontier += [c for c in map(int, f.read().split()) if c not in apart]
        except OSError:
            continue
    return out


def usage(pid: int, apart: frozenset[int] = frozenset()) -> tuple[float, int, float] | None:
    """Resident MiB, open descriptors and the resident MiB backed by files or shared memory (mapped model and weight
    files, vLLM's shared buffers; the rest is the heaps') of `pid`'s tree (`tree`); None when it is gone."""
    rss, fds, shared, alive = 0.0, 0, 0.0, False
    page_mib = os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    for p in tree(pid, apart):
        try:
            with open(f"/proc/{p}/statm") as f:
                _, resident, backed, *_ = map(int, f.read().split())
            fds += len(os.listdir(f"/proc/{p}/fd"))
            rss, shared, alive = rss + resident * page_mib, shared + backed * page_mib, True
        except OSError:
            continue
    return (rss, fds, shared) if alive else None


def proc_brief(pid: int) -> dict | None:
    """What the kernel says of `pid`: its command, state, the CPUs it may run on, seconds its main thread ran on one and
    waited for one (/proc/<pid>/schedstat); None when it is gone."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        ran_ns, waited_ns, _ = map(int, Path(f"/proc/{pid}/schedstat").read_text().split())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, ValueError):
        return None
    return {"pid": pid, "cmd": cmd[:160], "state": status.get("State", "").strip(), "cpus": status.get("Cpus_allowed_list", "").strip(),
            "ran_s": round(ran_ns / 1e9, 1), "waited_s": round(waited_ns / 1e9, 1)}


def registry(folder: Path) -> dict[str, dict]:
    """The processes a supervisor recorded (`dvi.procs`), by name ("serve", "broker/tansu": a part's own children
    under the part's name)."""
    entries = []
    for path in Path(folder).glob("*.json"):
        try:
            entries.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    by_pid = {e["pid"]: e for e in entries}
    out = {}
    for e in entries:
        parent = by_pid.get(e.get("parent"))
        name = e["name"] if parent is None else f"{parent['name']}/{e['name']}"
        out[name] = e
    return out


# ----------------------------------------------------------------------------------------------
# Traffic.


def replica_binds(overrides: list[str], cores: list[int]) -> dict[str, list[str]]:
    """The overrides that give each replica its own half of `cores` (serve.vllm.cpu_bind); none where `overrides` name
    a binding already, or on a single core."""
    if len(cores) < 2 or any(o.split("=", 1)[0].lstrip("+~") == "serve.vllm.cpu_bind" for o in overrides):
        return {"r1": [], "r2": []}
    first, second = halves(cores)
    return {"r1": [f"serve.vllm.cpu_bind={first}"], "r2": [f"serve.vllm.cpu_bind={second}"]}


def stream_end(events: list[str]) -> str:
    """How a streamed completion's `data:` events end: 'complete' (a finish_reason, then [DONE]), 'error' (an error
    event: dvi.serving.api's {"error": {...}}), or 'truncated' (it just stopped). An event that is not JSON raises."""
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    if any("error" in c for c in chunks):
        return "error"
    finished = any((c.get("choices") or [{}])[0].get("finish_reason") for c in chunks)
    return "complete" if events and events[-1] == "[DONE]" and finished else "truncated"


@dataclass
class Outcome:
    start: float  # seconds from the run's start
    end: float
    replica: str
    kind: str  # "ok", "hung up" (a client that left on purpose), or what went wrong


class Traffic:
    """Client threads sending the mixed workload to the replicas that are up."""

    def __init__(self, urls: dict[str, str], t0: float, seed: int = 0):
        self.urls, self.t0 = urls, t0
        self.up = set(urls)  # replicas that answered their last health check
        self.outcomes: list[Outcome] = []
        self.clients = 0  # how many of the threads send now
        self._stop = threading.Event()
        self._lock = threading.Lock()
        rng = random.Random(seed)
        self.work = [(d, p) for d in DOMAINS for p in prompts(d, "live", seed=seed)]
        rng.shuffle(self.work)
        self._next = 0
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(max(CONCURRENCY))]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(600)

    def _pick(self) -> tuple[str, object, int] | None:
        with self._lock:
            up = sorted(self.up)
            if not up:
                return None
            i = self._next
            self._next += 1
        return up[i % len(up)], self.work[i % len(self.work)][1], i

    def _client(self, index: int) -> None:
        while not self._stop.is_set():
            if index >= self.clients or (job := self._pick()) is None:
                time.sleep(0.5)
                continue
            name, prompt, i = job
            stream = i % 3 == 0
            hang_up = stream and i % 12 == 0
            body = prompt.body(16 + 8 * (i % 5), temperature=(0.0, 0.7, 1.0)[i % 3], stream=stream)
            start = time.monotonic() - self.t0
            kind = self._send(self.urls[name] + prompt.path, body, stream, hang_up)
            with self._lock:
                self.outcomes.append(Outcome(start, time.monotonic() - self.t0, name, kind))

    @staticmethod
    def _send(url: str, body: dict, stream: bool, hang_up: bool) -> str:
        try:
            with requests.post(url, json=body, timeout=600, stream=stream) as r:
                if r.status_code != 200:
                    return f"HTTP {r.status_code}"
                if not stream:
                    r.json()["choices"][0]
                    return "ok"
                events = []
                for line in r.iter_lines(decode_unicode=True):
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if hang_up:
                            return "hung up"
                end = stream_end(events)
                return "ok" if end == "complete" else f"stream {end}"
        except requests.ConnectionError as e:
            return "connection refused" if "refused" in str(e).lower() else "connection error"
        except requests.RequestException as e:
            return type(e).__name__
        except (ValueError, KeyError, IndexError):
            return "bad answer"


# ----------------------------------------------------------------------------------------------
# The hostile burst.


def send_acked(producer, topic: str, value: bytes, headers=None, tries: int = 5) -> str | None:
    """Send one message and wait for the broker's acknowledgement, again (up to `tries`) after an error the broker
    answered: the durable broker answers some produces with UnknownError, which the replicas' producers count and send
    again (`records.errors` in the rows). None once acknowledged, else the last error's name."""
    from kafka.errors import KafkaError

    last = None
    for attempt in range(tries):
        try:
            producer.send(topic, value, headers=headers).get(timeout=30)
            return None
        except KafkaError as e:
            last = type(e).__name__
            time.sleep(attempt + 1)
    return last


def hostile_burst(cfg, urls: list[str]) -> dict:
    """Malformed, oversized and compressed-bomb records on the decision topic; an unsigned, a forged and a replayed
    control message; abusive HTTP to each replica. Returns what was sent and what each HTTP request got."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from kafka import KafkaProducer

    from dvi import control, keys, records_v1
    from dvi.records import READS

    sent: dict = {"records": 0, "control": 0, "not acknowledged": Counter(), "http": Counter()}
    producer = KafkaProducer(bootstrap_servers=cfg.stream.bootstrap, max_request_size=4 << 20)
    try:
        # control first: in one run, sent after the records, every control message met UnknownError from the durable
        # broker five times (as did two of the records), and the replicas' signature check went untried
        # the newest signed control message, sent again: a replay
        signed = [m.value for m in read_to_end(cfg.stream.bootstrap, cfg.stream.control_topic, 120)
                  if b'"signature"' in m.value]  # a publish, or a replica's verdict
        msg = control.DrafterPublished(version=HOSTILE_VERSION, uri="/etc", sha256="0" * 64)
        forged_keys = keys.Keys(signing={"trainer": Ed25519PrivateKey.generate()})  # a trainer key no replica trusts
        for data in [control.encode(msg), control.encode(msg, forged_keys), *signed[-1:]]:
            if (error := send_acked(producer, cfg.stream.control_topic, data)) is None:
                sent["control"] += 1
            else:
                sent["not acknowledged"][error] += 1
        v1 = [("content-type", READS[1].encode())]
        payload = b"\0" * (64 << 20)
        bomb = struct.pack("<4sHHI", records_v1.MAGIC, 1, 0, len(payload)) + zlib.compress(payload, 9)
        for value, headers in [(b"\x00garbage", None), (os.urandom(3000), v1), (bomb, v1), (b"{" * (900 << 10), None),
                               (struct.pack("<4sHHI", records_v1.MAGIC, 1, 0, 1 << 31) + b"x" * 64, v1)]:
            if (error := send_acked(producer, cfg.stream.topic, value, headers)) is None:
                sent["records"] += 1
            else:
                sent["not acknowledged"][error] += 1
        sent["replayed"] = len(signed[-1:])
    finally:
        producer.close(timeout=10)
    abuse = [("/v1/completions", b"{not json"), ("/v1/completions", json.dumps({"prompt": 5, "max_tokens": "x"}).encode()),
             ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 10 ** 9}).encode()),
             ("/v1/chat/completions", json.dumps({"messages": "nope"}).encode()),
             ("/v1/completions", b'{"prompt": "' + b"a" * (8 << 20) + b'"}'), ("/../../etc/passwd", b"")]
    for url in urls:
        for path, data in abuse:
            try:
                r = requests.post(url + path, data=data, headers={"Content-Type": "application/json"}, timeout=60)
                sent["http"][f"{path[:20]} -> {r.status_code}"] += 1
            except requests.RequestException as e:
                sent["http"][f"{path[:20]} -> {type(e).__name__}"] += 1
    sent["http"], sent["not acknowledged"] = dict(sent["http"]), dict(sent["not acknowledged"])
    return sent


# ----------------------------------------------------------------------------------------------
# The run.


class Soak:
    def __init__(self, opt: Options, overrides: list[str], say=print):
        self.opt, self.say = opt, say
        self.work = opt.out.expanduser().resolve()
        self.cache = self.work / "cache"
        (self.cache / "logs").mkdir(parents=True, exist_ok=True)
        models = default_cache_dir() / "models"
        if models.is_dir() and not (self.cache / "models").exists():
            (self.cache / "models").symlink_to(models, target_is_directory=True)
        if opt.compile_from is not None and opt.compile_from.is_dir() and not (self.cache / "compile").exists():
            shutil.copytree(opt.compile_from, self.cache / "compile")  # a copy: the run writes nothing outside its cache
        os.environ["DVI_CACHE"] = str(self.cache)
        if scratch_dir() is None:  # dvi's processes would fall back to /tmp, and the check of writes outside the cache fail
            raise SystemExit(f"soak: the cache {self.cache} is too deep: its scratch folder leaves no room for a socket's "
                             "name (dvi.config.scratch_dir); give --out a shorter path")
        self.overrides = [f"stream.data_dir={self.cache / 'broker'}", f"stream.retention_hours={opt.retention_hours}",
                          "trainer.log_every=1", *overrides]
        self.cfg = load_config(self.overrides)
        self.binds = replica_binds(overrides, sorted(os.sched_getaffinity(0)))
        self.port2 = free_port()
        self.urls = {"r1": f"http://{self.cfg.serve.host}:{self.cfg.serve.port}", "r2": f"http://{self.cfg.serve.host}:{self.port2}"}
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.faults: list[dict] = []
        self.served: dict[str, set] = defaultdict(set)
        self.counters: dict[str, dict] = defaultdict(dict)  # replica -> pid -> its last health (counters restart with it)
        self.orphans: list[str] = []
        self.hostile: dict = {}
        self.final_broker: dict = {}  # the final read of the topic: how long it took, what it found

    def now(self) -> float:
        return time.monotonic() - self.t0

    def up(self, seen: dict | None = None) -> None:
        """`dvi up --detach` on the soak's cache (a `dvi up` killed before has what it left stopped first). With `seen`,
        what the kernel says of its processes while it starts (`proc_brief`, the last few looks, every 30 s) and the
        CPUs this thread (whose affinity its child inherits) may run on go there: a start that does not get going says
        why."""
        if seen is not None:
            seen.update(caller_cpus=sorted(os.sched_getaffinity(0)), looks=[])
        proc = subprocess.Popen([sys.executable, "-m", "dvi.cli", "up", "--detach", *self.overrides, *self.binds["r1"]],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, REGISTRY_ENV: ""})
        deadline = time.monotonic() + 1200
        while True:
            if seen is not None:
                seen["looks"] = [*seen["looks"][-4:], {"t": round(self.now(), 1),
                                                       "procs": [b for q in tree(proc.pid) if (b := proc_brief(q))]}]
            try:
                stdout, _ = proc.communicate(timeout=30)  # goes on collecting the output where a timed-out one stopped
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    proc.kill()
                    stdout, _ = proc.communicate()
                    break
        for line in stdout.splitlines():
            if "stopped what an earlier" in line or "detached" in line:
                self.say(f"soak: {line}")
        if proc.returncode:
            raise RuntimeError(f"dvi up --detach failed ({proc.returncode}): {stdout[-2000:]}")

    def health(self, name: str) -> dict | None:
        try:
            r = requests.get(self.urls[name] + "/dvi/health", timeout=5)
            return r.json() if r.status_code == 200 else None
        except (requests.RequestException, ValueError):
            return None

    def kill(self, fault: str) -> dict:
        """SIGKILL one part (its own process) or `dvi up` itself; returns what was killed."""
        up_pid = running_pid(self.cache)
        if fault == "up":
            before = {n: (e["pid"], e["start"]) for n, e in registry(children_dir(self.cache)).items()}
            os.kill(up_pid, signal.SIGKILL)
            return {"pid": up_pid, "left": before}
        entry = registry(children_dir(self.cache)).get(fault)
        if entry is None:
            raise RuntimeError(f"no {fault} recorded in {children_dir(self.cache)}")
        os.kill(entry["pid"], signal.SIGKILL)
        return {"pid": entry["pid"], "banners": self.train_banners()}

    def train_banners(self) -> int:
        """How many times the trainer has said it is ready (`dvi train:`, the line `dvi up` waits for) in its log."""
        try:
            return sum(line.startswith("dvi train:") for line in (self.cache / "logs" / "train.log").read_text(errors="replace").splitlines())
        except OSError:
            return 0

    def recovered(self, fault: str, killed: dict) -> bool:
        if fault == "up":  # a new `dvi up` said it is ready
            return killed.get("restarted") is not None and not killed["restarted"].is_alive() and self.health("r1") is not None
        entry = registry(children_dir(self.cache)).get(fault)
        if entry is None or entry["pid"] == killed["pid"]:
            return False
        if fault == "serve":
            return self.health("r1") is not None
        if fault == "mlflow":
            return http_ok(f"{self.cfg.tracking.tracking_uri}/health") is None
        if fault == "broker":
            from streams.broker import kafka_answers

            return kafka_answers(self.cfg.stream.bootstrap) is None
        return self.train_banners() > killed["banners"]

    def sample(self, traffic: Traffic, since: float) -> dict:
        t = self.now()
        procs = {}
        up_pid = running_pid(self.cache)
        named = {"up": {"pid": up_pid}} if up_pid else {}
        named.update(registry(children_dir(self.cache)))
        named.update({f"r2:{n}": e for n, e in registry(self.work / "r2.children").items()})
        recorded = frozenset(e["pid"] for e in named.values())  # each counted on its own, with what it started unrecorded
        for name, e in named.items():
            if (u := usage(e["pid"], recorded)) is not None:
                procs[name] = {"pid": e["pid"], "rss_mib": round(u[0], 1), "fds": u[1], "file_mib": round(u[2], 1)}
        with traffic._lock:
            window = [o for o in traffic.outcomes if since <= o.end < t]
        lat = [o.end - o.start for o in window if o.kind == "ok"]
        replicas = {}
        for name in self.urls:
            h = self.health(name)
            if h is None:
                replicas[name] = None
                continue
            self.counters[name][h.get("pid")] = h
            self.served[name].add(h.get("drafter_version"))
            replicas[name] = {"version": h.get("drafter_version"), "acceptance": h.get("acceptance_rate"),
                              "control_refused": h.get("control_refused"), "events": h.get("events")}
        sums = Counter()
        for name, by_pid in self.counters.items():
            for h in by_pid.values():
                sums.update({k: v for k, v in (h.get("records") or {}).items() if isinstance(v, int)})
                sums.update({f"event/{k}": v for k, v in (h.get("events") or {}).items()})
        row = {"t": round(t, 1), "clients": traffic.clients, "procs": procs, "replicas": replicas,
               "requests": dict(Counter(o.kind for o in window)),
               "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
               "records": {k: sums[k] for k in ("sent", "dropped", "errors")},
               "events": {k[6:]: v for k, v in sums.items() if k.startswith("event/")},
               "published": len(store.versions(store.default_root(self.cfg)))}
        row.update(self.trainer_view())
        return row

    def trainer_view(self) -> dict:
        from dvi.tracking import loop_view

        try:
            view = loop_view(self.cfg.tracking, timeout_s=5)
        except Exception as e:  # a view for the record only: MLflow may be the part that is down
            return {"trainer": f"unreadable ({type(e).__name__})"}
        metrics = (view.get("trainer") or {}).get("metrics") or {}
        keep = ("count/trained", "count/held_out", "count/skipped", "count/duplicates", "count/dead_lettered", "consumer_lag",
                "buffer/pending", "buffer/pending_mb", "buffer/replay_mb", "buffer/holdout_mb",  # beside the trainer's memory
                "system/heap_in_use_mb", "system/heap_free_mb", "system/heap_mmap_mb", "system/py_blocks")  # kept, or fragments
        return {"trainer": {k: metrics[k]["value"] for k in keep if k in metrics} or view.get("error")}

    def run(self) -> dict:
        opt = self.opt
        outside_before = outside_files(self.work)
        self.say(f"soak: {opt.minutes:g} minutes, faults at {[(round(t / 60, 1), f) for t, f in opt.fault_at()]} min; out {self.work}")
        # the second replica starts beside the stack's serve, on its own half of the cores, once the broker is up
        log = self.cache / "logs" / "up.log"
        stack: dict = {"log": log, "from": log.stat().st_size if log.exists() else 0}  # this start's lines only
        starting = threading.Thread(target=self._start_stack, args=(stack,), daemon=True)
        starting.start()
        self.wait_broker(stack)
        if "error" in stack:
            raise stack["error"]
        os.environ[REGISTRY_ENV] = str(self.work / "r2.children")
        r2 = Supervisor([Part("r2", ["serve", f"serve.port={self.port2}", "stream.replica_id=r2", *self.binds["r2"]],
                              lambda _: http_ok(self.urls["r2"] + "/dvi/health"), 900)], self.overrides, self.cache / "logs",
                        say=lambda line: self.say(f"soak: {line}"), relay=False)
        try:
            r2.start()
        finally:
            starting.join()
        if "error" in stack:
            r2.stop()
            raise stack["error"]
        watch = TopicWatch(self.cfg.stream.bootstrap, self.cfg.stream.topic)
        watch.start()
        self.t0 = time.monotonic()
        traffic = Traffic(self.urls, self.t0)
        traffic.start()
        schedule = opt.fault_at()
        active: dict | None = None
        last_sample = 0.0
        try:
            # the run lasts its minutes, and longer (at most twice) while a fault of the schedule is due or recovering
            cap = 60 * (opt.max_minutes if opt.max_minutes is not None else 2 * opt.minutes)
            while self.now() < opt.minutes * 60 or ((schedule or active) and self.now() < cap):
                t = self.now()
                traffic.clients = CONCURRENCY[int(t // (opt.step_min * 60)) % len(CONCURRENCY)]
                traffic.up = {n for n in self.urls if self.health(n) is not None}
                r2.tick()
                if active is not None and self.recovered(active["fault"], active["killed"]):
                    active["recovered_s"] = round(self.now() - active["t"], 1)
                    if active["fault"] == "up":
                        active["left_running"] = left_running(active["killed"]["left"])
                        self.orphans += active["left_running"]
                    self.say(f"soak: {active['fault']} back after {active['recovered_s']} s")
                    active = None
                if active is not None and (why := self.given_up(active)):
                    active.update(recovered_s=None, gave_up_s=round(self.now() - active["t"], 1), gave_up=why)
                    self.say(f"soak: {active['fault']} not back after {active['gave_up_s']} s ({why}): given up; the run goes on")
                    active = None
                if active is not None and active["fault"] == "up" and "restarted" not in active["killed"]:
                    # what systemd's restart of a dead `dvi up` does, beside the traffic and the samples
                    active["killed"]["restarted"] = threading.Thread(target=self.restart_up, args=(active["killed"],), daemon=True)
                    active["killed"]["restarted"].start()
                if active is None and schedule and t >= schedule[0][0]:
                    _, fault = schedule.pop(0)
                    if fault == "hostile":
                        try:
                            self.hostile = hostile_burst(self.cfg, list(self.urls.values()))
                        except Exception as e:  # the burst could not be sent (the broker refusing it): said, and the run goes on
                            self.hostile = {"error": f"{type(e).__name__}: {e}"[:300]}
                        self.faults.append({"t": round(t, 1), "fault": "hostile", **self.hostile})
                        self.say(f"soak: hostile burst at {t / 60:.1f} min: {self.hostile}")
                    else:
                        try:
                            active = {"t": round(t, 1), "fault": fault, "killed": self.kill(fault)}
                        except (RuntimeError, ProcessLookupError, TypeError) as e:  # not running (a part given up on)
                            self.faults.append({"t": round(t, 1), "fault": fault, "recovered_s": None, "gave_up": f"not running: {e}"})
                            self.say(f"soak: {fault} not killed at {t / 60:.1f} min: not running ({e})")
                            continue
                        self.faults.append(active)
                        self.say(f"soak: SIGKILL {fault} (pid {active['killed']['pid']}) at {t / 60:.1f} min")
                if t - last_sample >= opt.interval_s:
                    self.rows.append(self.sample(traffic, last_sample))
                    last_sample = t
                    (self.work / "soak.json").write_text(json.dumps({"rows": self.rows, "faults": self.faults}, default=str))
                time.sleep(1.0)
            traffic.clients = 0
            traffic.stop()
            self.rows.append(self.sample(traffic, last_sample))
            drained = self.drain()
            watch.stop()
            r2.stop()
            self.down()  # the engines stopped: the final read has the machine (and the broker) to itself
            try:
                topic_ids, dead = self.final_topic()
            except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:  # the rest is still checked
                self.final_broker["error"] = str(e)[:500]
                self.say(f"soak: the topic could not be read back: {e}")
                topic_ids, dead = None, None
        finally:
            traffic.stop()
            watch.stop()
            r2.stop()
            self.down()
            os.environ.pop(REGISTRY_ENV, None)
        watched, vanished = watch.records(), []
        self.final_broker.update(watched=len(watched), watch_reads=watch.reads, watch_errors=watch.errors)
        if topic_ids is not None:  # what a retention removed before the end was seen by the watch
            kept_s = None if self.cfg.stream.retention_hours is None else self.cfg.stream.retention_hours * 3600
            topic_ids, vanished = merge_reads(watched, topic_ids, kept_s is not None and kept_s < self.now() + 600)
        ledger, offsets = read_ledger(self.cfg)
        outside = [p for p in outside_files(self.work, outside_before) if not p.startswith(opt.outside_ignore)]
        once = exactly_once(topic_ids, ledger, offsets) if topic_ids is not None else None
        if once is not None:
            once.update(vanished_n=len(vanished), vanished=[rid for _, _, rid in vanished[:20]])
        summary = self.summarize(traffic, once, dead, drained, outside)
        (self.work / "soak.json").write_text(json.dumps({"rows": self.rows, "faults": self.faults, "summary": summary,
                                                         "options": {k: str(v) for k, v in asdict(opt).items()},
                                                         "cpu_bind": self.binds}, default=str))
        (self.work / "soak.md").write_text(table(summary) + "\n")
        plot(self.rows, self.faults, str(self.work / "soak.png"))
        return summary

    def _start_stack(self, stack: dict) -> None:
        """`up` on a thread of its own: its failure goes into `stack["error"]`, and `stack["done"]` is set either way."""
        try:
            self.up()
        except BaseException as e:  # raised by run(), once the second replica's start has ended
            stack["error"] = e
        finally:
            stack["done"] = True

    @staticmethod
    def wait_broker(stack: dict, timeout_s: float = 1200) -> None:
        """Until the starting `dvi up` says its broker is ready (the lines of its log, `stack["log"]`, from
        `stack["from"]`) or its start has ended."""
        deadline = time.monotonic() + timeout_s
        while not stack.get("done") and time.monotonic() < deadline:
            if stack["log"].exists():  # dvi up appends to its log (`dvi.cli.up.detach`)
                with stack["log"].open("rb") as f:
                    f.seek(stack["from"])
                    if b"dvi up: broker ready" in f.read():
                        return
            time.sleep(0.5)

    def restart_up(self, killed: dict) -> None:
        """A new `dvi up --detach` after the supervisor's kill; its failure is recorded in `killed`, not raised."""
        killed["restart_seen"] = {}
        try:
            self.up(killed["restart_seen"])
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            killed["restart_error"] = str(e).splitlines()[0][:300]

    def given_up(self, active: dict) -> str | None:
        """Why a fault still recovering is given up on (the restart of `dvi up` failed, or `recover_max_min` passed),
        or None."""
        if active["killed"].get("restart_error"):
            return f"the new dvi up failed: {active['killed']['restart_error']}"
        if self.now() - active["t"] > self.opt.recover_max_min * 60:
            return f"not back within {self.opt.recover_max_min:g} minutes"
        return None

    def down(self) -> None:
        subprocess.run([sys.executable, "-m", "dvi.cli", "down", *self.overrides], capture_output=True, timeout=300)

    def final_topic(self) -> tuple[list[tuple[int, int, str]], int]:
        """The topic for the final check (`read_topic`), once the stack is down: the broker is started alone on the
        run's data (`dvi up --detach --only broker`; it kept what it acknowledged), as it is after a crash."""
        r = subprocess.run([sys.executable, "-m", "dvi.cli", "up", "--detach", "--only", "broker", *self.overrides],
                           capture_output=True, text=True, timeout=600, env={**os.environ, REGISTRY_ENV: ""})
        if r.returncode:
            raise RuntimeError(f"the broker alone on the run's data did not start ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
        t = time.monotonic()
        found = read_topic(self.cfg)
        self.final_broker = {"read_s": round(time.monotonic() - t, 1), "records": len(found[0]), "dead_lettered": found[1]}
        self.say(f"soak: the topic read back in {self.final_broker['read_s']} s: {len(found[0])} records, {found[1]} dead-lettered")
        return found

    def drain(self) -> dict:
        """Wait, traffic stopped, until the trainer has taken every record the replicas sent (its counters in MLflow),
        at most `drain_min`."""
        deadline, view = time.monotonic() + self.opt.drain_min * 60, {}
        sent = self.rows[-1]["records"]["sent"]
        while time.monotonic() < deadline:
            view = self.trainer_view().get("trainer")
            if isinstance(view, dict) and sum(view.get(k, 0) for k in ("count/trained", "count/held_out", "count/skipped",
                                                                            "count/duplicates")) >= sent:
                break
            time.sleep(10)
        return {"sent": sent, "trainer": view, "waited_s": round(self.opt.drain_min * 60 - (deadline - time.monotonic()))}

    def summarize(self, traffic: Traffic, once: dict | None, dead: int | None, drained: dict, outside: list[str]) -> dict:
        opt = self.opt
        end = run_end(self.rows, opt.minutes)
        # requests: failures are tolerated only at a replica that was down or being killed
        downs = []
        for f in self.faults:
            if f["fault"] in ("serve", "up"):
                back = f.get("recovered_s")
                downs.append(("r1", f["t"] - 1, end if back is None else f["t"] + back))
        tolerated, failed = Counter(), Counter()
        for o in traffic.outcomes:
            if o.kind in ("ok", "hung up"):
                continue
            at_down = any(o.replica == r and o.start <= b and o.end >= a for r, a, b in downs)
            (tolerated if at_down else failed)[o.kind] += 1
        window = last_hour(end, opt.warmup_min * 60)
        procs, unjudged = judged_lives(self.rows, end, opt.warmup_min * 60)  # each over the last hour of its life
        # latency: the last hour (half) against the first one after warm-up
        ok = [o for o in traffic.outcomes if o.kind == "ok"]
        first = [o.end - o.start for o in ok if opt.warmup_min * 60 <= o.start < min(opt.warmup_min * 60 + 3600, window)]
        last = [o.end - o.start for o in ok if o.start >= window]
        p99 = {"first": percentile(first, 99), "last": percentile(last, 99), "first_n": len(first), "last_n": len(last)}
        refused_versions = {HOSTILE_VERSION}
        published = set(store.versions(store.default_root(self.cfg)))
        served = {r: sorted(v - {None}) for r, v in self.served.items()}
        bad_served = sorted({v for vs in served.values() for v in vs} & refused_versions
                            | {v for vs in served.values() for v in vs if v not in published and not initial(v)})
        checks = {
            f"every killed part back (within {opt.recover_max_min:g} minutes)": not unrecovered(self.faults),
            "every record the trainer committed is in its ledger exactly once":
                None if once is None else once["lost_n"] == 0 and once["twice_n"] == 0 and once["unknown_n"] == 0
                and once.get("vanished_n", 0) == 0,
            "no request failed but at a killed replica": not failed,
            "memory flat (each process, the last hour of its life)": all_flat(procs, "rss"),
            "descriptors flat (each process, the last hour of its life)": all_flat(procs, "fds"),
            f"p99 latency of the last hour within {P99_RATIO}x of the first's":
                None if not (p99["first"] and p99["last"]) else p99["last"] <= P99_RATIO * p99["first"],
            "served only versions the gate and the signature allowed": not bad_served,
            "nothing left running by the killed supervisor": not self.orphans,
            "nothing written outside the cache": not outside,
        }
        return {"minutes": opt.minutes, "checks": checks, "requests": {"ok": sum(o.kind == "ok" for o in traffic.outcomes),
                "hung up": sum(o.kind == "hung up" for o in traffic.outcomes), "tolerated": dict(tolerated), "failed": dict(failed)},
                "exactly_once": once, "dead_lettered": dead, "drain": drained, "procs": procs, "unjudged": unjudged, "p99_s": p99,
                "served": served, "bad_served": bad_served, "published": len(published), "orphans": self.orphans,
                "outside": outside[:50], "faults": [{k: v for k, v in f.items() if k != "killed"} for f in self.faults],
                "unrecovered": unrecovered(self.faults), "final_broker": self.final_broker, "hostile": self.hostile}


def left_running(before: dict[str, tuple[int, str]]) -> list[str]:
    """Of the processes a killed `dvi up` had recorded, those still running (the same pid and start time)."""
    return [f"{name} (pid {pid})" for name, (pid, start) in before.items() if start_time(pid) == start]


def pending(c, tps: list, listed: dict, ends: dict) -> bool:
    """Whether a read of partitions `tps` by consumer `c` has more to read. A partition's end is the high watermark of
    its first fetch (or the end offset `listed` before the read, when that is higher), recorded in `ends` and kept for
    the read: Tansu's S3 engine answers a ListOffsets for the latest offset with one far behind what it holds (1 for a
    partition of five single-record batches, whose fetches say 5), so the listed end offsets alone stop a read early."""
    for tp in tps:
        if tp not in ends and (high := c.highwater(tp)) is not None:
            ends[tp] = max(high, listed[tp])
    return any(tp not in ends or c.position(tp) < ends[tp] for tp in tps)


def read_to_end(bootstrap: str, topic: str, deadline_s: float) -> list:
    """Every message of `topic`, read from the beginning up to the end each partition had when the read reached it
    (`pending`; not until an idle timeout: a loaded broker can take longer than any to answer a fetch). Raises
    TimeoutError when that is not done within `deadline_s`, naming how far each partition got."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_bytes=8 << 20,
                      max_partition_fetch_bytes=8 << 20)
    try:
        tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic) or []]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        listed, ends, found, deadline = c.end_offsets(tps), {}, [], time.monotonic() + deadline_s
        while pending(c, tps, listed, ends):
            if time.monotonic() > deadline:
                at = {tp.partition: f"{c.position(tp)}/{ends.get(tp, listed[tp])}" for tp in tps}
                raise TimeoutError(f"{topic} not read to its end offsets within {deadline_s:g} s: {at}")
            for tp, batch in c.poll(timeout_ms=1000).items():  # a partition's first fetch lies below the end it sets
                found += [m for m in batch if m.offset < ends.get(tp, math.inf)]
        return found
    finally:
        c.close()


class TopicWatch:
    """The decision topic as the run goes: every `every_s` seconds a reader with no group reads on from where it
    stopped (from the beginning, the first time) and keeps the (partition, offset, record id) of every decodable record.
    A retention shorter than the run (`stream.retention_hours`) removes records before the final read; what it removed
    was seen here first, and the final check takes both. While the broker is down a read fails and is counted
    (`errors`); the next one goes on from where the last stopped."""

    IDLE_POLLS = 5  # a read ends after this many empty polls (a partition whose records all expired has none to give)

    def __init__(self, bootstrap: str, topic: str, every_s: float = 30.0):
        self.bootstrap, self.topic, self.every_s = bootstrap, topic, every_s
        self.found: dict[tuple[int, int], str] = {}
        self.next: dict[int, int] = {}  # partition -> the next offset to read
        self.reads, self.errors = 0, 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="topic-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(180)

    def records(self) -> list[tuple[int, int, str]]:
        with self._lock:
            return [(p, o, rid) for (p, o), rid in sorted(self.found.items())]

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.read_once()
            except Exception:  # the broker down or restarting (kafka-python's errors, OSError): the next read goes on
                self.errors += 1

    def read_once(self, deadline_s: float = 120.0) -> None:
        from kafka import KafkaConsumer, TopicPartition

        c = KafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False, request_timeout_ms=30000)
        try:
            tps = [TopicPartition(self.topic, p) for p in sorted(c.partitions_for_topic(self.topic) or [])]
            c.assign(tps)
            for tp in tps:
                if tp.partition in self.next:
                    c.seek(tp, self.next[tp.partition])
                else:
                    c.seek_to_beginning(tp)
            listed, ends, idle, deadline = c.end_offsets(tps), {}, 0, time.monotonic() + deadline_s
            while idle < self.IDLE_POLLS and time.monotonic() < deadline and pending(c, tps, listed, ends):
                batches = c.poll(timeout_ms=1000)
                idle = 0 if batches else idle + 1
                for batch in batches.values():
                    for m in batch:
                        rid = record_id(m.value)
                        with self._lock:
                            if rid is not None:
                                self.found[(m.partition, m.offset)] = rid
                            self.next[m.partition] = m.offset + 1
            self.reads += 1
        finally:
            c.close()


def merge_reads(watched: list[tuple[int, int, str]], final: list[tuple[int, int, str]],
                retained: bool) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """The topic for the final check from the watch's reads during the run and the final read (partition, offset,
    record id): (records, vanished). A watched record the final read lacks is one a retention removed (`retained`)
    when it lies below the final read's first offset in its partition (or the partition has none left), and is then
    counted; any other is `vanished`: acknowledged, read, and gone, which nothing explains."""
    first: dict[int, int] = {}
    for p, o, _ in final:
        first[p] = min(first.get(p, o), o)
    have = {(p, o) for p, o, _ in final}
    expired, vanished = [], []
    for p, o, rid in sorted(watched):
        if (p, o) not in have:
            (expired if retained and o < first.get(p, math.inf) else vanished).append((p, o, rid))
    return sorted(final + expired), vanished


def record_id(value: bytes) -> str | None:
    """The id of an encoded decision record; None for bytes that are not one (hostile: the trainer dead-letters them)."""
    from dvi.record_codec import decode

    try:
        return decode(value).record_id
    except Exception:
        return None


def read_topic(cfg, deadline_s: float = 1800) -> tuple[list[tuple[int, int, str]], int]:
    """(partition, offset, record id) of every decodable record on the decision topic, and how many messages the
    dead-letter topic holds."""
    found = [(m.partition, m.offset, rid) for m in read_to_end(cfg.stream.bootstrap, cfg.stream.topic, deadline_s)
             if (rid := record_id(m.value)) is not None]
    return found, len(read_to_end(cfg.stream.bootstrap, cfg.stream.dlq_topic, deadline_s))


def read_ledger(cfg) -> tuple[list[tuple[str, str]], dict[int, int]]:
    """The ledger (record id, fate) and the committed offsets (partition -> next offset) of the trainer's newest
    complete checkpoint."""
    from trainers import checkpoint

    run_dir = Path(cfg.trainer.run_dir).expanduser() if cfg.trainer.run_dir else Path(os.environ["DVI_CACHE"]) / "trainer"
    latest = checkpoint.latest(run_dir, clean=False)
    if latest is None:
        return [], {}
    state = json.loads((latest / checkpoint.STATE).read_text())
    topic = cfg.stream.topic + ":"
    offsets = {int(k[len(topic):]): int(v) for k, v in state.get("offsets", {}).items() if k.startswith(topic)}
    return [tuple(x) for x in state["ledger"]], offsets


def outside_files(work: Path, before: dict | None = None) -> dict | list[str]:
    """Files under home, /tmp and the work tree outside `work` (and the shared demo models): their mtimes (the first
    call), or those new or changed since `before`. Another program's writes on the host: `--outside-ignore`."""
    roots = [Path.home(), Path("/tmp"), Path.cwd()]
    skip = (str(work), "/tmp/bash_jobs", str(Path.home() / ".cache" / "dvi" / "models"))
    seen = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            if dirpath.startswith(skip) or "/.git" in dirpath or "/.venv" in dirpath or "__pycache__" in dirpath:
                dirnames[:] = []
                continue
            for f in filenames:
                p = os.path.join(dirpath, f)
                try:
                    seen[p] = os.stat(p).st_mtime_ns
                except OSError:
                    continue
    if before is None:
        return seen
    return sorted(p for p, m in seen.items() if before.get(p) != m)


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def procs_table(procs: list[dict], unjudged: list[str]) -> list[str]:
    """The lines of the table of process lives (`lives`): when each ran, over which minutes it was judged, and its
    memory and descriptor figures."""
    lines = ["| process | pid | ran, min | judged, min | RSS first/second half MiB | RSS trend MiB/min | fds first/second half "
             "| flat: memory, fds |", "|---|---|---|---|---|---|---|---|"]
    for p in procs:
        r, f = p["rss"] or {}, p["fds"] or {}
        judged = f"{p['from_t'] / 60:.1f}-{p['to_t'] / 60:.1f}" if p["rss"] is not None else "no (too short)"
        flat = ", ".join({True: "yes", False: "**no**", None: "-"}[is_flat(p[k])] for k in ("rss", "fds"))
        lines.append(f"| {p['name']} | {p['pid']} | {p['first_t'] / 60:.1f}-{p['last_t'] / 60:.1f} | {judged} | "
                     f"{_fmt(r.get('first'), 0)} / {_fmt(r.get('second'), 0)} | {_fmt(r.get('slope_per_min'), 2)} | "
                     f"{_fmt(f.get('first'), 0)} / {_fmt(f.get('second'), 0)} | {flat} |")
    if unjudged:
        lines += ["", f"No life long enough to judge memory and descriptors: {', '.join(unjudged)}."]
    return lines


def table(summary: dict) -> str:
    lines = [f"Soak of {summary['minutes']:g} minutes", "", "| check | holds |", "|---|---|"]
    lines += [f"| {name} | {'yes' if ok else ('-' if ok is None else '**no**')} |" for name, ok in summary["checks"].items()]
    once = summary["exactly_once"]
    records = ("Records: the topic could not be read back: " + summary.get("final_broker", {}).get("error", "?") + "."
               if once is None else
               f"Records: {once['on_topic']} on the topic, {once['in_ledger']} in the ledger, {once['lost_n']} lost, "
               f"{once['twice_n']} twice, {once['pending_n']} pending (past the committed offsets: the next start reads them)"
               + (f", {once['vanished_n']} read during the run and gone at the end with no retention to explain it"
                  if once.get("vanished_n") else "") + f"; {summary['dead_lettered']} dead-lettered.")
    lines += ["", f"{records} Requests: {summary['requests']}. "
              f"p99 latency first/last: {_fmt(summary['p99_s']['first'])} / {_fmt(summary['p99_s']['last'])} s. "
              f"{summary['published']} versions published; served {summary['served']}.", "",
              *procs_table(summary["procs"], summary.get("unjudged", []))]
    lines += ["", "| fault | at min | back after s |", "|---|---|---|"]
    lines += [f"| {f['fault']} | {f['t'] / 60:.1f} | "
              f"{_fmt(f.get('recovered_s'), 1) if 'gave_up' not in f else 'never: ' + f['gave_up']} |" for f in summary["faults"]]
    if summary.get("final_broker", {}).get("read_s") is not None:
        lines += ["", f"The stack stopped, the broker alone read the topic back in {summary['final_broker']['read_s']:g} s."]
    return "\n".join(lines)


def plot(rows: list[dict], faults: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] / 60 for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(11, 13), sharex=True)
    names = sorted({n for r in rows for n in r["procs"]})
    for name in names:
        axes[0].plot(t, [r["procs"].get(name, {}).get("rss_mib") for r in rows], label=name)
        axes[1].plot(t, [r["procs"].get(name, {}).get("fds") for r in rows], label=name)
    axes[0].set_ylabel("resident MiB (process tree)")
    axes[0].legend(fontsize=7, ncol=3)
    axes[1].set_ylabel("open descriptors")
    axes[2].plot(t, [r["p50_s"] for r in rows], label="p50")
    axes[2].plot(t, [r["p99_s"] for r in rows], label="p99")
    axes[2].set_ylabel("latency s")
    twin = axes[2].twinx()
    twin.step(t, [r["clients"] for r in rows], color="grey", alpha=0.4, where="post")
    twin.set_ylabel("clients")
    axes[2].legend(fontsize=8)
    axes[3].plot(t, [r["records"]["sent"] for r in rows], label="records sent")
    trained = [r["trainer"].get("count/trained") if isinstance(r.get("trainer"), dict) else None for r in rows]
    axes[3].plot(t, trained, label="trained (MLflow)")
    axes[3].plot(t, [r["published"] for r in rows], label="versions published")
    axes[3].set_ylabel("count")
    axes[3].set_yscale("symlog")
    axes[3].legend(fontsize=8)
    axes[3].set_xlabel("minutes")
    for ax in axes:
        for f in faults:
            ax.axvline(f["t"] / 60, color="red" if f["fault"] != "hostile" else "purple", alpha=0.3)
    axes[0].set_title("soak: red lines SIGKILL (" + ", ".join(f["fault"] for f in faults if f["fault"] != "hostile")
                      + "), purple the hostile burst")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--fault-every-min", type=float, default=None)
    p.add_argument("--drain-min", type=float, default=None, help="how long the trainer may catch up at the end (15)")
    p.add_argument("--faults", default=None, help=f"the kills in turn, from {','.join(FAULTS)} (all, in that order)")
    p.add_argument("--max-minutes", type=float, default=None, help="the longest a recovering fault may stretch the run")
    p.add_argument("--recover-max-min", type=float, default=None,
                   help="a killed part not back within this many minutes is given up on, and the run goes on (20)")
    p.add_argument("--retention-hours", type=float, default=None,
                   help="how long the broker keeps the decision topic's records (0.5; an override stream.retention_hours=... wins)")
    p.add_argument("--quick", action="store_true", help="3.5 minutes, each fault once")
    p.add_argument("--compile-cache", type=Path, default=None, metavar="DIR",
                   help="start from a copy of this compile cache (~/.cache/dvi/compile) instead of compiling vLLM's graphs cold")
    p.add_argument("--judge", type=Path, default=None, metavar="SOAK_JSON",
                   help="run nothing: judge the memory and descriptors of every process life in a run's soak.json")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.add_argument("--outside-ignore", action="append", default=[], metavar="PREFIX",
                   help="leave writes under PREFIX (another program's) out of the check that nothing is written outside the cache")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every part")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.judge:
        return judge(args.judge)
    opt = Options.quick(args.out) if args.quick else Options(**({"out": args.out} if args.out else {}))
    if args.minutes is not None:
        opt.minutes = args.minutes
    if args.fault_every_min is not None:
        opt.fault_every_min = args.fault_every_min
    if args.faults:
        unknown = sorted(set(args.faults.split(",")) - set(FAULTS))
        if unknown:
            raise SystemExit(f"--faults: unknown {unknown}; the faults are {', '.join(FAULTS)}")
        opt.faults = tuple(args.faults.split(","))
    if args.max_minutes is not None:
        opt.max_minutes = args.max_minutes
    if args.retention_hours is not None:
        opt.retention_hours = args.retention_hours
    if args.drain_min is not None:
        opt.drain_min = args.drain_min
    if args.recover_max_min is not None:
        opt.recover_max_min = args.recover_max_min
    opt.outside_ignore = tuple(args.outside_ignore)
    opt.compile_from = args.compile_cache.expanduser() if args.compile_cache else None
    summary = Soak(opt, args.overrides).run()
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    return 0 if all(v is not False for v in summary["checks"].values()) else 1


def judge(path: Path) -> int:
    """The memory and descriptor checks of a run's soak.json, from its rows: the process table and the two verdicts."""
    saved = json.loads(path.read_text())
    options = saved.get("options", {})
    end = run_end(saved["rows"], float(options.get("minutes", Options.minutes)))
    procs, unjudged = judged_lives(saved["rows"], end, 60 * float(options.get("warmup_min", Options.warmup_min)))
    lines = "\n".join(procs_table(procs, unjudged))
    verdicts = {k: all_flat(procs, k) for k in ("rss", "fds")}
    print(lines)
    print(f"\nmemory flat: {verdicts['rss']}; descriptors flat: {verdicts['fds']}")
    return 0 if all(v is not False for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
