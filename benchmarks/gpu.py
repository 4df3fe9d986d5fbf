"""Everything dvi checks and measures on a GPU host, in one command: the engine's correctness on CUDA and the trainer.

1. `engine_tests`: the engine's greedy and sampling tests (tests/dvi/test_engine.py, test_engine_eagle3.py: greedy
   output equal to the target's own `generate`, drafts equal to an uncached reference, emitted tokens following the
   target's distribution by a chi-square test) under pytest with `DVI_TEST_DEVICE=cuda` (tiny fp32 models on the GPU);
2. `greedy`: the demo pair on the GPU, both drafter kinds, fp32 and bf16: dvi's engine drafting (K = 4) against dvi's
   engine alone (target-only), greedy, on `--prompts` code prompts at once (batch = all of them). Every answer must
   be equal; where one is not, the first token that differs is looked up on a fresh forward of the target: a
   near-tie (both answers' tokens within `--tie-logits` of the best logit there: bf16 logits of this size are
   0.125 apart, and a batch of another shape can round them the other way) is reported as such, anything else is
   a failure;
3. `trainer`: `benchmarks.bench_trainer` on the GPU for both kinds (the EAGLE-3 default first): positions/s beside
   the plain PyTorch loop, held-out acceptance against training time.

Writes `<out>/gpu.json` (hardware, versions, every section) after each section, so a run cut short keeps what it
measured. Run on the GPU host after the install of `../shared/gpu/README.md`:
`python3 -m benchmarks.gpu --out $OUT [--target GGUF]` (about 9 minutes on one H100, the model's import included). Records: benchmarks/results/gpu-*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from importlib.metadata import version
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_trainer  # noqa: E402
from dvi.config import ModelConfig, SpecConfig  # noqa: E402
from dvi.engine import SpeculativeEngine  # noqa: E402
from dvi.engine_api import Request  # noqa: E402
from dvi.models import end_ids  # noqa: E402
from dvi.pairs import resolve_pair  # noqa: E402

ENGINE_TESTS = ["tests/dvi/test_engine.py", "tests/dvi/test_engine_eagle3.py"]
ENGINE_SELECTION = "(greedy or sampled_tokens or batch_equals_one) and not demo"


def environment() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "host": platform.node()}
    for name in ("deepspeed", "kafka-python", "mlflow-skinny", "hydra-core"):
        try:
            out[name] = version(name)
        except Exception:
            out[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    return out


def engine_tests(device: str) -> dict:
    """The engine's greedy and sampling tests on `device` (pytest in a child process); its summary line and code."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ENGINE_TESTS, "-k", ENGINE_SELECTION],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "DVI_TEST_DEVICE": device})
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    print("\n".join(lines[-15:]), flush=True)
    return {"device": device, "returncode": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:],
            "failures": [line for line in lines if line.startswith("FAILED")], "seconds": time.perf_counter() - t0}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two answers differ (one ending early counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy(target: str | None, kind: str, dtype: str, device: str, n_prompts: int, new_tokens: int, tie_logits: float) -> dict:
    """The demo pair's drafted greedy answers against its target-only ones (see the module docstring)."""
    pair = resolve_pair(ModelConfig(target=target, drafter_kind=kind, drafter_layers=2, device=device, dtype=dtype))
    train, held = bench_trainer.domain_prompts(pair.tokenizer, "code", n_prompts, n_prompts)
    prompts = (held + train)[:n_prompts]
    stop = end_ids(pair.target, pair.tokenizer)

    def answers(drafter) -> tuple[list, float]:
        engine = SpeculativeEngine(pair.target, drafter, SpecConfig(k=4, adaptive=False), stop_ids=stop, max_batch=len(prompts))
        t0 = time.perf_counter()
        with torch.inference_mode():
            res = engine.generate([Request(p, max_new_tokens=new_tokens) for p in prompts])
        return res, time.perf_counter() - t0

    drafted, drafted_s = answers(pair.drafter)
    alone, alone_s = answers(None)
    equal, ties, failures = 0, [], []
    for p, d, a in zip(prompts, drafted, alone):
        i = first_difference(d.token_ids, a.token_ids)
        if i is None:
            equal += 1
            continue
        with torch.inference_mode():
            logits = pair.target(torch.tensor([p + a.token_ids[:i]], device=pair.target.device)).logits[0, -1].float()
        mine, theirs = (d.token_ids[i] if i < len(d.token_ids) else -1), (a.token_ids[i] if i < len(a.token_ids) else -1)
        # how far each answer's token is below the best logit of a fresh forward (None: that answer had ended)
        below = [float(logits.max() - logits[t]) if t >= 0 else None for t in (mine, theirs)]
        case = {"at": i, "drafted_token": mine, "target_only_token": theirs, "below_best_logit": below}
        (ties if None not in below and max(below) <= tie_logits else failures).append(case)
    rounds = [r for res in drafted for r in res.rounds if r.k]
    acceptance = sum(r.accepted for r in rounds) / max(1, sum(r.k for r in rounds))
    out = {"kind": kind, "dtype": str(pair.target.dtype).removeprefix("torch."), "prompts": len(prompts), "new_tokens": new_tokens,
           "equal": equal, "near_ties": ties, "failures": failures, "tie_logits": tie_logits, "acceptance": acceptance,
           "drafted_s": drafted_s, "target_only_s": alone_s}
    print(f"greedy {kind} {out['dtype']}: {equal}/{len(prompts)} equal, {len(ties)} near-ties, {len(failures)} failures "
          f"(acceptance {acceptance:.3f}; {drafted_s:.1f} s drafted, {alone_s:.1f} s target-only)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default=None, help="model.target: default the demo target; a .gguf file (the GPU bundle's "
                    "/tmp/dvi-model/SmolLM2-135M-Instruct.Q4_1.gguf) is imported offline")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tie-logits", type=float, default=0.25, help="a difference this close in logits is a near-tie")
    ap.add_argument("--skip", default="", help="sections to leave out, comma-separated: engine_tests, greedy, trainer, "
                    "trainer_recompute")
    ap.add_argument("--trainer-args", default="--kinds eagle3,layers --domain code --minutes 2,0.5 --eval-every-s 15 --plain-s 10 "
                    "--train-prompts 600 --samples 1 --eval-prompts 160 --new-tokens 128 --gen-batch 400 --batch-tokens 8192 "
                    "--records-from target",
                    help="arguments of benchmarks.bench_trainer (besides --device and --json)")
    args = ap.parse_args()
    transformers.utils.logging.set_verbosity_error()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = args.out / "gpu.json"
    skip = set(filter(None, args.skip.split(",")))

    def save() -> None:
        path.write_text(json.dumps(report, indent=2, default=str))

    save()
    sections = [("engine_tests", lambda: engine_tests(args.device)),
                ("greedy", lambda: [greedy(args.target, kind, dtype, args.device, args.prompts, args.new_tokens, args.tie_logits)
                                    for dtype in ("float32", "bfloat16") for kind in ("eagle3", "layers")]),
                ("trainer", lambda: bench_trainer.main(["--device", args.device, "--json", str(args.out / "trainer.json"),
                                                        *(["--target", args.target] if args.target else []),
                                                        *args.trainer_args.split()])),
                # the EAGLE-3 drafter again with its features recomputed by the trainer's copy of the target (the records'
                # features, the run above, hold none): positions a second and GPU memory, with and without the target
                ("trainer_recompute", lambda: bench_trainer.main(["--device", args.device, "--json", str(args.out / "trainer_recompute.json"),
                                                                  *(["--target", args.target] if args.target else []),
                                                                  *args.trainer_args.split(), "--kinds", "eagle3", "--minutes", "1",
                                                                  "--plain-s", "0", "--features", "recompute"]))]
    for name, run in sections:
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            report[name] = run()
        except Exception as e:  # one section failing must not lose the others' figures
            traceback.print_exc()
            report[name] = {"error": f"{type(e).__name__}: {e}"}
        report.setdefault("seconds", {})[name] = time.perf_counter() - t0
        save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
