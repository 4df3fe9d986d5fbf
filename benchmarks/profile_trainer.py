"""Where an EAGLE-3 training step's time goes on this machine: a breakdown of one step of the demo drafter, phase by
phase, beside the same step as the trainer took it before features came from records (the target recomputing them,
fp32, every unrolled drafting step over every position, a dense teacher).

One process, the demo pair, a batch of `--batch-tokens` teacher positions from real records (dvi's engine answering
code prompts, carrying the target's features as a replica sends them). Each phase is timed alone, the median of
`--reps` runs after a warm-up, in each configuration:

- `data`: packing the records into a batch (`trainers.data.collate`, the features decoded from their encoding);
- `features`: the target's forward giving them (recompute only: the trainer's copy of the target, in bf16);
- `first pass`: the drafter's keys and values at every position, its layer at the positions some step reads;
- `step k`: the drafter's layer at its positions for drafting step k (k >= 1), on its own output of step k - 1;
- `head + loss`: the draft-vocabulary head and `position_loss` over the teacher positions, every step;
- `backward`, `optimizer` (AdamW over the drafter), and `deepspeed`: a whole step through DeepSpeed's engine less the
  same step in plain PyTorch (its own bookkeeping).

`--memory`: the trainer's peak memory (resident set) as a whole process, with and without its copy of the target:
`dvi drafter distill` on a file of a few of those records, once with trainer.features=records, once with recompute.

Run alone: .venv/bin/python -m benchmarks.profile_trainer [--batch-tokens 1024] [--memory] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_trainer import domain_prompts, make_records  # noqa: E402
from dvi import eagle3  # noqa: E402
from dvi.config import ModelConfig, TrainerConfig  # noqa: E402
from dvi.pairs import load_any_drafter, resolve_pair  # noqa: E402
from trainers import ds  # noqa: E402
from trainers.data import collate, example_from_record  # noqa: E402
from trainers.losses import position_loss, teacher_from_topk  # noqa: E402
from trainers.students import Eagle3PositionLM, autocast, ttt_position_loss  # noqa: E402

STEPS = 3
# runs the command it is given and prints its peak resident KiB (each measurement in a process of its own)
PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs, after one untimed."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wanted(batch, t: int) -> torch.Tensor:
    """The draft indices some unrolled step reads ([B, T - 1] bool), as `Eagle3PositionLM` computes them."""
    want = torch.zeros(batch.input_ids.shape[0], t - 1, dtype=torch.bool)
    for k in range(STEPS):
        at = batch.cols - 1 - k
        on = at >= 0
        want[batch.rows[on], at[on]] = True
    return want


def profile(name: str, drafter, batch, teacher, target, precision: str, legacy: bool, reps: int) -> dict:
    """The phases of one step (see the module docstring); `legacy`: as before (recomputed features, all positions,
    a dense teacher)."""
    cpu = torch.device("cpu")
    out: dict[str, float] = {}
    vocab_map = eagle3.target_ids(drafter.d2t)
    if legacy:
        out["features"] = timed(lambda: eagle3.target_features(target, batch.input_ids, drafter.layer_ids,
                                                               batch.attention_mask), reps)
        feats = eagle3.target_features(target, batch.input_ids, drafter.layer_ids, batch.attention_mask)
        teacher = teacher.dense(vocab_map.numel())
    else:
        out["features"] = 0.0
        feats = batch.features
    t = batch.input_ids.shape[1]
    want = wanted(batch, t)
    with torch.no_grad(), autocast(cpu, precision):
        f = feats.to(drafter.fc.weight.dtype)
        if legacy:
            out["first pass"] = timed(lambda: eagle3.ttt_prenorms(drafter, f, batch.input_ids, 1), reps)
            for k in range(1, STEPS):
                out[f"step {k}"] = (timed(lambda k=k: eagle3.ttt_prenorms(drafter, f, batch.input_ids, k + 1), reps)
                                    - timed(lambda k=k: eagle3.ttt_prenorms(drafter, f, batch.input_ids, k), reps))
        else:
            out["first pass"] = timed(lambda: eagle3.ttt_prenorms_at(drafter, f, batch.input_ids, want, 1), reps)
            for k in range(1, STEPS):
                out[f"step {k}"] = (timed(lambda k=k: eagle3.ttt_prenorms_at(drafter, f, batch.input_ids, want, k + 1), reps)
                                    - timed(lambda k=k: eagle3.ttt_prenorms_at(drafter, f, batch.input_ids, want, k), reps))
        prenorm = torch.randn(batch.positions, drafter.config.hidden_size)

        def head_and_loss():
            for _ in range(STEPS):
                position_loss(drafter.head(prenorm), teacher, batch.drafted, batch.reward, batch.judged, batch.weight,
                              vocab_map=vocab_map)

        out["head + loss"] = timed(head_and_loss, reps)
    module = Eagle3PositionLM(drafter, target if legacy else None)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    fixed = replace(batch, features=None) if legacy else batch  # legacy: the target computes them in the forward

    def loss():
        with autocast(cpu, precision):
            return ttt_position_loss(module, fixed, teacher, STEPS, "fkl", 1.0, 0.0, 0.5, vocab_map)[0]

    forward = timed(loss, reps)

    def forward_backward():
        loss().backward()
        opt.zero_grad(set_to_none=True)

    out["backward"] = timed(forward_backward, reps) - forward
    for p in params:
        p.grad = torch.zeros_like(p)
    out["optimizer"] = timed(opt.step, reps)

    def plain():
        loss().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    plain_s = timed(plain, reps)
    engine = ds.build_engine(module, TrainerConfig(precision="fp32", lr=1e-5))  # bf16-mixed is fp32 to DeepSpeed

    def through_deepspeed():
        with autocast(cpu, precision):
            value = ttt_position_loss(engine, fixed, teacher, STEPS, "fkl", 1.0, 0.0, 0.5, vocab_map)[0]
        engine.backward(value)
        engine.step()

    out["deepspeed"] = timed(through_deepspeed, reps) - plain_s
    out["step"] = plain_s + out["deepspeed"]  # the features' forward included (legacy)
    return out


def trainer_memory(records, work: Path) -> dict:
    """Peak resident MiB of `dvi drafter distill` (a whole trainer process: DeepSpeed, the drafter, the buffers) over a
    file of `records`, by trainer.features: records (no copy of the target) and recompute (its copy, fp32, and the
    bf16 copy serving's dtype gives the features in)."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "records.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    out = {}
    for mode in ("records", "recompute"):
        cmd = [sys.executable, "-m", "dvi.cli", "drafter", "distill", "--file", str(path), "--steps", "2", "--json",
               "tracking.enabled=false", f"trainer.features={mode}", f"trainer.run_dir={work / mode}",
               f"trainer.store={work / mode / 'store'}", "trainer.holdout_first=0", "trainer.holdout_share=0"]
        # a world of its own: not this process's rendezvous (which init_distributed left in the environment)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        done = subprocess.run([sys.executable, "-c", PEAK, *cmd], capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode:
            raise SystemExit(f"distill ({mode}) failed: {done.stderr[-2000:]}")
        out[mode] = int(done.stdout.strip().splitlines()[-1]) / 1024  # KiB -> MiB
        print(f"trainer.features={mode}: peak {out[mode]:,.0f} MiB", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="also the trainer's peak memory with and without the target")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    ds.init_distributed()
    pair = resolve_pair(ModelConfig(drafter_kind="eagle3", device="cpu", dtype="float32"))
    prompts, _ = domain_prompts(pair.tokenizer, "code", args.prompts, 0)
    records, _ = make_records(pair, prompts, 1, args.new_tokens, 8, drafted=False, features_layers=tuple(pair.drafter.layer_ids))
    examples, used = [], 0
    for r in records:
        e = example_from_record(r, 512)
        if used + e.positions > args.batch_tokens and examples:
            break
        examples.append(e)
        used += e.positions
    data_s = timed(lambda: collate(examples), args.reps)
    batch = collate(examples)
    print(f"batch: {len(examples)} records, {batch.positions} teacher positions, {batch.input_ids.numel()} tokens "
          f"({batch.input_ids.shape[1]} the longest); collate {data_s * 1000:.0f} ms", flush=True)
    target = pair.target.to(torch.bfloat16)  # serving's dtype: what the trainer recomputed features in
    teacher = teacher_from_topk(batch.topk_ids, batch.topk_logprobs, int(pair.target.config.vocab_size),
                                eagle3.target_ids(pair.drafter.d2t))
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "records": len(examples),
               "positions": batch.positions, "tokens": batch.input_ids.numel(), "longest": batch.input_ids.shape[1],
               "data_s": data_s, "phases": {}}
    drafter_dir = pair.drafter_dir
    for name, precision, legacy in (("before: recomputed features, fp32, every position, dense teacher", "fp32", True),
                                    ("features from records, fp32", "fp32", False),
                                    ("features from records, bf16-mixed", "bf16-mixed", False)):
        drafter = load_any_drafter(drafter_dir, int(pair.target.config.vocab_size), torch.float32, "cpu",
                                   embed=pair.target.get_input_embeddings().weight.detach().float()).model.train()
        phases = profile(name, drafter, batch, teacher, target, precision, legacy, args.reps)
        phases["data"] = data_s
        phases["positions_per_s"] = batch.positions / (phases["step"] + data_s)
        print(f"{name}: " + ", ".join(f"{k} {v * 1000:.0f} ms" if k != "positions_per_s" else f"{v:.0f} positions/s"
                                      for k, v in phases.items()), flush=True)
        results["phases"][name] = phases
    if args.memory:
        with tempfile.TemporaryDirectory() as tmp:
            results["peak_rss_mib"] = trainer_memory(records[:8], Path(tmp))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
