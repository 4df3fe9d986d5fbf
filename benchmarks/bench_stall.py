"""Does one client's huge prompt stall everyone else? `/health` and a small chat request from a second client, timed
while four large prompts are being processed, on each serving engine.

For every engine named (`dvi serve` with `serve.engine=` each), a real server starts on the demo pair (tracking off, no
swaps, its DecisionRecords on the embedded broker), then:

1. the quiet latencies: `/health` and a small chat request (8 tokens), a few times each, alone;
2. four large raw completions (`--prompt-mb` MB of prose each, under the 4 MiB body bound; each size in turn) sent at
   once from four threads; while they are in flight, the same `/health` and small chat requests, again and again;
3. what the large prompts got back (status and message) and how long they took.

Printed, and written with `--json`: per engine, the median and worst latency of each probe, quiet and under load.
A server that tokenizes on its event loop answers `/health` only after the large prompts are done (seconds);
one that bounds prompts by length before the work, and tokenizes off the loop, answers at once.

Run (from the checkout root): .venv/bin/python -m benchmarks.bench_stall [--engines dvi,vllm-server] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from dvi.hardware import vllm_version
from dvi.procs import free_port, http_ok, spawn, wait_ready
from streams.broker import EmbeddedBroker

ROOT = Path(__file__).resolve().parent.parent
PROSE = "The river bends past the old mill, and the light on the water changes with every hour of the day. "


def timed(fn) -> tuple[float, str]:
    t = time.perf_counter()
    try:
        r = fn()
        what = str(r.status_code)
    except requests.RequestException as e:
        what = type(e).__name__
    return time.perf_counter() - t, what


def probes(url: str, model: str | None) -> dict:
    small = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    if model:
        small["model"] = model
    return {"health": lambda: requests.get(url + "/health", timeout=120),
            "small_chat": lambda: requests.post(url + "/v1/chat/completions", json=small, timeout=120)}


def summary(samples: list[tuple[float, str]]) -> dict:
    secs = [s for s, _ in samples]
    return {"n": len(secs), "median_s": round(statistics.median(secs), 4) if secs else None,
            "max_s": round(max(secs), 4) if secs else None, "statuses": sorted({w for _, w in samples})}


def stall(url: str, model: str | None, prompt_mb: float, n_large: int = 4) -> dict:
    """The probes' latencies alone and while `n_large` prompts of `prompt_mb` MB are being processed."""
    p = probes(url, model)
    quiet = {name: summary([timed(fn) for _ in range(3)]) for name, fn in p.items()}
    text = (PROSE * int(prompt_mb * 1e6 / len(PROSE) + 1))[: int(prompt_mb * 1e6)]
    body = {"prompt": text, "max_tokens": 4, "temperature": 0, **({"model": model} if model else {})}
    large: list[dict] = []

    def send() -> None:
        t = time.perf_counter()
        try:
            r = requests.post(url + "/v1/completions", json=body, timeout=300)
            msg = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
            large.append({"status": r.status_code, "seconds": round(time.perf_counter() - t, 3), "message": msg[:160]})
        except requests.RequestException as e:
            large.append({"status": type(e).__name__, "seconds": round(time.perf_counter() - t, 3), "message": str(e)[:160]})

    threads = [threading.Thread(target=send) for _ in range(n_large)]
    for th in threads:
        th.start()
    time.sleep(0.05)  # the bodies are on their way
    loaded: dict[str, list] = {name: [] for name in p}
    while any(th.is_alive() for th in threads) or not loaded["health"]:  # one round at least
        for name, fn in p.items():
            loaded[name].append(timed(fn))
        time.sleep(0.05)
    for th in threads:
        th.join()
    return {"quiet": quiet, "under_load": {name: summary(s) for name, s in loaded.items()}, "large": large}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="vllm-server,dvi", help="serve.engine values, comma-separated")
    ap.add_argument("--prompt-mb", default="3,0.6", help="sizes of the large prompts, comma-separated: 3 MB is refused by its "
                    "length in characters where the server bounds it; 0.6 MB is under the demo target's bound (8191 tokens) "
                    "and is tokenized before it is refused")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    results: dict = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "python": sys.version.split()[0],
                                 "vllm": vllm_version()}, "engines": {}}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(free_port()) as broker:
        for engine in args.engines.split(","):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "dvi.cli", "serve", f"serve.engine={engine}", f"serve.port={port}", "tracking.enabled=false",
                   "serve.swap.enabled=false", f"stream.bootstrap_servers={broker.bootstrap}", f"trainer.store={tmp}/store"]
            child = spawn(f"dvi serve ({engine})", cmd, log_path=Path(tmp) / f"{engine}.log", cwd=ROOT)
            try:
                wait_ready(child, lambda: http_ok(url + "/health"), 900, f"dvi serve ({engine})", interval_s=1.0)
                by_size = {mb: stall(url, None, float(mb)) for mb in args.prompt_mb.split(",")}
            finally:
                child.stop()
            results["engines"][engine] = by_size
            for mb, r in by_size.items():
                for name in ("health", "small_chat"):
                    q, u = r["quiet"][name], r["under_load"][name]
                    print(f"{engine:12s} {mb:>4s} MB {name:10s} quiet median {q['median_s']:.3f} s | under load median "
                          f"{u['median_s']} s, worst {u['max_s']} s ({u['n']} probes, {u['statuses']})", flush=True)
                print(f"{engine:12s} {mb:>4s} MB large prompts: {r['large']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
