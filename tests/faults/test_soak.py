"""Scenario 9, the soak: `dvi serve` and `dvi train` on the real demo pair run mixed traffic for DVI_SOAK_MINUTES
(3 in the suite; the scenario's full run is 30: `DVI_SOAK_MINUTES=30 pytest -s tests/faults/test_soak.py`) while the
trainer publishes a drafter every few steps (its gate opened: `trainer.min_gain=-1`) and the server swaps each in.

Asserted: no request fails and no stream ends in an error; neither process dies or logs a traceback; drafters are
swapped in during the run; greedy answers to a fixed probe set, asked after every swap under load, are identical to
the target-only server's; memory stays flat, in runs of MEMORY_MINUTES or more (the suite's 3-minute run prints
the memory figures only: its halves are decided by warm-up and transients). Memory is resident memory (sampled
every 2 s) of the server and of the trainer after the warm-up (the first third of the run, and at least until the
first swap: a replica holds the serving drafter and the previous one, kept for a rollback). Flat means: the
median of its second half is at most 5% above the median of its first half, and the least-squares line through
it (its slope printed in MiB per minute) rises by at most 5% of the first half's median across the window.
Peaks are printed, not asserted: each swap loads a 139 MiB drafter beside the two a replica holds and each
checkpoint copies the trainer's state, so a peak is set by which transients coincide, not by what is kept."""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import threading
import time
from collections import Counter

import pytest
import requests
from broker_fixtures import stream_config
from child_env import clean_env
from faults_helpers import Serve, stream_overrides

from benchmarks.soak import slope_per_min, stream_end
from benchmarks.workloads import prompts
from dvi.procs import rss_mib

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.broker, pytest.mark.real_model]

MINUTES = float(os.environ.get("DVI_SOAK_MINUTES", "3"))
MEMORY_MINUTES = 10  # the memory check needs a run at least this long (a 3-minute run's peaks are transients)
PROBES = [p for domain in ("code", "prose", "qa") for p in prompts(domain, "eval", seed=9)[:2]]


def answer(server: Serve, prompt, max_tokens: int = 24) -> str:
    r = requests.post(server.url + prompt.path, json=prompt.body(max_tokens), timeout=300)
    assert r.status_code == 200, r.text[:500]
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.timeout(MINUTES * 60 + 900)  # the run itself, plus starting and stopping the stack
def test_soak_mixed_traffic_with_swaps_keeps_memory_flat_and_greedy_exact(broker, tmp_path):
    from dvi.procs import spawn
    from streams.topics import ensure_topics

    scfg = stream_config(broker.bootstrap)
    ensure_topics(scfg)
    store = tmp_path / "store"
    common = [*stream_overrides(scfg), "tracking.enabled=false", f"trainer.store={store}", "model.threads=1", "model.dtype=float32"]

    # dvi's engine: the exact fp32 reference, whose greedy answers equal target-only's bit for bit at any batch
    plain = Serve(tmp_path, *common, name="plain", no_draft=True, engine="dvi")  # the reference: target-only, greedy
    try:
        expected = {p.text: answer(plain, p) for p in PROBES}
    finally:
        plain.stop()

    serve = Serve(tmp_path, *common, "serve.max_batch=2", "serve.swap.window_tokens=96", "serve.swap.baseline_tokens=48", engine="dvi")
    train = spawn("train", [sys.executable, "-m", "dvi.cli", "-v", "train", *common, f"trainer.run_dir={tmp_path / 'run'}",
                            "trainer.batch_tokens=128", "trainer.replay_when_idle=true", "trainer.log_every=1",
                            "trainer.holdout_share=0.2", "trainer.gate_min_records=2", "trainer.gate_every=8",
                            "trainer.min_gain=-1", "trainer.checkpoint_every=16", "trainer.keep_checkpoints=1"],
                  log_path=tmp_path / "train.log", env=clean_env())
    statuses: Counter = Counter()
    broken: list[list[str]] = []  # the last events of streams that ended badly
    stop = threading.Event()
    traffic = [p for domain in ("code", "prose", "qa") for p in prompts(domain, "live", seed=9)[:20]]

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            p = traffic[i % len(traffic)]
            body = p.body(8 + 8 * (i % 5), temperature=(0.0, 0.7, 1.0)[i % 3], stream=i % 2 == 1)
            try:
                r = requests.post(serve.url + p.path, json=body, timeout=300, stream=body["stream"])
                status = r.status_code
                if status == 200 and body["stream"]:
                    events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
                    end = stream_end(events)
                    if end != "complete":
                        status = f"stream {end}"
                        broken.append(events[-3:])
                statuses[status] += 1
            except (requests.RequestException, ValueError) as e:  # ValueError: an event that is not JSON
                statuses[type(e).__name__] += 1
            i += 2

    memory: dict[str, list[tuple[float, float]]] = {"serve": [], "train": []}
    probes: list[tuple[str, int]] = []  # (serving version, probes that differ)
    swapped_at: list[float] = []
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.wait(2.0):
            now = time.monotonic() - t0
            memory["serve"].append((now, rss_mib(serve.child.pid)))
            memory["train"].append((now, rss_mib(train.pid)))

    try:
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
        clients = list(threads)
        threads.append(threading.Thread(target=sample, daemon=True))
        for t in threads:
            t.start()
        end = t0 + MINUTES * 60
        last_version = serve.health().get("drafter_version")
        while time.monotonic() < end:
            assert serve.child.running, serve.child.log_tail(3000)
            assert train.running, train.log_tail(3000)
            version = serve.health().get("drafter_version")
            if version != last_version:  # a swap (or a rollback): the probe set, greedy, under load
                swapped_at.append(time.monotonic() - t0)
                probes.append((version, sum(answer(serve, p) != expected[p.text] for p in PROBES)))
                last_version = version
            time.sleep(2.0)
        probes.append((serve.health().get("drafter_version"), sum(answer(serve, p) != expected[p.text] for p in PROBES)))
        stop.set()
        for c in clients:
            c.join(300)
        health = serve.health()
    finally:
        stop.set()
        train.stop(grace_s=60)
        serve.stop()

    serve_log, train_log = (tmp_path / "serve.log").read_text(), (tmp_path / "train.log").read_text()
    swaps = health["events"].get("swap", 0)
    published = len(re.findall(r"\S+ published \(parent", train_log))

    warm = max(MINUTES * 60 / 3, swapped_at[0] if swapped_at else 0.0)
    half = (warm + MINUTES * 60) / 2

    def flat(samples) -> dict:
        first, second = [m for t, m in samples if warm <= t < half], [m for t, m in samples if t >= half]
        if not first or not second:  # the first swap came too late to leave a window after the warm-up
            return {"median": float("nan"), "growth": float("nan"), "peak": float("nan"), "slope": float("nan"), "halves": ""}
        slope = slope_per_min([(t, m) for t, m in samples if t >= warm])
        return {"median": statistics.median(second) / statistics.median(first),
                "growth": slope * (MINUTES * 60 - warm) / 60 / statistics.median(first),
                "peak": max(second) / max(first), "slope": slope,
                "halves": " / ".join(f"{min(h):.0f}, {statistics.median(h):.0f}, {max(h):.0f}" for h in (first, second))}

    figures = {name: flat(s) for name, s in memory.items()}
    print(f"\nsoak {MINUTES:g} min: requests {dict(statuses)}; {published} published, {swaps} swaps (first at "
          f"{swapped_at[0] if swapped_at else float('nan'):.0f} s, warm-up until {warm:.0f} s), "
          f"{health['events'].get('rollback', 0)} rollbacks; probes (version, differing) {probes}; memory: " + ", ".join(
              f"{name} {memory[name][0][1]:.0f} -> {memory[name][-1][1]:.0f} MiB (slope {f['slope']:+.1f} MiB/min, "
              f"{100 * f['growth']:+.1f}% over the window; second/first half median {f['median']:.3f}, peak {f['peak']:.3f}; "
              f"min, median, max by half {f['halves']})"
              for name, f in figures.items()))
    (tmp_path / "soak.json").write_text(json.dumps({"memory": memory, "probes": probes, "statuses": dict(statuses)}))

    assert set(statuses) == {200}, (statuses, broken[:3])
    assert "Traceback" not in serve_log and "Traceback" not in train_log
    assert swaps >= 1, f"no drafter was swapped in ({published} published)"
    assert all(differ == 0 for _, differ in probes), probes
    if MINUTES < MEMORY_MINUTES:  # warm-up and transients decide a shorter run's halves: figures only
        return
    for name, f in figures.items():
        assert f["median"] <= 1.05, f"{name}: resident memory's median rose {100 * (f['median'] - 1):.1f}% after the warm-up"
        assert f["growth"] <= 0.05, f"{name}: resident memory grew {f['slope']:+.1f} MiB/min, {100 * f['growth']:.1f}% over the window"
