"""Allocator benchmark: what capping glibc's malloc arenas (`dvi.alloc`, two arenas) costs a serving replica.

Two `dvi serve` processes on the demo pair run side by side: one as dvi starts it (two arenas) and one with
`MALLOC_ARENA_MAX` set to glibc's own default cap (8 per core), which dvi leaves alone. Only one of them gets
load at a time: a block is two clients sending the same chat prompts (greedy, so the same work every time) to
one server, and the blocks alternate in ABBA order (capped, default, default, capped, ...) so that a drift of the
machine's speed falls on both alike. Figures: tokens/s per block, the median of the paired ratios capped/default
with its interquartile range, and each server's resident memory after the run.

What it does not know: memory growth over time (the soak, `benchmarks.soak`, measures that),
the trainer, decision logging (off here, as in bench_serve.py's HTTP part).

Run: .venv/bin/python benchmarks/bench_alloc.py [--cycles 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import Server, http_load, log  # noqa: E402  (bench_serve puts the repository on sys.path)
from dvi.procs import rss_mib  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=4, help="ABBA cycles (each: two blocks per server)")
    ap.add_argument("--requests", type=int, default=8, help="requests per block")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    default_cap = str(8 * (os.cpu_count() or 1))
    servers = {"capped": Server([], no_draft=False), "default": Server([], no_draft=False, env={"MALLOC_ARENA_MAX": default_cap})}
    blocks: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for s in servers.values():
            http_load(s.url, 2, 4, args.max_tokens)  # warm-up
        for cycle in range(args.cycles):
            for name in ("capped", "default", "default", "capped"):
                row = http_load(servers[name].url, 2, args.requests, args.max_tokens)
                blocks[name].append(row["tok_per_s"])
                log(f"cycle {cycle}: {name} {row['tok_per_s']:.1f} tok/s")
        memory = {name: rss_mib(s.proc.pid) for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.close()

    ratios = sorted(a / b for a, b in zip(blocks["capped"], blocks["default"]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"tokens/s, median of {len(ratios)} blocks: capped {statistics.median(blocks['capped']):.2f}, "
          f"default (MALLOC_ARENA_MAX={default_cap}) {statistics.median(blocks['default']):.2f}")
    print(f"capped / default: median {statistics.median(ratios):.3f} (IQR {q[0]:.3f}-{q[2]:.3f})")
    print(f"resident memory after the run: capped {memory['capped']:.0f} MiB, default {memory['default']:.0f} MiB")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"blocks": blocks, "ratios": ratios, "memory_mib": memory}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
