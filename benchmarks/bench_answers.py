"""How fast `dvi drafter bootstrap` answers its corpus: the target's own `generate` against vLLM's engine in the process
(`dvi.cli.vllm.answers`), on the same prompts, in the same run.

    python -m benchmarks.bench_answers --prompts 64 --new-tokens 128 --batch 16 --out benchmarks/results/bench_answers-cpu.json

Both answer the first `--prompts` chat prompts of the corpus greedily, in batches of `--batch`, in the dtype serving
runs the target in (`model.dtype`); vLLM compiled unless `--eager` (its compile cache under dvi's cache: the first
start on a machine compiles for minutes, not counted: the engine is built before the clock starts). Reported: answers,
generated tokens and tokens a second of each, and how many answers were the same tokens. Run it alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from benchmarks import emit
from dvi import corpus
from dvi.cli.vllm.answers import VllmAnswers
from dvi.config import load_config
from dvi.hardware import resolve_device, resolve_dtype
from dvi.models import end_ids
from dvi.pairs import resolve_pair
from trainers import bootstrap


def timed(answerer, batches, stops, new_tokens, pad) -> tuple[list, float]:
    t0 = time.perf_counter()
    out = [a for b in batches for a in answerer(b, stops, new_tokens, 0, pad)]
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128, dest="new_tokens")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eager", action="store_true", help="vLLM without compiling (serve.vllm.enforce_eager)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cfg = load_config([f"serve.vllm.enforce_eager={str(args.eager).lower()}"])
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    pair = resolve_pair(replace(cfg.model, dtype=str(dtype).removeprefix("torch.")), with_drafter=False)
    prompts = [replace(p, split="train") for p in corpus.bootstrap_prompts() if p.chat][: args.prompts]
    todo = bootstrap.jobs(prompts, pair.tokenizer, 1, bootstrap.Plan.max_prompt_tokens)
    batches = [todo[i : i + args.batch] for i in range(0, len(todo), args.batch)]
    stops = end_ids(pair.target, pair.tokenizer)
    pad = pair.tokenizer.pad_token_id
    results = {}
    hf, seconds = timed(lambda b, *a: bootstrap.answer(pair.target, b, *a), batches, stops, args.new_tokens, pad)
    results["generate"] = {"seconds": seconds, "tokens": sum(len(g) for g, _, _ in hf)}
    engine = VllmAnswers(pair.target_dir, cfg.serve.vllm, str(dtype).removeprefix("torch."), args.batch,
                         bootstrap.Plan.max_prompt_tokens + args.new_tokens + 1)
    try:
        fast, seconds = timed(engine, batches, stops, args.new_tokens, pad)
    finally:
        engine.close()
    results["vllm"] = {"seconds": seconds, "tokens": sum(len(g) for g, _, _ in fast), "compiled": not args.eager}
    for r in results.values():
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
    out = {"what": "dvi drafter bootstrap's answers: the target's generate vs vLLM's engine in the process",
           "command": "python -m benchmarks.bench_answers " + " ".join(argv if argv is not None else sys.argv[1:]),
           "answers": len(todo), "new_tokens": args.new_tokens, "batch": args.batch, "dtype": str(dtype),
           "same_answers": sum(a[0] == b[0] for a, b in zip(hf, fast)), "hardware": bootstrap.hardware(),
           "torch_threads": torch.get_num_threads(), "results": results,
           "vllm_vs_generate": results["generate"]["seconds"] / results["vllm"]["seconds"]}
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
