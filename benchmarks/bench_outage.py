"""Broker-outage benchmark: does a serving replica decode slower while the broker is down?

A `dvi.serving.replica.Replica` (in process, the real demo pair, greedy, fixed K = 4) logs every request's decisions to
the real embedded broker through its non-blocking producer. One client sends a fixed set of chat prompts back
to back. The broker is alternately up and down (killed with SIGKILL; restarted empty, with its topics created
again, as `dvi broker` does), one pass over the prompts per state, in ABBA order (up, down, down, up, ...) so
that a slow drift of the machine's speed falls on both states alike. Greedy decoding of the same prompt does
the same work every time, so each (cycle, prompt) pair gives a paired ratio: tokens/s with the broker down over
tokens/s with it up. The figure is the median of those ratios, with its interquartile range; the target is
within 5% (0.95-1.05). The records the producer could not send are counted as dropped.

Run: .venv/bin/python benchmarks/bench_outage.py [--cycles 6] [--max-new-tokens 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dvi.config import DviConfig, ModelConfig, ServeConfig, SpecConfig, StreamConfig, SwapConfig, TrackingConfig  # noqa: E402
from dvi.engine_api import Request  # noqa: E402
from dvi.pairs import resolve_pair  # noqa: E402
from dvi.procs import free_port  # noqa: E402
from dvi.serving.replica import Replica  # noqa: E402
from streams.broker import EmbeddedBroker  # noqa: E402
from streams.client import quiet_kafka_logs  # noqa: E402
from streams.producer import DecisionProducer  # noqa: E402
from streams.topics import ensure_topics  # noqa: E402

QUESTIONS = ["Write a Python function that reverses a string.", "What is the difference between a list and a tuple?",
             "Explain recursion to a beginner.", "What is a closure in Python?"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=6, help="up/down pairs (default 6)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    quiet_kafka_logs()

    broker = EmbeddedBroker(free_port()).start()
    stream = StreamConfig(port=broker.port)
    ensure_topics(stream)
    cfg = DviConfig(model=ModelConfig(), stream=stream, tracking=TrackingConfig(enabled=False),
                    serve=ServeConfig(engine="dvi", spec=SpecConfig(k=4, adaptive=False), max_batch=1, swap=SwapConfig(enabled=False, initial="none")))
    pair = resolve_pair(cfg.model)
    prompts = [list(pair.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                       tokenize=True)["input_ids"]) for q in QUESTIONS]
    producer = DecisionProducer(stream)
    service = Replica(cfg, pair, producer=producer).start()  # no control channel: no swaps
    speed: dict[str, dict[tuple[int, int], float]] = {"up": {}, "down": {}}

    def one_pass(state: str, cycle: int) -> None:
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            result = service.submit(Request(p, max_new_tokens=args.max_new_tokens)).future.result()
            speed[state][(cycle, i)] = len(result.token_ids) / (time.perf_counter() - t0)

    try:
        one_pass("up", -1)  # warm-up, not counted
        for cycle in range(args.cycles):
            for state in (("up", "down") if cycle % 2 == 0 else ("down", "up")):
                if state == "down" and broker.running:
                    broker.kill()
                elif state == "up" and not broker.running:
                    broker.start()
                    ensure_topics(stream)
                time.sleep(1.0)
                one_pass(state, cycle)
                log(f"cycle {cycle} {state}: {[round(speed[state][(cycle, i)], 2) for i in range(len(prompts))]} tokens/s")
        if not broker.running:
            broker.start()
            ensure_topics(stream)
        producer.flush(15)
    finally:
        service.close()
        broker.stop()

    keys = [k for k in speed["up"] if k[0] >= 0]
    ratios = [speed["down"][k] / speed["up"][k] for k in keys]
    r_lo, r_med, r_hi = quartiles(ratios)
    up = statistics.median(speed["up"][k] for k in keys)
    down = statistics.median(speed["down"][k] for k in keys)
    stats = producer.stats
    out = {"cycles": args.cycles, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "tokens_per_s_up": up, "tokens_per_s_down": down, "ratio_down_over_up": r_med, "ratio_q1": r_lo, "ratio_q3": r_hi,
           "pairs": len(ratios), "records": stats.to_dict()}
    print("| broker | tokens/s (median) |\n|---|---|")
    print(f"| up | {up:.2f} |\n| down | {down:.2f} |")
    print(f"\ndown / up, paired per prompt and cycle: median {r_med:.3f} (IQR {r_lo:.3f}-{r_hi:.3f}, {len(ratios)} pairs); "
          f"target 0.95-1.05: {'met' if 0.95 <= r_med <= 1.05 else 'NOT met'}")
    print(f"records: {stats.submitted} submitted, {stats.sent} sent, {stats.dropped} dropped (counted), "
          f"client recreated {stats.recreated}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
