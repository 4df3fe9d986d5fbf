"""Trainer benchmark: how fast dvi's trainer distills the demo drafter, beside a plain PyTorch loop, and what held-out
acceptance that buys against training time; on the CPU or a GPU (`--device cuda`), for either drafter kind.

One process, on the demo pair (SmolLM2-135M-Instruct target; `--kinds`: the EAGLE-3 drafter and/or the 2-layer
layer drafter, each untrained as `dvi` builds it), one domain (`--domain`: `tasks`, the Python coding questions
below sent as chat, or a `benchmarks.workloads` domain such as `code`, stdlib signatures continued raw):

1. records: dvi's engine decodes the training prompts with the kind's untrained drafter (K = 4, top-8 teacher;
   `--samples` per prompt: the first greedy, the others sampled at temperature 0.8) and the evaluation prompts
   (greedy, prompts no training record came from); for an EAGLE-3 drafter the records carry the target's features
   of the layers it reads, as a serving replica sends them (`--encoding`); the training records go to a JSON-lines
   file (`--records-cache` keeps them for the next run of the same settings);
2. training: the DeepSpeed trainer (`trainers.recipe.Trainer`, the one `dvi train` and `dvi drafter distill` run)
   reads that file and takes optimizer steps for `--minutes`, replaying records once every fresh one is trained;
   every `--eval-every-s` seconds of training the expected acceptance (sum of min(p, q) at the teacher positions)
   and greedy match rate on the evaluation records are measured (outside the training time);
3. plain loop: a fresh copy of the untrained drafter trained by plain PyTorch (fp32 weights, bf16 autocast on a GPU,
   AdamW, fused on a GPU, the same loss) over batches of the same records and size, prebuilt on the device, for
   `--plain-s` seconds: the ceiling the trainer's bookkeeping, DeepSpeed and batch building are measured against;
4. on the CPU only (`--decode`), the engine's measured acceptance and tokens/s with the untrained and the trained
   drafter on the evaluation prompts, against target-only decoding (batch 1, greedy; medians over prompts).

Throughput: teacher positions trained on (fresh and replayed) per second of training, and the median step time; on
a GPU also the share of time a kernel ran (NVML) and the time of one checkpoint. The trainer's precision is
`--precision` (trainer.precision; auto: bf16 on a GPU, bf16-mixed on a CPU with native bf16, else fp32), its features
`--features` (trainer.features: `records`, the records' own, no copy of the target; `recompute`, its copy of the
target computes them for every batch).

Run: .venv/bin/python benchmarks/bench_trainer.py [--device cpu] [--kinds layers] [--minutes 5] [--json PATH];
on a GPU host `python -m benchmarks.gpu` runs it with the engine's checks (benchmarks/README.md, "On a GPU").
`--save STORE` publishes the last kind's trained drafter (`bench_engine.py --trained STORE/bench0001`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import psutil
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import workloads  # noqa: E402
from dvi import store  # noqa: E402
from dvi.config import DviConfig, ModelConfig, SpecConfig, TrackingConfig, TrainerConfig  # noqa: E402
from dvi.engine import SpeculativeEngine  # noqa: E402
from dvi.engine_api import Request  # noqa: E402
from dvi.features import Features  # noqa: E402
from dvi.hardware import resolve_device  # noqa: E402
from dvi.models import Drafter, encode_chat, end_ids  # noqa: E402
from dvi.pairs import load_any_drafter, resolve_pair  # noqa: E402
from dvi.record_codec import decode, encode  # noqa: E402
from dvi.records import records_from_result  # noqa: E402
from trainers.data import Ahead, FileSource  # noqa: E402
from trainers.ds import merged_state_dict  # noqa: E402
from trainers.gate import chunks, evaluate, teacher_for  # noqa: E402
from trainers.recipe import Trainer  # noqa: E402
from trainers.telemetry import gpu_busy_share  # noqa: E402

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
MAX_PROMPT_TOKENS = 192
RECORDS: dict[str, tuple] = {}  # records made in this process, by kind (--records-from drafter) or "target"


def chat_ids(tokenizer, text: str) -> list[int]:
    """One user message through the chat template, as serving encodes it."""
    return encode_chat(tokenizer, [{"role": "user", "content": text}])


def task_prompts(tokenizer) -> list[list[int]]:
    return [chat_ids(tokenizer, style.format(task)) for task in TASKS for style in STYLES]


def domain_prompts(tokenizer, domain: str, n_train: int, n_eval: int) -> tuple[list[list[int]], list[list[int]]]:
    """(training, evaluation) prompt ids: `tasks` split in two, or a workloads domain's live and eval splits."""
    if domain == "tasks":
        every = task_prompts(tokenizer)
        return every[: min(n_train, len(every) - n_eval)], every[-n_eval:]

    def ids(split: str, n: int) -> list[list[int]]:
        out = []
        for p in workloads.prompts(domain, split):
            tokens = chat_ids(tokenizer, p.text) if p.chat else tokenizer(p.text)["input_ids"]
            if 0 < len(tokens) <= MAX_PROMPT_TOKENS:
                out.append(tokens)
            if len(out) == n:
                break
        return out

    return ids("live", n_train), ids("eval", n_eval)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_records(pair, prompts_: list[list[int]], samples: int, new_tokens: int, batch: int, drafted: bool = True,
                 features_layers=None, encoding: str = "bf16") -> tuple[list, float]:
    """Decode every prompt `samples` times (greedy, then sampled at 0.8) with the pair (`drafted`: with its drafter,
    else the target alone: records no drafter drafted for, which train any drafter), the records carrying the target's
    features of `features_layers` in `encoding`; (records, seconds)."""
    vocab = int(pair.target.config.vocab_size)
    engine = SpeculativeEngine(pair.target, pair.drafter if drafted else None, SpecConfig(k=4, adaptive=False, topk_logprobs=8),
                               stop_ids=end_ids(pair.target, pair.tokenizer), max_batch=batch, features_layers=features_layers)
    requests = [Request(ids, max_new_tokens=new_tokens, temperature=0.8 if s else 0.0, seed=s)
                for s in range(samples) for ids in prompts_]
    t0 = time.perf_counter()
    records = []
    with torch.inference_mode():
        for req, res in zip(requests, engine.generate(requests)):
            records += records_from_result(res, replica_id="bench", target_name="smollm2", vocab_size=vocab, sampling=req, topk=8,
                                           features_encoding=encoding)
    return records, time.perf_counter() - t0


def decode_eval(target, drafter, spec, stop_ids, prompts_, new_tokens):
    """Per prompt: (tokens/s, drafted, accepted) decoding alone (batch 1), greedy."""
    engine = SpeculativeEngine(target, drafter, spec, stop_ids=stop_ids, max_batch=1)
    rows = []
    for ids in prompts_:
        t0 = time.perf_counter()
        res = engine.generate([Request(ids, max_new_tokens=new_tokens)])[0]
        dt = time.perf_counter() - t0
        rows.append((len(res.token_ids) / dt, sum(r.k for r in res.rounds), sum(r.accepted for r in res.rounds)))
    return rows


def plain_loop(trainer: Trainer, drafter_dir: Path, seconds: float) -> dict:
    """A plain PyTorch loop (see the module docstring) over the trainer's records in batches of its size; its
    throughput in teacher positions per second."""
    t, device = trainer.tcfg, trainer.device
    cuda = device.type == "cuda"
    drafter = load_any_drafter(drafter_dir, trainer.vocab_size, torch.float32, device,
                               target=trainer.target, embed=trainer.embed)
    model = drafter.model.train()
    module = trainer.kind.student(model, trainer.features_target)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, fused=cuda or None)
    examples = [i.example for i in trainer.buffer.pending] + list(trainer.buffer.replay)
    ahead = Ahead(device, threaded=False)  # built now, on the device (pinned on the way to a GPU), before the clock
    batches = [ahead.build(group, [1.0] * len(group)) for group in chunks(examples, t.batch_tokens)]
    if not batches:
        return {}

    def one(batch) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=trainer.precision != "fp32"):
            teacher = teacher_for(batch, trainer.vocab_size, trainer.vocab_map, trainer.teacher_lm)
            loss, _ = trainer.kind.loss(module, batch, teacher, t, 1.0, 0.0, trainer.vocab_map)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for batch in batches[:3]:  # warm-up: kernels chosen, allocator filled
        one(batch)
    sync(device)
    steps = positions = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        batch = batches[steps % len(batches)]
        one(batch)
        steps, positions = steps + 1, positions + batch.positions
    sync(device)
    dt = time.perf_counter() - t0
    return {"steps": steps, "seconds": dt, "positions_per_s": positions / dt, "step_s": dt / steps, "batches": len(batches)}


def run_kind(kind: str, args, device: torch.device, tmp: Path) -> dict:
    """Records, timed training with held-out evaluations, the plain loop and (CPU) the decode table for one kind."""
    model_cfg = ModelConfig(target=args.target, drafter_kind=kind, drafter_layers=2, drafter_vocab=args.vocab or None,
                            device=args.device, dtype="float32" if device.type == "cpu" else "auto")
    pair = resolve_pair(model_cfg)
    vocab = int(pair.target.config.vocab_size)
    train_prompts, eval_prompts = domain_prompts(pair.tokenizer, args.domain, args.train_prompts, args.eval_prompts)
    drafted = args.records_from == "drafter"
    layers = tuple(pair.drafter.layer_ids) if kind == "eagle3" else None  # what a replica serving it sends
    key = kind if drafted else "target"  # the target's own records serve every kind: made once
    if key not in RECORDS:
        RECORDS[key] = cached_records(args, key, lambda: (
            make_records(pair, train_prompts, args.samples, args.new_tokens, args.gen_batch, drafted, layers, args.encoding),
            make_records(pair, eval_prompts, 1, args.new_tokens, args.gen_batch, drafted, layers, args.encoding)[0]))
    (records, gen_s), eval_records = RECORDS[key]
    tokens = sum(len(r.generated_ids) for r in records)
    print(f"[{kind}] records: {len(records)} from {len(train_prompts)} prompts x {args.samples}, {tokens} tokens in "
          f"{gen_s:.0f} s; {len(eval_records)} evaluation records from {len(eval_prompts)} other prompts", flush=True)
    wire = wire_bytes(records)
    print(f"[{kind}] on the wire: {wire['bytes'] / wire['records'] / 1024:.0f} KiB a record, "
          f"{wire['bytes_per_generated_token']:,.0f} bytes a generated token ({wire['gzip_bytes_per_generated_token']:,.0f} "
          f"gzipped); features {wire['feature_bytes_per_row'] or 0:,.0f} bytes a row", flush=True)
    record_file = tmp / f"records-{kind}.jsonl"
    record_file.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))

    cfg = DviConfig(model=replace(model_cfg, target=str(pair.target_dir), drafter=str(pair.drafter_dir)),
                    trainer=TrainerConfig(run_dir=str(tmp / f"run-{kind}"), store=str(tmp / f"store-{kind}"),
                                          precision=args.precision, features=args.features,
                                          batch_tokens=args.batch_tokens, lr=args.lr, replay_share=0.5, replay_when_idle=True,
                                          holdout_share=0.0, holdout_first=0, pending_size=10**6, replay_size=10**6,
                                          replay_mb=16384.0, checkpoint_every=10**6, gate_every=10**6, gate_every_s=None,
                                          max_version_age=10),
                    tracking=TrackingConfig(enabled=False))
    del pair  # the trainer loads its own copy of the pair
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # the trainer's own: the records' decoding left the target behind
    source = FileSource(str(record_file), vocab)
    trainer = Trainer(cfg, source, offline=True)
    while True:
        delivered = source.poll(0.0, max_records=10**6)
        if not delivered:
            break
        trainer.ingest(delivered)
    eval_examples = [trainer.intake.example(r) for r in eval_records]

    def held_out() -> dict:
        return evaluate(trainer.student.module, eval_examples, vocab, trainer.vocab_map, trainer.teacher_lm, args.batch_tokens,
                        trainer.gate_rule, trainer.precision)

    curve = [{"train_s": 0.0, "steps": 0, "positions": 0, **held_out()}]
    print(f"[{kind}] held-out acceptance before training {curve[0]['acceptance']:.3f}", flush=True)
    step_times, busy = [], []
    train_s, next_eval = 0.0, args.eval_every_s
    trainer.step()  # warm-up step (kernels, allocator), not timed
    sync(device)
    warm = (trainer.state.step, trainer.state.counters.positions)
    while train_s < args.minutes * 60:
        s0 = time.perf_counter()
        trainer.step()
        sync(device)
        dt = time.perf_counter() - s0
        step_times.append(dt)
        train_s += dt
        if train_s >= next_eval or train_s >= args.minutes * 60:
            next_eval += args.eval_every_s
            share = gpu_busy_share(device)
            if share is not None:
                busy.append(share)
            point = {"train_s": train_s, "steps": trainer.state.step - warm[0],
                     "positions": trainer.state.counters.positions - warm[1], **held_out()}
            curve.append(point)
            print(f"[{kind}] {train_s:6.1f} s, {point['steps']} steps, {point['positions'] / train_s:,.0f} positions/s: "
                  f"held-out acceptance {point['acceptance']:.3f}, greedy match {point['greedy']:.3f}, "
                  f"realized ({trainer.gate_rule}) {point['realized']:.3f}", flush=True)
    c = trainer.state.counters
    positions = c.positions - warm[1]
    c0 = time.perf_counter()
    trainer.checkpoint()
    checkpoint_s = time.perf_counter() - c0
    out = {"kind": kind, "device": str(device), "records": len(records), "record_tokens": tokens, "gen_s": gen_s,
           "eval_records": len(eval_records), "train_s": train_s, "steps": trainer.state.step - warm[0],
           "positions": positions, "positions_per_s": positions / train_s, "median_step_s": statistics.median(step_times),
           "gpu_busy_share": statistics.median(busy) if busy else None, "checkpoint_s": checkpoint_s,
           "precision": trainer.precision, "features": args.features if trainer.kind.reads_features else None,
           "encoding": args.encoding if trainer.kind.reads_features else None, "target_loaded": trainer.target is not None,
           "train_prompts": len(train_prompts), "eval_prompts": len(eval_prompts), "wire": wire,
           "rss_mb": psutil.Process().memory_info().rss / (1 << 20),
           "gpu_peak_mb": torch.cuda.max_memory_allocated(device) / (1 << 20) if device.type == "cuda" else None,
           "fresh_records_trained": c.trained, "curve": curve,
           "reached_0_5_at_s": next((p["train_s"] for p in curve if p["acceptance"] >= 0.5), None)}
    if args.plain_s > 0:
        plain = plain_loop(trainer, Path(trainer.initial_dir), args.plain_s)
        out["plain"] = plain
        out["vs_plain"] = out["positions_per_s"] / plain["positions_per_s"] if plain else None
        print(f"[{kind}] dvi's trainer {out['positions_per_s']:,.0f} positions/s, plain PyTorch "
              f"{plain.get('positions_per_s', 0):,.0f}: {out['vs_plain'] or 0:.2f}x", flush=True)
    if args.save:
        version = store.next_version(args.save, prefix="bench")
        pub = store.publish(args.save, version, merged_state_dict(trainer.student.module.model), trainer.initial_dir,
                            {"parent": trainer.state.lineage[0], "minutes": args.minutes, "steps": trainer.state.step,
                             "held_out_acceptance": curve[-1]["acceptance"]}, trainer.vocab_map)
        print(f"trained drafter published at {pub.path}")
    if args.decode:
        out["decode"] = decode_table(trainer, eval_prompts, args.new_tokens, model_cfg)
    trainer.close()
    return out


def cached_records(args, key: str, make):
    """`make()` ((records, seconds), eval records), or what an earlier run with the same settings kept in
    `--records-cache` (the wire form, length-prefixed)."""
    if args.records_cache is None:
        return make()
    settings = {k: str(getattr(args, k)) for k in ("target", "domain", "train_prompts", "eval_prompts", "samples",
                                                  "new_tokens", "records_from", "vocab")}
    name = hashlib.sha256(json.dumps([key, settings], sort_keys=True).encode()).hexdigest()[:16]
    path = Path(args.records_cache) / f"records-{name}.bin"
    if path.is_file():
        blob = path.read_bytes()
        meta_len = int.from_bytes(blob[:4], "little")
        meta = json.loads(blob[4 : 4 + meta_len])
        out, at = [], 4 + meta_len
        while at < len(blob):
            n = int.from_bytes(blob[at : at + 4], "little")
            out.append(decode(blob[at + 4 : at + 4 + n]))
            at += 4 + n
        print(f"records from {path}", flush=True)
        out = [reencoded(r, args.encoding) for r in out]
        return (out[: meta["train"]], meta["gen_s"]), out[meta["train"] :]
    (records, gen_s), eval_records = made = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps({"train": len(records), "gen_s": gen_s}).encode()
    parts = [len(meta).to_bytes(4, "little"), meta]
    for r in records + eval_records:
        data = encode(r, logprob_dtype="float32")
        parts += [len(data).to_bytes(4, "little"), data]
    path.write_bytes(b"".join(parts))
    return made


def wire_bytes(records, batch_bytes: int = 262144) -> dict:
    """What `records` take on the wire (`dvi.record_codec.encode`, float16 log-probs), as written and after Kafka's gzip batch
    compression (batches of `batch_bytes`, stream.batch_bytes): per record, per feature row and per generated token."""
    encoded = [encode(r) for r in records]
    gz, batch = 0, []
    for data in encoded + [b""]:
        if data and sum(map(len, batch)) + len(data) <= batch_bytes:
            batch.append(data)
            continue
        if batch:
            gz += len(gzip.compress(b"".join(batch)))
        batch = [data]
    raw = sum(map(len, encoded))
    rows = sum(r.features.rows for r in records if r.features is not None)
    generated = sum(len(r.generated_ids) for r in records)
    feature_bytes = sum(r.features.nbytes for r in records if r.features is not None)
    return {"records": len(records), "bytes": raw, "gzip_bytes": gz, "median_record_bytes": statistics.median(map(len, encoded)),
            "feature_rows": rows, "feature_bytes": feature_bytes, "feature_bytes_per_row": feature_bytes / rows if rows else None,
            "bytes_per_generated_token": raw / generated, "gzip_bytes_per_generated_token": gz / generated,
            "gzip_ratio": gz / raw}


def reencoded(record, encoding: str):
    """`record` with its features in `encoding` (the cache keeps what the first run made)."""
    f = record.features
    if f is None or f.encoding == encoding:
        return record
    return dataclasses.replace(record, features=Features.encode(f.tensor(), f.layers, f.start, encoding))


def decode_table(trainer: Trainer, eval_prompts, new_tokens: int, model_cfg: ModelConfig) -> list[dict]:
    """The engine on the evaluation prompts: untrained vs trained drafter vs target-only, interleaved per prompt."""
    pair = resolve_pair(model_cfg)
    stop_ids = end_ids(pair.target, pair.tokenizer)
    trained_model = load_any_drafter(trainer.initial_dir, trainer.vocab_size, torch.float32, trainer.device,
                                     target=pair.target).model
    trained_model.load_state_dict(merged_state_dict(trainer.student.module.model))
    trained = Drafter(model=trained_model.eval(), version="trained", vocab_map=trainer.vocab_map)
    spec = SpecConfig(k=4, adaptive=False, topk_logprobs=8)
    adaptive = replace(spec, adaptive=True)
    rows = {"target-only": [], "untrained K=4": [], "trained K=4": [], "untrained adaptive": [], "trained adaptive": []}
    with torch.inference_mode():
        for ids in eval_prompts:
            rows["target-only"] += decode_eval(pair.target, None, spec, stop_ids, [ids], new_tokens)
            rows["untrained K=4"] += decode_eval(pair.target, pair.drafter, spec, stop_ids, [ids], new_tokens)
            rows["trained K=4"] += decode_eval(pair.target, trained, spec, stop_ids, [ids], new_tokens)
            rows["untrained adaptive"] += decode_eval(pair.target, pair.drafter, adaptive, stop_ids, [ids], new_tokens)
            rows["trained adaptive"] += decode_eval(pair.target, trained, adaptive, stop_ids, [ids], new_tokens)
    base = [r[0] for r in rows["target-only"]]
    table = []
    for name, rs in rows.items():
        drafted, accepted = sum(r[1] for r in rs), sum(r[2] for r in rs)
        table.append({"path": name, "tok_s": statistics.median(r[0] for r in rs),
                      "speedup": statistics.median(r[0] / b for r, b in zip(rs, base)),
                      "acceptance": accepted / drafted if drafted else None})
    print("| path | tok/s | speedup vs target-only | acceptance |\n|---|---|---|---|")
    for r in table:
        acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        print(f"| {r['path']} | {r['tok_s']:.1f} | {r['speedup']:.2f} | {acc} |")
    return table


def replace_minutes(args: argparse.Namespace, minutes: float) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "minutes": minutes})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="model.device: cpu, cuda, auto")
    ap.add_argument("--target", default=None, help="model.target (default: the demo target; a .gguf file is imported)")
    ap.add_argument("--kinds", default="layers", help="drafter kinds, comma-separated: layers, eagle3")
    ap.add_argument("--domain", default="tasks", help="tasks, or a benchmarks.workloads domain (code, prose, qa, markdown)")
    ap.add_argument("--minutes", default="5", help="training time per kind: one number, or one per kind (2,1)")
    ap.add_argument("--eval-every-s", type=float, default=60.0, help="held-out evaluation every this much training time")
    ap.add_argument("--plain-s", type=float, default=30.0, help="seconds of the plain PyTorch loop (0: none)")
    ap.add_argument("--train-prompts", type=int, default=48)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=1, help="decodes per training prompt (the first greedy, then sampled)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--records-from", choices=("drafter", "target"), default="drafter",
                    help="decode the records with the kind's untrained drafter, or with the target alone (once for all kinds)")
    ap.add_argument("--gen-batch", type=int, default=8, help="engine batch while making records")
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--precision", default="auto", help="trainer.precision: auto, fp32, bf16-mixed, bf16")
    ap.add_argument("--features", default="records", help="trainer.features (EAGLE-3): records or recompute")
    ap.add_argument("--encoding", default="bf16", help="the records' features: bf16 or int8 (stream.features.encoding)")
    ap.add_argument("--records-cache", type=Path, default=None, help="keep the records made here for later runs")
    ap.add_argument("--vocab", type=int, default=0, help="the demo drafter's reduced vocabulary (0: the kind's default)")
    ap.add_argument("--decode", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine's decode table after training (default: on the CPU only)")
    ap.add_argument("--save", type=Path, default=None, help="publish the trained drafter into this store directory")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    device = resolve_device(args.device)
    args.decode = device.type == "cpu" if args.decode is None else args.decode
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "kinds": []}
    with tempfile.TemporaryDirectory() as tmp:
        kinds = [k.strip() for k in args.kinds.split(",")]
        minutes = [float(m) for m in str(args.minutes).split(",")]
        for kind, m in zip(kinds, minutes * len(kinds) if len(minutes) == 1 else minutes):
            results["kinds"].append(run_kind(kind, replace_minutes(args, m), device, Path(tmp)))
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=2))
    print("\n| kind | device | precision | positions/s | plain PyTorch | vs plain | median step | held-out acceptance | 0.5 at |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in results["kinds"]:
        plain, ratio, at = k.get("plain", {}).get("positions_per_s"), k.get("vs_plain"), k["reached_0_5_at_s"]
        cells = [k["kind"], k["device"], k["precision"], f"{k['positions_per_s']:,.0f}", "–" if plain is None else f"{plain:,.0f}",
                 "–" if ratio is None else f"{ratio:.2f}x", f"{k['median_step_s'] * 1000:.0f} ms",
                 f"{k['curve'][0]['acceptance']:.3f} -> {k['curve'][-1]['acceptance']:.3f}", "–" if at is None else f"{at:.0f} s"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
