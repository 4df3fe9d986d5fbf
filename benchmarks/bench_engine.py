"""Engine benchmark: the dvi speculative engine against plain and assisted Hugging Face decoding, on the demo pair.

One process, one run, every path side by side on the same chat prompts (greedy, batch 1, on `--device`, CPU by
default where there is no CUDA):

- target only: `target.generate(do_sample=False)` (the baseline every speedup is relative to) and the dvi
  engine with no drafter;
- the dvi engine with the demo drafter (target embeddings + first 2 layers + head), fixed K and adaptive K;
- Hugging Face assisted generation with the same drafter model and a constant K;
- the dvi engine with the target as its own drafter (acceptance 1): the engine's overhead against the ideal;
- the dvi engine with reduced-vocabulary drafters (K = 4): what a smaller head does to c and to acceptance;
- with --trained DIR, the dvi engine with a drafter the online trainer produced (K = 4 and adaptive K).

Per path: tokens/s (generated tokens / wall seconds of one prompt, median over blocks: a block is one prompt
in one repeat, during which every path runs back to back), speedup against HF target-only (median over blocks
of the paired per-block ratio; blocks far off the median are listed as disturbed), acceptance rate and mean
accepted length (counting the bonus / recovered token, as in `dvi.speculative`), and the cost-model terms
measured in the same run with plain cached HF forwards: c = drafter step / target step, v_K = one
(K+1)-token forward / target step, ideal = `ideal_speedup(a, K, c, v_K)` with the measured acceptance a,
and % of ideal = speedup / ideal. Greedy outputs of every path are compared with HF target-only.
Configurations are interleaved round-robin (the order rotates per prompt and per repeat) because the machine
is noisy; everything runs under `torch.inference_mode()`.

What it does not know: sampled decoding (temperature > 0 changes acceptance), batches larger than one,
anything outside the model calls (tokenization, streams, the HTTP service, MLflow), trained drafters (the demo
drafter is untrained, so its acceptance is near zero: these numbers describe the starting point). On CUDA the
step costs are timed with a device synchronisation around each forward; the rest is the same code. The
ideal assumes i.i.d. per-token acceptance and counts only model forwards; for adaptive K it is the best fixed
K in 1..8 for the measured acceptance (or 1.0, plain decoding, when no K beats it). c and v_K come from plain
HF forwards with the default causal mask, not the engine's 4D-mask path, so engine bookkeeping shows up as a
gap to the ideal. On this CPU build (torch 2.13 + MKL, fp32) v_K is not monotone in K: a matmul with 2 or 3
rows costs about 2.4x / 3.5x a 1-row one and 4-5 rows only about 1.8x, so verifying K=2 (3 tokens) can cost
more than K=4. HF assisted acceptance is read by wrapping `AssistedCandidateGenerator.
update_candidate_strategy` for the duration of the run (transformers offers no counter).

Transformers 5.23 note: `num_assistant_tokens` / `num_assistant_tokens_schedule` passed to `target.generate`
land in the target's generation config and are ignored; the assisted candidate generator reads the
*assistant's* `generation_config` (default 20 tokens, and a 0.4 confidence threshold that stops drafting
early and is re-tuned every round when scikit-learn is installed). So this script also sets K, "constant"
and a zero confidence threshold on the drafter's generation config, and reports per row how many rounds
drafted a K other than the fixed one ("K off"; rounds clipped by the token budget do not count).

Run: .venv/bin/python benchmarks/bench_engine.py [--quick] [--json PATH]; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from dvi.config import SpecConfig
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.errors import DviError
from dvi.models import (
    DRAFTER_META,
    Drafter,
    build_drafter,
    cache_kwarg,
    default_cache_dir,
    fetch_demo_target,
    load_causal_lm,
    load_drafter,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from dvi.speculative import ideal_speedup

PROMPTS = [
    "Explain what a hash table is and when you would use one.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for writing clear technical documentation.",
    "What is the difference between a process and a thread?",
    "Summarize the causes of the French Revolution in a few sentences.",
    "Write a short poem about the sea.",
]
ADAPTIVE_K_RANGE = range(1, 9)  # SpecConfig's default k_min..k_max: v_K is measured for all of them
ADAPTIVE_ENGINES: dict[str, SpeculativeEngine] = {}  # path name -> engine, for its cost table in the JSON
OUTLIER = 1.5  # a block whose speedup is this far off the row's median is reported as disturbed


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# One generation call and what it reports.


@dataclass
class Run:
    tokens: list[int]  # generated ids (a stop token, if hit, is the last one)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0  # verification rounds (plain decoding: one per token)
    k_off: int = 0  # rounds whose K was neither the fixed K nor the budget-clipped K


@dataclass
class Variant:
    name: str
    family: str  # hf-plain | dvi-plain | dvi | dvi-adaptive | hf-assisted | dvi-self | dvi-vocab | dvi-trained
    k: int | None  # fixed K; None for plain and adaptive
    drafter: str | None  # key into the measured step costs: "full", "self", "v4096", ...
    run: Callable[[list[int], int], Run]
    compare: str | None = None  # name of the HF assisted path at the same K (for the dvi/HF ratio)


def expected_k(k: int, max_new: int, generated: int) -> int:
    """The K a fixed-K decoder drafts with `generated` tokens done: both HF and dvi never draft past the budget."""
    return max(0, min(k, max_new - generated - 1))


def hf_plain(target: PreTrainedModel, eos: int, pad: int) -> Callable[[list[int], int], Run]:
    def run(prompt: list[int], max_new: int) -> Run:
        x = torch.tensor([prompt], device=target.device)
        out = target.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=pad
        )
        tokens = out[0, len(prompt) :].tolist()
        return Run(tokens, rounds=len(tokens))

    return run


_HF_ROUNDS: list[tuple[int, int, int]] = []  # (sequence length after the round, candidates, matches)


@contextmanager
def recording_hf_rounds():
    """Record every assisted-generation round: HF keeps no per-round counter we could read afterwards."""
    original = AssistedCandidateGenerator.update_candidate_strategy

    def recording(self, input_ids, scores, num_matches):
        # scores: [1, candidates + 1, V]; num_matches: accepted candidates (after EOS / length cropping)
        _HF_ROUNDS.append((int(input_ids.shape[1]), int(scores.shape[1]) - 1, int(num_matches)))
        return original(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = recording
    try:
        yield
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = original


def hf_assisted(target: PreTrainedModel, assistant: PreTrainedModel, k: int, eos: int, pad: int) -> Callable[[list[int], int], Run]:
    def run(prompt: list[int], max_new: int) -> Run:
        # transformers 5.23 reads these from the assistant's config, not from generate()'s kwargs (see top)
        gc = assistant.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = k, "constant", 0.0
        x = torch.tensor([prompt], device=target.device)
        _HF_ROUNDS.clear()
        out = target.generate(
            x,
            attention_mask=torch.ones_like(x),
            assistant_model=assistant,
            do_sample=False,
            num_assistant_tokens=k,
            num_assistant_tokens_schedule="constant",
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        tokens = out[0, len(prompt) :].tolist()
        r = Run(tokens, rounds=len(_HF_ROUNDS))
        for length, cands, matches in _HF_ROUNDS:
            r.drafted += cands
            r.accepted += matches
            generated_before = length - len(prompt) - (matches + 1)
            r.k_off += cands != expected_k(k, max_new, generated_before)
        return r

    return run


def dvi_engine(engine: SpeculativeEngine, fixed_k: int | None) -> Callable[[list[int], int], Run]:
    def run(prompt: list[int], max_new: int) -> Run:
        (res,) = engine.generate([Request(prompt, max_new_tokens=max_new, seed=0)])
        s = res.stats
        k_off = 0 if fixed_k is None else sum(r.k != expected_k(fixed_k, max_new, r.position) for r in res.rounds)
        return Run(res.token_ids, s.drafted, s.accepted, s.rounds, k_off)

    return run


# ----------------------------------------------------------------------------------------------
# Step costs: plain cached HF forwards, timed one by one.


class StepTimer:
    """Times cached forwards of `tokens` new tokens on a fixed context; each model keeps its own cache."""

    def __init__(self, models: dict[str, PreTrainedModel], context: list[int]):
        self.models = models
        self.context_len = len(context)
        device = next(iter(models.values())).device
        self.feed = torch.tensor([context[-9:]], device=device)  # [1, 9] tokens to feed (what they are does not change the cost)
        self.caches = {}
        for name, model in models.items():
            cache = DynamicCache()
            model(input_ids=torch.tensor([context], device=device), use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
            self.caches[name] = cache
        self.samples: dict[tuple[str, int], list[float]] = {}

    def time_once(self, name: str, tokens: int) -> None:
        cache = self.caches[name]
        sync = torch.cuda.synchronize if self.feed.is_cuda else (lambda: None)  # time the kernels, not their launch
        sync()
        t0 = time.perf_counter()
        model = self.models[name]
        model(input_ids=self.feed[:, :tokens], use_cache=True, logits_to_keep=tokens, **{cache_kwarg(model): cache})
        sync()
        self.samples.setdefault((name, tokens), []).append(time.perf_counter() - t0)
        cache.crop(-tokens)  # transformers 5: a negative count drops that many tokens

    def measure(self, items: list[tuple[str, int]], reps: int, offset: int) -> None:
        for rep in range(reps):
            shift = (offset + rep) % len(items)
            for name, tokens in items[shift:] + items[:shift]:
                self.time_once(name, tokens)

    def median(self, name: str, tokens: int) -> float:
        return statistics.median(self.samples[(name, tokens)])


# ----------------------------------------------------------------------------------------------
# Setup.


def ensure_drafter(target_dir: Path, vocab: int | None) -> Path:
    out = default_cache_dir() / "models" / f"drafter-L2-{'v' + str(vocab) if vocab else 'full'}"
    if not (out / DRAFTER_META).exists():
        log(f"building drafter {out.name} (once)...")
        build_drafter(target_dir, out, layers=2, vocab=vocab)
    return out


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)["input_ids"])
        for p in PROMPTS[:n]
    ]


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


@dataclass
class Timings:
    """What the timed passes saw, per path name: [repeat] totals and [repeat][prompt] runs."""

    tokens: dict[str, list[int]]
    seconds: dict[str, list[float]]
    prompt_seconds: dict[str, list[list[float]]]
    runs: dict[str, list[list[Run]]]


def build_variants(target, drafters: dict[str, Drafter], ks: list[int], vocabs: list[int], vocab_k: int, eos: int, pad: int) -> list[Variant]:
    def engine(drafter: str | None, spec: SpecConfig) -> SpeculativeEngine:
        return SpeculativeEngine(target, drafters[drafter] if drafter else None, spec, stop_ids={eos})

    variants = [
        Variant("HF target-only", "hf-plain", None, None, hf_plain(target, eos, pad)),
        Variant("dvi target-only", "dvi-plain", None, None, dvi_engine(engine(None, SpecConfig()), None)),
    ]
    for k in ks:
        run = dvi_engine(engine("full", SpecConfig(k=k, adaptive=False)), k)
        variants.append(Variant(f"dvi K={k}", "dvi", k, "full", run, compare=f"HF assisted K={k}"))
    adaptive = engine("full", SpecConfig())
    adaptive.warm_up()  # the cost table adaptive K plans with (as `dvi serve` measures it at start-up)
    ADAPTIVE_ENGINES["dvi adaptive K"] = adaptive
    variants.append(Variant("dvi adaptive K", "dvi-adaptive", None, "full", dvi_engine(adaptive, None)))
    for k in ks:
        variants.append(Variant(f"HF assisted K={k}", "hf-assisted", k, "full", hf_assisted(target, drafters["full"].model, k, eos, pad)))
    for k in ks:
        variants.append(Variant(f"dvi self-draft K={k}", "dvi-self", k, "self", dvi_engine(engine("self", SpecConfig(k=k, adaptive=False)), k)))
    for v in vocabs:
        run = dvi_engine(engine(f"v{v}", SpecConfig(k=vocab_k, adaptive=False)), vocab_k)
        variants.append(Variant(f"dvi vocab {v} K={vocab_k}", "dvi-vocab", vocab_k, f"v{v}", run))
    if "trained" in drafters:  # --trained: a drafter the online trainer produced (bench_trainer.py --save)
        run = dvi_engine(engine("trained", SpecConfig(k=vocab_k, adaptive=False)), vocab_k)
        variants.append(Variant(f"dvi trained K={vocab_k}", "dvi-trained", vocab_k, "trained", run))
        trained = engine("trained", SpecConfig())
        trained.warm_up()
        ADAPTIVE_ENGINES["dvi trained adaptive K"] = trained
        variants.append(Variant("dvi trained adaptive K", "dvi-adaptive", None, "trained", dvi_engine(trained, None)))
    return variants


def timed_passes(
    variants: list[Variant], prompts: list[list[int]], max_new: int, repeats: int, timer: StepTimer, cost_items, cost_reps: int, started: float
) -> Timings:
    """Run every variant on every prompt, round-robin with a rotating order; time step costs around each repeat."""
    names = [p.name for p in variants]
    t = Timings(
        tokens={n: [0] * repeats for n in names},
        seconds={n: [0.0] * repeats for n in names},
        prompt_seconds={n: [[] for _ in range(repeats)] for n in names},
        runs={n: [[] for _ in range(repeats)] for n in names},
    )
    per_half = -(-cost_reps // (2 * repeats))  # step-cost samples before and after each repeat's runs
    for rep in range(repeats):
        log(f"repeat {rep + 1}/{repeats} ({time.perf_counter() - started:.0f} s)")
        timer.measure(cost_items, per_half, rep)
        for i, prompt in enumerate(prompts):
            shift = (rep * len(prompts) + i) % len(variants)
            for p in variants[shift:] + variants[:shift]:
                t0 = time.perf_counter()
                r = p.run(prompt, max_new)
                dt = time.perf_counter() - t0
                t.seconds[p.name][rep] += dt
                t.prompt_seconds[p.name][rep].append(dt)
                t.tokens[p.name][rep] += len(r.tokens)
                t.runs[p.name][rep].append(r)
                log(f"  prompt {i + 1}/{len(prompts)} {p.name}: {len(r.tokens)} tokens in {dt:.1f} s")
        timer.measure(cost_items, per_half, rep + 1)
    return t


def summarize(variants: list[Variant], t: Timings, c: dict[str, float], v: dict[int, float]) -> list[dict]:
    """One row of numbers per variant (see the module docstring for the definitions)."""
    base = variants[0].name  # HF target-only
    repeats, n_prompts = len(t.tokens[base]), len(t.runs[base][0])
    # a block is one prompt in one repeat: every variant ran on it back to back, so ratios are paired
    blocks = [(r, i) for r in range(repeats) for i in range(n_prompts)]
    tps = {
        p.name: [len(t.runs[p.name][r][i].tokens) / t.prompt_seconds[p.name][r][i] for r, i in blocks] for p in variants
    }  # [block]
    rows = []
    for p in variants:
        runs = t.runs[p.name]
        flat = [r for rep in runs for r in rep]
        drafted, accepted, n_rounds = sum(r.drafted for r in flat), sum(r.accepted for r in flat), sum(r.rounds for r in flat)
        a = accepted / drafted if drafted else None
        mismatch = sum(any(runs[rep][i].tokens != t.runs[base][rep][i].tokens for rep in range(repeats)) for i in range(n_prompts))
        first_diff = [first_difference(runs[0][i].tokens, t.runs[base][0][i].tokens) for i in range(n_prompts)]
        per_block = [x / y for x, y in zip(tps[p.name], tps[base])]
        speedup = median(per_block)
        ratio = median([x / y for x, y in zip(tps[p.name], tps[p.compare])]) if p.compare in tps else None
        outliers = [b for b, x in zip(blocks, per_block) if not 1 / OUTLIER < x / speedup < OUTLIER] if len(blocks) > 2 else []
        if p.family in ("hf-plain", "dvi-plain"):
            ideal, vk, cost = 1.0, None, None
        elif p.family == "dvi-adaptive":  # an oracle's fixed K for the measured acceptance, or plain decoding
            cost, vk = c[p.drafter], None
            ideal = max([1.0] + [ideal_speedup(a or 0.0, k, cost, v[k]) for k in ADAPTIVE_K_RANGE])
        else:
            cost, vk = c[p.drafter], v[p.k]
            ideal = ideal_speedup(a or 0.0, p.k, cost, vk)
        rows.append(
            {
                "path": p.name,
                "family": p.family,
                "k": p.k,
                "mean_k": drafted / n_rounds if n_rounds else 0.0,
                "drafter": p.drafter,
                "tokens_per_s": median(tps[p.name]),
                "tokens_per_s_blocks": tps[p.name],
                "tokens_per_s_total": [t.tokens[p.name][r] / t.seconds[p.name][r] for r in range(repeats)],
                "outlier_blocks": outliers,  # (repeat, prompt) whose speedup is off the median by more than OUTLIER x
                "speedup": speedup,
                "dvi_over_hf": ratio,
                "acceptance": a,
                "mean_accepted_length": (accepted + n_rounds) / n_rounds if n_rounds else None,
                "drafted": drafted,
                "accepted": accepted,
                "rounds": n_rounds,
                "c": cost,
                "v_k": vk,
                "ideal_speedup": ideal,
                "pct_of_ideal": speedup / ideal if speedup and ideal else None,
                "greedy_mismatch_prompts": mismatch,
                "first_mismatch_position": first_diff,
                "k_off_rounds": sum(r.k_off for r in flat),
                "tokens": t.tokens[p.name],
                "seconds": t.seconds[p.name],
                "prompt_seconds": t.prompt_seconds[p.name],
                "prompt_tokens": [[len(r.tokens) for r in rep] for rep in runs],
            }
        )
    return rows


def first_difference(mine: list[int], ref: list[int]) -> int | None:
    """Index of the first differing token (or where the shorter ends); None when equal."""
    j = next((j for j, (x, y) in enumerate(zip(mine, ref)) if x != y), None)
    return j if j is not None or len(mine) == len(ref) else min(len(mine), len(ref))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=None, help="tokens per prompt (default 56; --quick 16)")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes over all paths (default 1: one pass takes ~7 min)")
    ap.add_argument("--prompts", type=int, default=None, help=f"chat prompts, 1..{len(PROMPTS)} (default 4; --quick 1)")
    ap.add_argument("--ks", default="2,4,6", help="fixed K values for the drafter, HF assisted and self-draft rows")
    ap.add_argument("--vocabs", default="4096,16384", help="reduced drafter vocabularies ('' for none)")
    ap.add_argument("--vocab-k", type=int, default=4, help="K for the reduced-vocabulary rows")
    ap.add_argument("--cost-reps", type=int, default=None, help="timed forwards per cost term (default 20; --quick 6)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N, as model.device")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16")
    ap.add_argument("--trained", type=Path, default=None, help="a trained drafter directory (bench_trainer.py --save): adds its rows")
    ap.add_argument("--quick", action="store_true", help="tiny run to check that every path works")
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    args = ap.parse_args(argv)
    max_new = args.max_new_tokens or (16 if args.quick else 56)
    n_prompts = args.prompts or (1 if args.quick else 4)
    cost_reps = args.cost_reps or (6 if args.quick else 20)
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    vocabs = [int(v) for v in args.vocabs.split(",") if v.strip()]
    if not 1 <= n_prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in 1..{len(PROMPTS)}")
    if args.repeats < 1 or max_new < 1 or cost_reps < 1 or args.vocab_k < 1 or any(k < 1 for k in ks):
        ap.error("--repeats, --max-new-tokens, --cost-reps, --vocab-k and --ks must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()

    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except DviError as e:
        ap.error(str(e))
    target_dir = fetch_demo_target()
    tokenizer = load_tokenizer(target_dir, "target")
    target = load_causal_lm(target_dir, "target", dtype, device)
    vocab_size = int(target.config.vocab_size)
    drafters = {"full": load_drafter(ensure_drafter(target_dir, None), vocab_size, dtype, device)}
    for n in vocabs:
        drafters[f"v{n}"] = load_drafter(ensure_drafter(target_dir, n), vocab_size, dtype, device)
    drafters["self"] = Drafter(model=target, version="self")
    if args.trained:
        drafters["trained"] = load_drafter(args.trained, vocab_size, dtype, device)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = chat_prompts(tokenizer, n_prompts)
    variants = build_variants(target, drafters, ks, vocabs, args.vocab_k, eos, pad)
    verify_ks = sorted(set(ADAPTIVE_K_RANGE) | set(ks) | {args.vocab_k})
    step_models = {"target": target} | {name: d.model for name, d in drafters.items() if name != "self"}
    cost_items = [("target", 1)] + [("target", k + 1) for k in verify_ks] + [(name, 1) for name in step_models if name != "target"]

    with torch.inference_mode(), recording_hf_rounds():
        log(f"warm-up: {len(variants)} paths (loaded in {time.perf_counter() - started:.0f} s)")
        for p in variants:
            p.run(prompts[0], min(8, max_new))
        # step costs are timed on a context as long as the middle of a generation
        context = prompts[0] + hf_plain(target, eos, pad)(prompts[0], max(8, max_new // 2)).tokens
        timer = StepTimer(step_models, context)
        timer.measure(cost_items, 2, 0)  # warm-up of the timed shapes
        timer.samples.clear()
        timings = timed_passes(variants, prompts, max_new, args.repeats, timer, cost_items, cost_reps, started)

    t_step = timer.median("target", 1)
    v = {k: timer.median("target", k + 1) / t_step for k in verify_ks}
    c = {name: timer.median(name, 1) / t_step for name in step_models if name != "target"} | {"self": 1.0}
    rows = summarize(variants, timings, c, v)

    cmd = shlex.join([os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable] + sys.argv)
    settings = {
        "max_new_tokens": max_new,
        "repeats": args.repeats,
        "prompts": n_prompts,
        "ks": ks,
        "vocabs": vocabs,
        "vocab_k": args.vocab_k,
        "cost_reps": cost_reps,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "quick": args.quick,
    }
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    hf_token = 1.0 / rows[0]["tokens_per_s"]
    costs = {
        "target_step_s": t_step,
        "context_tokens": len(context),
        "step_s": {name: timer.median(name, 1) for name in step_models if name != "target"},
        "c": c,
        "v_k": v,
        "hf_plain_s_per_token": hf_token,
        "samples": {f"{n}/{k}": len(s) for (n, k), s in timer.samples.items()},
        "min_s": {f"{n}/{k}": min(s) for (n, k), s in timer.samples.items()},
        "engine_cost_tables": {name: e.costs.to_dict() for name, e in ADAPTIVE_ENGINES.items()},  # after the run
    }
    print(table(rows, n_prompts))
    print()
    print(
        f"target step {t_step * 1e3:.1f} ms on a {len(context)}-token context (HF target-only: {hf_token * 1e3:.1f} ms "
        f"a token = {hf_token / t_step:.2f} steps; the ideal counts 1); "
        + ", ".join(f"{n} drafter step {s * 1e3:.1f} ms" for n, s in costs["step_s"].items())
        + f"; {n_prompts} prompts x {max_new} new tokens, {args.repeats} repeat(s), {settings['threads']} threads, "
        f"torch {env['torch']}, transformers {env['transformers']}; total {time.perf_counter() - started:.0f} s"
    )
    disturbed = [f"{r['path']} (prompt {i + 1}, repeat {rep + 1})" for r in rows for rep, i in r["outlier_blocks"]]
    if disturbed:
        print(f"disturbed blocks (speedup off the row's median by more than {OUTLIER}x; medians kept them out): " + "; ".join(disturbed))
    print(f"command: {cmd}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": cmd, "settings": settings, "env": env, "costs": costs, "rows": rows}, indent=2))
        log(f"wrote {args.json}")
    return 0


def table(rows: list[dict], n_prompts: int) -> str:
    def f(x, fmt="{:.2f}"):
        return "–" if x is None else fmt.format(x)

    head = "| path | K | tok/s | speedup | dvi/HF | accept | mean len | c | v_K | ideal | % ideal | greedy ≠ | K off |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    n = n_prompts
    for r in rows:
        k = str(r["k"]) if r["k"] is not None else ("–" if r["family"].endswith("plain") else f"avg {r['mean_k']:.1f}")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["path"],
                    k,
                    f(r["tokens_per_s"], "{:.1f}"),
                    f(r["speedup"]),
                    f(r["dvi_over_hf"]),
                    f(r["acceptance"], "{:.3f}"),
                    f(r["mean_accepted_length"]) if r["family"] not in ("hf-plain", "dvi-plain") else "–",
                    f(r["c"], "{:.3f}"),
                    f(r["v_k"]),
                    f(r["ideal_speedup"]),
                    f(None if r["pct_of_ideal"] is None else 100 * r["pct_of_ideal"], "{:.0f}%"),
                    f"{r['greedy_mismatch_prompts']}/{n}",
                    str(r["k_off_rounds"]) if r["k"] is not None else "–",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
