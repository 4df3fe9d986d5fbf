"""Trainer benchmark: what N minutes of online distillation do to the demo drafter, and how fast the trainer is.

One process, on the demo pair (SmolLM2-135M-Instruct target, the 2-layer drafter built from it), one domain
(Python coding questions):

1. records: the engine decodes the training prompts (greedy, K = 4, top-8 teacher) and the DecisionRecords go
   through the real embedded broker;
2. training: the DeepSpeed trainer (`trainers.recipe.Trainer`, the same one `dvi train` runs) consumes them
   for `--minutes`, replaying records once every fresh one is trained (so the budget is in minutes, not data);
3. before / after, side by side in one run: the estimated acceptance (sum of min(p, q) over held-out records'
   teacher positions; and the greedy match rate) of the untrained and the trained drafter, and the engine's
   measured acceptance and tokens/s on evaluation prompts of the same domain that no record came from
   (greedy, K = 4 and adaptive K), against target-only decoding; medians over prompts.

Trainer throughput: records/s and tokens/s (teacher positions trained on, fresh and replayed) over the run,
and the median step time. No GPU here: the bf16 / model-FLOP-utilisation row needs one (run the same script
there with trainer.precision=bf16).

Run: .venv/bin/python benchmarks/bench_trainer.py [--minutes 5] [--save STORE] [--json PATH]; then
`bench_engine.py --trained STORE/bench0001` puts the trained drafter's rows into the engine table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dvi import store  # noqa: E402
from dvi.config import DviConfig, ModelConfig, SpecConfig, StreamConfig, TrackingConfig, TrainerConfig  # noqa: E402
from dvi.engine import Request, SpeculativeEngine  # noqa: E402
from dvi.models import Drafter, build_drafter, default_cache_dir, demo_drafter_dir, fetch_demo_target, load_causal_lm, load_drafter, load_tokenizer  # noqa: E402
from dvi.procs import free_port  # noqa: E402
from dvi.records import records_from_result  # noqa: E402
from streams.broker import EmbeddedBroker  # noqa: E402
from streams.consumer import DecisionConsumer  # noqa: E402
from streams.producer import DecisionProducer  # noqa: E402
from streams.topics import ensure_topics  # noqa: E402
from trainers.ds import merged_state_dict  # noqa: E402
from trainers.recipe import Trainer, evaluate  # noqa: E402

TASKS = ["reverses a string", "checks whether a number is prime", "returns the largest element of a list",
         "counts the vowels in a string", "computes the factorial of n", "merges two sorted lists",
         "removes duplicates from a list", "returns the n-th Fibonacci number", "checks whether a string is a palindrome",
         "flattens a nested list", "sums the digits of an integer", "sorts a dictionary by its values",
         "finds the second smallest number in a list", "counts the words in a sentence", "converts Celsius to Fahrenheit",
         "computes the greatest common divisor of two integers", "checks whether two strings are anagrams",
         "returns the common elements of two lists", "capitalizes every word of a sentence", "computes the mean of a list",
         "reads a text file and returns its lines", "transposes a matrix given as a list of lists",
         "returns the indices of the two numbers that add up to a target", "checks whether a year is a leap year",
         "converts a binary string to an integer", "finds the longest word in a sentence", "rotates a list by k positions",
         "computes the power set of a list", "counts the occurrences of each character in a string",
         "returns the median of a list of numbers", "removes all whitespace from a string", "chunks a list into pieces of size n"]
STYLES = ["Write a Python function that {}.", "In Python, implement a function that {}. Keep it short."]


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for task in TASKS:
        for style in STYLES:
            enc = tokenizer.apply_chat_template([{"role": "user", "content": style.format(task)}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
            out.append(list(enc["input_ids"]))
    return out


def decode_eval(engine_cls, target, drafter, spec, stop_ids, prompts_, new_tokens):
    """Per prompt: (tokens/s, drafted, accepted) decoding alone (batch 1), greedy."""
    engine = engine_cls(target, drafter, spec, stop_ids=stop_ids, max_batch=1)
    rows = []
    for ids in prompts_:
        t0 = time.perf_counter()
        res = engine.generate([Request(ids, max_new_tokens=new_tokens)])[0]
        dt = time.perf_counter() - t0
        rows.append((len(res.token_ids) / dt, sum(r.k for r in res.rounds), sum(r.accepted for r in res.rounds)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="training time")
    ap.add_argument("--train-prompts", type=int, default=48)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--vocab", type=int, default=0, help="reduced drafter vocabulary (0: full)")
    ap.add_argument("--save", type=Path, default=None, help="publish the trained drafter into this store directory")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    cache = default_cache_dir()
    target_dir = fetch_demo_target(cache)
    drafter_dir = demo_drafter_dir(cache, 2, args.vocab or None)
    if not drafter_dir.exists():
        build_drafter(target_dir, drafter_dir, layers=2, vocab=args.vocab or None)
    tokenizer = load_tokenizer(target_dir)
    target = load_causal_lm(target_dir, "target")
    vocab = int(target.config.vocab_size)
    stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    all_prompts = prompts(tokenizer)
    eval_prompts = all_prompts[-args.eval_prompts:]
    train_prompts = all_prompts[: min(args.train_prompts, len(all_prompts) - args.eval_prompts)]
    spec = SpecConfig(k=4, adaptive=False, topk_logprobs=8)

    t0 = time.perf_counter()
    untrained = load_drafter(drafter_dir, vocab)
    engine = SpeculativeEngine(target, untrained, spec, stop_ids=stop_ids, max_batch=8)
    requests = [Request(ids, max_new_tokens=args.new_tokens) for ids in train_prompts]
    records = []
    with torch.inference_mode():
        for req, res in zip(requests, engine.generate(requests)):
            records += records_from_result(res, replica_id="bench", target_name="smollm2", vocab_size=vocab, sampling=req, topk=8)
    gen_s = time.perf_counter() - t0
    print(f"records: {len(records)} from {len(requests)} prompts, {sum(len(r.generated_ids) for r in records)} tokens in {gen_s:.0f} s")

    with EmbeddedBroker(free_port()) as broker, tempfile.TemporaryDirectory() as tmp:
        scfg = StreamConfig(bootstrap_servers=broker.bootstrap, partitions=2, linger_ms=5)
        ensure_topics(scfg)
        producer = DecisionProducer(scfg)
        for r in records:
            producer.submit(r)
        producer.close(timeout_s=30)
        cfg = DviConfig(model=ModelConfig(target=str(target_dir), drafter=str(drafter_dir)), stream=scfg,
                        trainer=TrainerConfig(run_dir=f"{tmp}/run", store=f"{tmp}/store", batch_tokens=args.batch_tokens,
                                              lr=args.lr, replay_share=0.5, replay_when_idle=True, holdout_share=0.15,
                                              holdout_size=1000, checkpoint_every=10**6, gate_every=10**6, max_version_age=10),
                        tracking=TrackingConfig(enabled=False))
        with DecisionConsumer(scfg, group_id="bench", from_beginning=True) as source:
            trainer = Trainer(cfg, source)
            deadline = time.monotonic() + 30
            while trainer.state.counters.records + trainer.state.counters.duplicates < len(records) and time.monotonic() < deadline:
                trainer.ingest(source.poll(0.5))
            holdout = list(trainer.buffer.holdout)
            ev = lambda model: evaluate(model, holdout, vocab, trainer.vocab_map, trainer.teacher_lm, 1024)  # noqa: E731
            before = ev(trainer.student.module)
            step_times = []
            t_train = time.perf_counter()
            while time.perf_counter() - t_train < args.minutes * 60:
                trainer.ingest(source.poll(0.0))
                s0 = time.perf_counter()
                trainer.step()
                step_times.append(time.perf_counter() - s0)
            train_s = time.perf_counter() - t_train
            after = ev(trainer.student.module)
    c = trainer.state.counters
    if args.save:
        version = store.next_version(args.save, prefix="bench")
        pub = store.publish(args.save, version, merged_state_dict(trainer.student.module.model), drafter_dir,
                            {"parent": untrained.version, "minutes": args.minutes, "steps": trainer.state.step,
                             "held_out_acceptance": after["acceptance"]}, trainer.vocab_map)
        print(f"trained drafter published at {pub.path}")
    trained = Drafter(model=trainer.student.module.model.eval(), version="trained", vocab_map=trainer.vocab_map)

    # decode on prompts no record came from: untrained vs trained, side by side (interleaved per prompt)
    rows = {"target-only": [], "untrained K=4": [], "trained K=4": [], "untrained adaptive": [], "trained adaptive": []}
    adaptive = replace(spec, adaptive=True)
    with torch.inference_mode():
        for ids in eval_prompts:
            rows["target-only"] += decode_eval(SpeculativeEngine, target, None, spec, stop_ids, [ids], args.new_tokens)
            rows["untrained K=4"] += decode_eval(SpeculativeEngine, target, untrained, spec, stop_ids, [ids], args.new_tokens)
            rows["trained K=4"] += decode_eval(SpeculativeEngine, target, trained, spec, stop_ids, [ids], args.new_tokens)
            rows["untrained adaptive"] += decode_eval(SpeculativeEngine, target, untrained, adaptive, stop_ids, [ids], args.new_tokens)
            rows["trained adaptive"] += decode_eval(SpeculativeEngine, target, trained, adaptive, stop_ids, [ids], args.new_tokens)
    base = [r[0] for r in rows["target-only"]]
    table = []
    for name, rs in rows.items():
        drafted, accepted = sum(r[1] for r in rs), sum(r[2] for r in rs)
        table.append({"path": name, "tok_s": statistics.median(r[0] for r in rs),
                      "speedup": statistics.median(r[0] / b for r, b in zip(rs, base)),
                      "acceptance": accepted / drafted if drafted else None})

    print(f"\ntraining: {args.minutes:g} min, {trainer.state.step} steps, median step {statistics.median(step_times):.2f} s; "
          f"{c.trained} records trained fresh, {c.positions} teacher positions (fresh + replayed): "
          f"{c.trained / train_s:.2f} fresh records/s, {c.positions / train_s:.0f} tokens/s")
    print(f"held-out ({len(holdout)} records): expected acceptance {before['acceptance']:.3f} -> {after['acceptance']:.3f}, "
          f"greedy match {before['greedy']:.3f} -> {after['greedy']:.3f}\n")
    print("| path | tok/s | speedup vs target-only | acceptance |")
    print("|---|---|---|---|")
    for r in table:
        acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        print(f"| {r['path']} | {r['tok_s']:.1f} | {r['speedup']:.2f} | {acc} |")
    print(f"\n{len(eval_prompts)} evaluation prompts x {args.new_tokens} new tokens, batch 1, greedy; "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "before": before, "after": after,
                                         "steps": trainer.state.step, "train_s": train_s, "counters": c.to_dict(),
                                         "median_step_s": statistics.median(step_times), "decode": table}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
