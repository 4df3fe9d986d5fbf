"""What the readers of vLLM's shared-memory queues cost serving under `dvi up`'s pause policy.

`dvi serve` is started twice on the demo pair with the loop's channels off (no records, no swaps, no MLflow): `parked`
with a busy directory as `dvi up` gives its server (`dvi.busy.ENV`: its vLLM readers follow
`dvi.cli.vllm.loop.park_idle_readers`), `vllm` without one (vLLM's own readers: each spins a second after its last
read). Nothing else runs: no trainer, no turns. The same chat prompts go to both in turn, which goes first alternating,
with a pause after each answer; reported are the median over prompts of parked's latency over vllm's, and each
server's seconds per verification round and drafts per round (their planners may pick different K).

    python -m benchmarks.readers [--prompts 20] [--pause-s 0.5] [--max-tokens 48] [--json PATH]

The servers run the dvi of the checkout this file is in (to measure another revision's readers, copy it there).
It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks import workloads
from benchmarks.bench_vllm import Server
from benchmarks.drift import Sample, ask, sample_of
from dvi.busy import ENV as BUSY_ENV
from dvi.procs import free_port

OFF = ["serve.swap.enabled=false", "serve.log_decisions=false", "tracking.enabled=false"]


def summary(rows: dict[str, list[Sample]]) -> dict:
    """Per server: seconds per round and drafts per round over all its answers; and parked's latency over vllm's, the
    median over prompts (pure)."""
    out: dict = {}
    for name, answers in rows.items():
        rounds = sum(a.rounds for a in answers)
        out[name] = {"answers": len(answers), "seconds_per_round": sum(a.seconds for a in answers) / rounds if rounds else None,
                     "drafts_per_round": sum(a.drafted for a in answers) / rounds if rounds else None}
    pairs = list(zip(rows["parked"], rows["vllm"]))
    out["latency_parked_vs_vllm"] = statistics.median(p.seconds / v.seconds for p, v in pairs) if pairs else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readers", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20, help="prompts, each asked of both servers (default 20)")
    p.add_argument("--pause-s", type=float, default=0.5, dest="pause_s", help="pause after each answer (default 0.5)")
    p.add_argument("--max-tokens", type=int, default=48, dest="max_tokens", help="new tokens per answer (default 48)")
    p.add_argument("--json", type=Path, help="write the result here too")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dvi-readers-"))
    cmd = [sys.executable, "-m", "dvi.cli", "serve", *OFF]
    servers = {"parked": Server("parked", [*cmd, "stream.replica_id=parked"], {**os.environ, BUSY_ENV: str(work / "busy")}, None, "dvi"),
               "vllm": Server("vllm", [*cmd, "stream.replica_id=vllm"], {k: v for k, v in os.environ.items() if k != BUSY_ENV}, None, "dvi")}
    children, urls = {}, {}
    try:
        for name, server in servers.items():  # one after the other: two compiling at once would slow both
            children[name], urls[name] = server.start(free_port(), work / "logs")
            print(f"readers: {name} ready at {urls[name]}", file=sys.stderr, flush=True)
        prompts = workloads.prompts("code", "live", 0)
        rows: dict[str, list[Sample]] = {"parked": [], "vllm": []}
        t0 = time.monotonic()
        for i in range(args.prompts):
            for name in ("parked", "vllm") if i % 2 == 0 else ("vllm", "parked"):
                answer, seconds = ask(urls[name], prompts[i % len(prompts)], args.max_tokens)
                rows[name].append(sample_of(answer, seconds, slot=i, phase=0, domain="code", side=name, t=time.monotonic() - t0))
                time.sleep(args.pause_s)
    finally:
        for child in children.values():
            child.stop(grace_s=30)
    result = {**summary(rows), "prompts": args.prompts, "pause_s": args.pause_s, "max_tokens": args.max_tokens,
              "rows": {name: [asdict(a) for a in answers] for name, answers in rows.items()}}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
