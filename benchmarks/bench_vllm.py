"""Serving engines side by side: vLLM (plain, and under dvi's loop) against dvi's own engine, on the demo pair.

One process, one run, the same chat prompts (bench_engine's), greedy, at batch 1 and batch 8 (the prompts repeated
to fill it), every path run back to back in a rotating order within each block:

- `dvi target-only`, `dvi + drafter`: dvi's engine (`dvi.engine.SpeculativeEngine.generate`), fixed K;
- `vLLM target-only`, `vLLM + drafter`: vLLM's engine as vLLM users run it (an `LLMEngine` stepped until done, no
  dvi code in it), the same drafter and K;
- `vLLM + drafter + dvi loop`: a `dvi.serving.replica.Replica` with serve.engine=vllm: the same engine with dvi's
  worker hooks reading every verification, requests through the replica's queue and decode thread, every
  DecisionRecord built and sent to a real broker (the embedded one). Its cost against `vLLM + drafter` is what
  the loop costs a vLLM user (the target: at most 3% of tokens/s).

Per path and batch size: tokens/s (generated tokens / wall seconds of one block, median over blocks), the ratio to
`vLLM + drafter` (median of per-block ratios), acceptance. Then the hot swap: a drafter is published into a store and
announced on the control topic while the replica serves short requests; the seconds from the announcement to the
end of the first request that a round of the new version drafted for (an upper bound on publish -> first token
drafted by it), and whether any request failed meanwhile.

What it does not know: sampled decoding, prompts longer than a chat turn, the trainer (the drafter is the demo's,
untrained: acceptance is its starting point, not what the loop reaches). vLLM's CPU build warns that speculative
decoding without Intel OpenMP preloaded (LD_PRELOAD) is slow; this script runs as the suite does, without it.

Run (from the checkout root): .venv/bin/python -m benchmarks.bench_vllm [--quick] [--json PATH]; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
import transformers

from benchmarks.bench_engine import PROMPTS, chat_prompts
from dvi import store
from dvi.config import DviConfig, ModelConfig, ServeConfig, SpecConfig, StreamConfig, SwapConfig, TrackingConfig, VllmConfig
from dvi.control import DrafterPublished
from dvi.engine import Request, SpeculativeEngine
from dvi.models import default_cache_dir, end_ids, fetch_demo_target, load_causal_lm, load_drafter, load_tokenizer, resolve_pair
from dvi.procs import free_port
from dvi.serving.replica import Replica
from dvi.serving.vllm_engine import import_vllm, set_vllm_env
from streams.broker import EmbeddedBroker
from streams.control import ControlChannel
from streams.control import send as control_send
from streams.producer import DecisionProducer
from streams.topics import ensure_topics

K = 4
BASELINE = "vLLM + drafter"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def plain_vllm(target_dir: Path, drafter_dir: Path | None, max_batch: int, max_len: int, kv_gb: float):
    """vLLM's engine as its users run it: no dvi code in it."""
    set_vllm_env(VllmConfig(cpu_kv_cache_gb=int(kv_gb)))
    vllm = import_vllm()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    spec = {"method": "draft_model", "model": str(drafter_dir), "num_speculative_tokens": K} if drafter_dir else None
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(target_dir), dtype="float32", enforce_eager=True, max_model_len=max_len,
                                                   max_num_seqs=max_batch, enable_prefix_caching=False, speculative_config=spec,
                                                   async_scheduling=False, disable_log_stats=True))

    def run(prompts: list[list[int]], n: int, stop: list[int]) -> tuple[int, float | None]:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=stop, detokenize=False)
        for p in prompts:
            engine.add_request(uuid.uuid4().hex, {"prompt_token_ids": p}, params)
        tokens = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    tokens += len(o.outputs[0].token_ids)
        return tokens, None

    return run


def dvi_native(engine: SpeculativeEngine):
    def run(prompts: list[list[int]], n: int, stop: list[int]) -> tuple[int, float | None]:
        results = engine.generate([Request(p, max_new_tokens=n) for p in prompts])
        drafted = sum(r.stats.drafted for r in results)
        return sum(len(r.token_ids) for r in results), (sum(r.stats.accepted for r in results) / drafted if drafted else None)

    return run


def dvi_loop(replica: Replica):
    def run(prompts: list[list[int]], n: int, stop: list[int]) -> tuple[int, float | None]:
        results = [j.future.result(600) for j in [replica.submit(Request(p, max_new_tokens=n)) for p in prompts]]
        drafted = sum(r.stats.drafted for r in results)
        return sum(len(r.token_ids) for r in results), (sum(r.stats.accepted for r in results) / drafted if drafted else None)

    return run


def swap_latency(replica: Replica, cfg: DviConfig, drafter_dir: Path, prompts: list[list[int]]) -> dict:
    """Publish a copy of the drafter as a new version, announce it, and serve until a round of it is seen. Seconds
    from the start of the announcement: it acknowledged by the broker, the drafter checked, loaded and swapped in
    (the engine's pointer), and the end of the first request one of its rounds drafted for."""
    model = load_causal_lm(drafter_dir, "drafter")
    version = f"d{int(time.time()) % 10**6:06d}"
    published = store.publish(Path(cfg.serve.swap.store), version, model.state_dict(), drafter_dir, {"parent": "bench"})
    marks: dict[str, float] = {}

    def watch() -> None:
        while "swapped_in" not in marks and time.perf_counter() - t0 < 60:
            d = replica.engine.drafter
            if d is not None and d.version == version:
                marks["swapped_in"] = time.perf_counter() - t0
            time.sleep(0.005)

    failed = i = 0
    t0 = time.perf_counter()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    control_send(cfg.stream, DrafterPublished(version, str(published.path), published.sha256, parent="bench"))
    marks["announced"] = time.perf_counter() - t0
    while time.perf_counter() - t0 < 60:
        try:
            result = replica.submit(Request(prompts[i % len(prompts)], max_new_tokens=8)).future.result(60)
        except Exception:
            failed += 1
            continue
        i += 1
        if any(r.drafter_version == version for r in result.rounds):
            marks["first_drafted"] = time.perf_counter() - t0
            break
    watcher.join(1)
    return {"version": version, **{k: round(v, 3) for k, v in marks.items()}, "requests": i, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=None, help="tokens per prompt (default 48; --quick 16)")
    ap.add_argument("--repeats", type=int, default=None, help="blocks per path and batch size (default 3; --quick 1)")
    ap.add_argument("--prompts", type=int, default=None, help=f"batch-1 blocks per repeat, one prompt each, 1..{len(PROMPTS)} (default 3; --quick 1)")
    ap.add_argument("--batches", type=int, default=None, help="batch-8 blocks per repeat (default 2; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="a short run to check that every path works")
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    args = ap.parse_args(argv)
    n = args.max_new_tokens or (16 if args.quick else 48)
    repeats = args.repeats or (1 if args.quick else 3)
    n_prompts = args.prompts or (1 if args.quick else 3)
    n_batches = args.batches or (1 if args.quick else 2)

    target_dir = fetch_demo_target()
    drafter_dir = default_cache_dir() / "models" / "drafter-L2-full"
    tokenizer = load_tokenizer(target_dir, "target")
    prompts = chat_prompts(tokenizer, len(PROMPTS))
    batches = {1: [[p] for p in prompts[:n_prompts]], 8: [[prompts[(b + i) % len(prompts)] for i in range(8)] for b in range(n_batches)]}
    target = load_causal_lm(target_dir, "target")
    stop = sorted(end_ids(target, tokenizer))
    max_len = 1024

    broker = EmbeddedBroker(free_port()).start()
    name = f"bench{uuid.uuid4().hex[:8]}"
    stream = StreamConfig(bootstrap_servers=broker.bootstrap, topic=f"{name}.decisions", dlq_topic=f"{name}.decisions.dlq",
                          control_topic=f"{name}.control", partitions=3)
    ensure_topics(stream)
    store_root = Path(os.environ.get("TMPDIR", "/tmp")) / f"dvi-bench-vllm-{name}"
    cfg = DviConfig(model=ModelConfig(target=str(target_dir), drafter=str(drafter_dir)), stream=stream,
                    serve=ServeConfig(engine="vllm", spec=SpecConfig(k=K, adaptive=False), max_batch=8,
                                      vllm=VllmConfig(max_model_len=max_len, cpu_kv_cache_gb=1),
                                      swap=SwapConfig(store=str(store_root), initial="none"), metrics_every_s=3600, plot_every_s=3600),
                    tracking=TrackingConfig(enabled=False))
    log("starting the engines (three vLLM engines and dvi's)...")
    replica = Replica(cfg, resolve_pair(cfg.model, target_weights=False), producer=DecisionProducer(stream),
                      control=ControlChannel(stream, client_id="bench-vllm")).start()
    paths = {
        "dvi target-only": dvi_native(SpeculativeEngine(target, None, SpecConfig(k=K, adaptive=False), stop_ids=set(stop), max_batch=8)),
        "dvi + drafter": dvi_native(SpeculativeEngine(target, load_drafter(drafter_dir, int(target.config.vocab_size)),
                                                      SpecConfig(k=K, adaptive=False), stop_ids=set(stop), max_batch=8)),
        "vLLM target-only": plain_vllm(target_dir, None, 8, max_len, 1.0),
        BASELINE: plain_vllm(target_dir, drafter_dir, 8, max_len, 1.0),
        "vLLM + drafter + dvi loop": dvi_loop(replica),
    }
    names = list(paths)
    for name_, run in paths.items():  # one untimed pass each: first-call costs out of the timings
        run(batches[1][0], 4, stop)
    seen: dict[tuple[str, int], list[tuple[float, float | None]]] = {(p, b): [] for p in names for b in batches}
    ratios: dict[tuple[str, int], list[float]] = {(p, b): [] for p in names for b in batches}
    block = 0
    for rep in range(repeats):
        for b, groups in batches.items():
            for group in groups:
                order = names[block % len(names):] + names[: block % len(names)]
                block += 1
                tps = {}
                for p in order:
                    t0 = time.perf_counter()
                    tokens, acceptance = paths[p](group, n, stop)
                    tps[p] = tokens / (time.perf_counter() - t0)
                    seen[(p, b)].append((tps[p], acceptance))
                for p in names:
                    ratios[(p, b)].append(tps[p] / tps[BASELINE])
            log(f"repeat {rep + 1}/{repeats}, batch {b}: done")
    swap = swap_latency(replica, cfg, drafter_dir, prompts)
    producer_stats = replica.producer.stats.to_dict()
    replica.close()
    broker.stop()

    rows = []
    for p in names:
        for b in batches:
            xs = seen[(p, b)]
            acc = [a for _, a in xs if a is not None]
            rows.append({"path": p, "batch": b, "tokens_per_s": round(statistics.median(t for t, _ in xs), 2),
                         "vs_vllm_drafter": round(statistics.median(ratios[(p, b)]), 3),
                         "acceptance": round(statistics.median(acc), 4) if acc else None, "blocks": len(xs)})
    print(f"{'path':<28} {'batch':>5} {'tok/s':>8} {'x vLLM+drafter':>15} {'acceptance':>11}")
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        print(f"{r['path']:<28} {r['batch']:>5} {r['tokens_per_s']:>8.1f} {r['vs_vllm_drafter']:>15.3f} {acc:>11}")
    print(f"hot swap: {swap}")
    print(f"records: {producer_stats}")
    if args.json:
        vllm = import_vllm()
        out = {"rows": rows, "swap": swap, "records": producer_stats, "max_new_tokens": n, "repeats": repeats, "k": K,
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "vllm": vllm.__version__, "threads": torch.get_num_threads()}}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
