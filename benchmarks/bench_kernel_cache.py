"""Kernel-cache benchmark: what the trainer's bf16 target forward keeps per batch shape, with torch's caches of
oneDNN kernels at their defaults and as `dvi train` caps them (`dvi.alloc.limit_kernel_caches`).

The forward is the one giving an EAGLE-3 drafter its features (`dvi.eagle3.target_features`, the demo target in
bf16, the drafter's default aux layers) over batches shaped as the trainer's are: a few records of 64 to 512
tokens, padded to the longest, so nearly every batch has a token count of its own. Each setting runs in a fresh
interpreter (the caches live as long as the process), one after the other, on the same batches. Figures per
setting: the C heap in use (`dvi.alloc.heap_figures`, after `release_free`) at the start and after every
`--every` forwards, its rise per forward, and the median seconds per forward.

What it does not know: the drafter's own training step (fp32: its matmuls keep nothing per shape), the rest of the
trainer's memory (its queues, the gate's baseline), a GPU (CUDA keeps no such per-shape cache for these matmuls).

Run: .venv/bin/python benchmarks/bench_kernel_cache.py [--forwards 100] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dvi.alloc import KERNEL_CACHES, heap_figures, limit_arenas, limit_kernel_caches, release_free  # noqa: E402  (no torch)


def batches(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(rows, padded length) of `n` batches drawn as the trainer's fall: 1 to 6 records of 64 to 512 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows = rng.randint(1, 6)
        out.append((rows, max(rng.randint(64, 512) for _ in range(rows))))
    return out


def child(forwards: int, every: int, capped: bool) -> dict:
    """One setting, in this process: the forwards and their figures (torch loads here, after the caches' setting)."""
    limit_arenas()
    if capped:
        limit_kernel_caches()
    import torch

    from dvi.config import load_config
    from dvi.eagle3 import default_layer_ids, target_features
    from dvi.pairs import resolve_pair

    cfg = load_config(["model.dtype=bfloat16", "model.device=cpu"])
    target = resolve_pair(cfg.model, with_drafter=False).target.eval().requires_grad_(False)
    layers = default_layer_ids(target.config.num_hidden_layers)
    gen = torch.Generator().manual_seed(0)

    def heap() -> float:
        release_free()
        return round(heap_figures()["in_use"], 1)

    target_features(target, torch.ones(1, 8, dtype=torch.long), layers)  # warm-up: the first forward's own buffers
    start, series, took = heap(), [], []
    for i, (rows, length) in enumerate(batches(forwards), 1):
        ids = torch.randint(0, target.config.vocab_size, (rows, length), generator=gen)
        t = time.perf_counter()
        target_features(target, ids, layers, attention_mask=torch.ones_like(ids))
        took.append(time.perf_counter() - t)
        if i % every == 0:
            series.append([i, heap()])
    caches = {k: os.environ.get(k, "default") for k in KERNEL_CACHES}
    return {"capped": capped, "caches": caches, "heap_in_use_mib_start": start, "heap_in_use_mib": series,
            "rise_mib_per_forward": round((series[-1][1] - start) / forwards, 3), "median_s": statistics.median(took),
            "torch": torch.__version__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forwards", type=int, default=100)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--child", choices=["default", "capped"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.forwards, args.every, args.child == "capped")))
        return 0

    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHES}
    runs = {}
    for name in ("default", "capped"):
        cmd = [sys.executable, __file__, "--child", name, "--forwards", str(args.forwards), "--every", str(args.every)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        runs[name] = json.loads(out.strip().splitlines()[-1])
        r = runs[name]
        print(f"{name} ({r['caches']}): heap in use {r['heap_in_use_mib_start']} MiB at the start, "
              f"{' '.join(f'{i}:{m}' for i, m in r['heap_in_use_mib'])} MiB after forwards; "
              f"{r['rise_mib_per_forward']} MiB a forward; median {r['median_s']:.3f} s a forward", flush=True)
    ratio = runs["capped"]["median_s"] / runs["default"]["median_s"]
    print(f"capped / default, median seconds a forward: {ratio:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"forwards": args.forwards, "cpu": os.cpu_count(), "runs": runs,
                                               "time_ratio_capped_default": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
