"""Serving benchmark: what a hot swap costs a running replica, how fast a publish reaches decoding, and HTTP
throughput and latency at 1, 8 and 32 concurrent clients, speculative vs target-only.

1. Swaps under load (in process, the real demo pair, the real embedded broker): a `dvi.serving.replica.Replica` (handed a
   `streams.control.ControlChannel`) decodes
   a steady load of streamed requests (4 client threads, greedy, fixed K = 4, so every round drafts) while
   noisy copies of the demo drafter are published to a model store and announced on the control topic every
   few seconds. Each request's token deliveries are timestamped; a delivery's gap is the inter-token latency a
   streaming client sees (one verification round). Rounds that are the first with a new drafter (the cache
   rebuild happens there) are compared with all other rounds: the stall is the difference of their p50 / p99.
   Publish-to-first-token is the time from sending the announcement to the first delivery decoded by the new
   drafter (checks, load, smoke decode and the swap itself included).
2. HTTP (`dvi serve` subprocesses): N clients each send completions back to back (32 new tokens, greedy, chat
   prompts); requests/s, generated tokens/s and the p50 / p99 request latency at N = 1, 8, 32, for the
   speculative server (the demo drafter or --drafter, adaptive K) and for the target-only one (--no-draft).
   Decision logging and tracking are off here: this measures serving alone.

Run: .venv/bin/python benchmarks/bench_serve.py [--drafter PATH] [--swaps 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dvi import store  # noqa: E402
from dvi.config import DviConfig, ModelConfig, ServeConfig, SpecConfig, StreamConfig, SwapConfig, TrackingConfig  # noqa: E402
from dvi.control import DrafterPublished  # noqa: E402
from dvi.engine_api import Request  # noqa: E402
from dvi.models import load_causal_lm  # noqa: E402
from dvi.pairs import pair_dirs  # noqa: E402
from dvi.pairs import resolve_pair  # noqa: E402
from dvi.procs import free_port, http_ok  # noqa: E402
from dvi.serving.replica import Replica  # noqa: E402
from streams.broker import EmbeddedBroker  # noqa: E402
from streams.control import ControlChannel  # noqa: E402
from streams.control import send as control_send  # noqa: E402

QUESTIONS = ["Write a Python function that reverses a string.", "What is the difference between a list and a tuple?",
             "Explain recursion to a beginner.", "Give me three tips for writing clear documentation.",
             "What is a closure in Python?", "Summarize what a hash table is.", "Write a haiku about autumn.",
             "How do I read a CSV file in Python?"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# ----------------------------------------------------------------------------------------------
# 1. swaps under load


def publish_copies(store_root: Path, drafter_dir: Path, n: int) -> list[store.Published]:
    """`n` versions of the drafter with 1% relative noise on every matrix (valid drafters, different weights)."""
    base = load_causal_lm(drafter_dir, "drafter").state_dict()
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        weights = {k: v + torch.randn(v.shape, generator=g) * 0.01 * v.std() if v.ndim >= 2 else v.clone() for k, v in base.items()}
        out.append(store.publish(store_root, f"b{i + 1:04d}", weights, drafter_dir, {"parent": "bench"}))
    return out


def swaps_under_load(model: ModelConfig, n_swaps: int, every_s: float, clients: int = 4) -> dict:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(free_port()) as broker:
        store_root = Path(tmp) / "store"
        _, drafter_dir = pair_dirs(model)
        versions = publish_copies(store_root, drafter_dir, n_swaps)
        stream = StreamConfig(port=broker.port)
        cfg = DviConfig(model=model, stream=stream, tracking=TrackingConfig(enabled=False),
                        serve=ServeConfig(engine="dvi", spec=SpecConfig(k=4, adaptive=False), max_batch=clients,
                                          swap=SwapConfig(store=str(store_root), initial="none", window_tokens=10**9)))
        pair = resolve_pair(cfg.model)
        prompts = [list(pair.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                           tokenize=True)["input_ids"]) for q in QUESTIONS]
        service = Replica(cfg, pair, control=ControlChannel(stream, client_id="bench-serve")).start()
        time.sleep(3)  # the control reader joins the topic
        stop = threading.Event()
        finished: list[tuple[list[float], list[str]]] = []  # per request: delivery times, round drafter versions

        def client(c: int) -> None:
            i = c
            while not stop.is_set():
                times: list[float] = []
                job = service.submit(Request(prompts[i % len(prompts)], max_new_tokens=48), on_tokens=lambda ids, _: times.append(time.perf_counter()))
                result = job.future.result()
                finished.append((times, [r.drafter_version for r in result.rounds]))
                i += clients

        announced: dict[str, float] = {}
        with ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(client, c) for c in range(clients)]
            time.sleep(every_s)
            for p in versions:
                announced[p.version] = time.perf_counter()
                control_send(stream, DrafterPublished(version=p.version, uri=str(p.path), sha256=p.sha256, parent="bench"))
                log(f"  announced {p.version}")
                time.sleep(every_s)
            stop.set()
            for f in futures:
                f.result()
        service.close()

    normal, first = [], []
    first_decoded: dict[str, float] = {}
    unaligned = 0
    for times, rounds in finished:
        if len(times) != len(rounds):
            unaligned += 1  # deliveries and rounds do not line up: left out of the gap statistics, counted
            continue
        for j in range(1, len(times)):
            if rounds[j] is None or rounds[j - 1] is None:
                continue  # a round that drafted nothing (the last token of a budget) is not a drafting round
            (first if rounds[j] != rounds[j - 1] else normal).append(times[j] - times[j - 1])
        for t, v in zip(times, rounds):
            if v in announced and t < first_decoded.get(v, float("inf")):
                first_decoded[v] = t
    to_first = [first_decoded[v] - announced[v] for v in announced if v in first_decoded]
    return {
        "swaps": service.metrics.events["swap"], "refused": sum(n for k, n in service.metrics.events.items() if k.startswith("refused")),
        "requests": len(finished), "unaligned": unaligned, "rounds_normal": len(normal), "rounds_first_after_swap": len(first),
        "gap_ms_p50_normal": 1000 * statistics.median(normal), "gap_ms_p99_normal": 1000 * pct(normal, 0.99),
        "gap_ms_p50_after_swap": 1000 * statistics.median(first) if first else None,
        "gap_ms_p99_after_swap": 1000 * pct(first, 0.99) if first else None,
        "stall_ms_p50": 1000 * (statistics.median(first) - statistics.median(normal)) if first else None,
        "stall_ms_p99": 1000 * (pct(first, 0.99) - pct(normal, 0.99)) if first else None,
        "publish_to_first_token_s_median": statistics.median(to_first) if to_first else None,
        "publish_to_first_token_s_max": max(to_first) if to_first else None,
    }


# ----------------------------------------------------------------------------------------------
# 2. HTTP throughput and latency


class Server:
    """A `dvi serve` subprocess on a free port."""

    def __init__(self, overrides: list[str], no_draft: bool, env: dict[str, str] | None = None):
        self.port = free_port()
        cmd = [sys.executable, "-m", "dvi.cli", "serve", *(["--no-draft"] if no_draft else []), f"serve.port={self.port}",
               "serve.log_decisions=false", "tracking.enabled=false", "serve.swap.enabled=false", "serve.swap.initial=none", *overrides]
        self.log = tempfile.NamedTemporaryFile(prefix="bench-serve-", suffix=".log")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while http_ok(self.url + "/health") is not None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dvi serve did not start: {Path(self.log.name).read_text()[-800:]}")
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def http_load(url: str, clients: int, total: int, max_tokens: int) -> dict:
    import requests  # the test extra's HTTP client: only this part of the benchmark needs it

    session_local = threading.local()
    lock = threading.Lock()
    sent = [0]
    latencies, tokens = [], []

    def worker(c: int) -> None:
        s = getattr(session_local, "s", None) or requests.Session()
        session_local.s = s
        while True:
            with lock:
                if sent[0] >= total:
                    return
                i = sent[0]
                sent[0] += 1
            t0 = time.perf_counter()
            r = s.post(url + "/v1/chat/completions", timeout=600,
                       json={"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            tokens.append(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker, c) for c in range(clients)]:
            f.result()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(latencies), "tokens": sum(tokens), "wall_s": wall, "req_per_s": len(latencies) / wall,
            "tok_per_s": sum(tokens) / wall, "latency_s_p50": statistics.median(latencies), "latency_s_p99": pct(latencies, 0.99)}


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", help="drafter directory for the speculative server (default: the demo drafter)")
    ap.add_argument("--swaps", type=int, default=8)
    ap.add_argument("--every", type=float, default=4.0, help="seconds between announcements")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    model = ModelConfig(drafter=args.drafter)
    torch.set_num_threads(os.cpu_count() or 1)

    log(f"1. {args.swaps} swaps under load, one every {args.every:.0f} s")
    swap = swaps_under_load(model, args.swaps, args.every)
    print("## Swaps under load (4 streamed clients, K = 4, greedy)\n")
    print(table([swap], ["swaps", "refused", "requests", "unaligned", "rounds_normal", "rounds_first_after_swap"]))
    print()
    print(table([swap], ["gap_ms_p50_normal", "gap_ms_p99_normal", "gap_ms_p50_after_swap", "gap_ms_p99_after_swap",
                         "stall_ms_p50", "stall_ms_p99"]))
    print(f"\npublish to first token with the new drafter: median {swap['publish_to_first_token_s_median']:.2f} s, "
          f"max {swap['publish_to_first_token_s_max']:.2f} s\n")

    http = []
    if not args.skip_http:
        overrides = [f"model.drafter={args.drafter}"] if args.drafter else []
        for name, no_draft in (("speculative", False), ("target-only", True)):
            log(f"2. HTTP, {name}")
            server = Server(overrides, no_draft)
            try:
                http_load(server.url, 1, 2, args.max_tokens)  # warm-up
                for n in (int(x) for x in args.clients.split(",")):
                    row = {"server": name, **http_load(server.url, n, max(2 * n, 8), args.max_tokens)}
                    log(f"  {n} clients: {row['tok_per_s']:.1f} tok/s")
                    http.append(row)
            finally:
                server.close()
        print(f"## HTTP, {args.max_tokens} new tokens per request, greedy\n")
        print(table(http, ["server", "clients", "requests", "req_per_s", "tok_per_s", "latency_s_p50", "latency_s_p99"]))
        ratio = [(a["clients"], a["tok_per_s"] / b["tok_per_s"]) for a in http if a["server"] == "speculative"
                 for b in http if b["server"] == "target-only" and b["clients"] == a["clients"]]
        print("\nspeculative / target-only tokens/s: " + ", ".join(f"{n} clients {r:.2f}x" for n, r in ratio))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"swap": swap, "http": http}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
