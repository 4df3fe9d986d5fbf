"""How good each drafter version a run published is at every depth it drafts to, offline: the question a live check
after a swap answers on a few answers of live traffic, here on the same answers for every version.

The shipped drafter (or `model.drafter`) and every version in `STORE` (`d0001`, ... as a `dvi up` run's store holds
them) are run over the target's greedy answers (dvi's engine, fp32, `--tokens` tokens, the target's features of serving's
aux layers) to two sets of chat prompts from the sources the shipped drafter's corpus held out
(`benchmarks.bench_vllm.held_out_chats`, in `benchmarks.first_publish`'s order): `--seen` prompts from the start of that
order (the first requests of a `first_publish` run, which its trainer trained on) and `--unseen` from `--unseen-from`
on (never sent in a run of that many requests). Per version and set:

- match by step: the share of positions where the drafter's j-th draft (j = 0..K-1, the training-time-test unroll of
  `trainers.students.Eagle3PositionLM`: its own earlier outputs, the tokens before teacher-forced) is the target's
  argmax: what a greedy request accepts at that depth given the drafts before it were;
- accepted per round at K: over every position the target verified, the drafts a round starting there would have had
  accepted (the leading run of matches of steps 0..K-1 at the positions they predict).

    python -m benchmarks.depth_by_version STORE [--k 4] [--tokens 64] [--seen 40] [--unseen 24] [--unseen-from 347]
                                          [--workload DOMAIN] [--checkpoint DIR ...] [--json PATH] [key=value overrides]

EAGLE-3 drafters only. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from benchmarks import workloads
from benchmarks.bench_trainer import chat_ids, make_records
from benchmarks.bench_vllm import held_out_chats
from dvi.config import load_config
from dvi.pairs import load_any_drafter, pair_dirs, resolve_pair
from trainers import checkpoint
from trainers.data import Batch, collate, example_from_record
from trainers.students import Eagle3PositionLM


def matches(student: Eagle3PositionLM, vocab_map: torch.Tensor | None, batch: Batch, k: int) -> torch.Tensor:
    """[k, P]: 1 where draft step j at teacher position p is the target's argmax, 0 where not, -1 where step j does
    not reach p (too near the start of its row)."""
    top1 = batch.topk_ids[:, 0]
    out = torch.full((k, top1.numel()), -1, dtype=torch.long)
    with torch.no_grad():
        steps = student(batch.input_ids, batch.attention_mask, batch.rows, batch.cols, steps=k, features=batch.features)
    for j, (logits, keep) in enumerate(steps):
        best = logits.argmax(-1)
        best = vocab_map[best] if vocab_map is not None else best
        out[j, keep] = (best == top1[keep]).long()
    return out


def accepted_per_round(match: torch.Tensor, rows: list[int], cols: list[int]) -> float:
    """The mean over positions (row, col) of the leading run of steps j = 0.. whose draft at (row, col + j) matched:
    a round starting after the target verified up to col drafts step j for the token at col + j + 1."""
    k = match.shape[0]
    where = {(r, c): i for i, (r, c) in enumerate(zip(rows, cols))}
    total = 0
    for (r, c) in where:
        for j in range(k):
            i = where.get((r, c + j))
            if i is None or match[j, i] != 1:
                break
            total += 1
    return total / max(len(where), 1)


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The drafter's weights in a trainer checkpoint (`trainers.checkpoint`: sealed and complete, read as tensors only),
    named as in the drafter's own state dict."""
    problem = checkpoint.verify(path)
    if problem:
        raise SystemExit(f"{path}: {problem}")
    module = torch.load(path / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)["module"]
    return {k[len("model."):]: v for k, v in module.items() if k.startswith("model.")}


def prompt_sets(args) -> dict[str, list]:
    """The seen and unseen sets: (domain, chat text) from the shipped drafter's held-out sources, or with --workload
    (domain, Prompt) of `benchmarks.workloads`."""
    if args.workload:
        other = workloads.prompts(args.workload, "bootstrap") + workloads.prompts(args.workload, "eval")
        return {"seen": [(args.workload, p) for p in workloads.prompts(args.workload, "live")[:args.seen]],
                "unseen": [(args.workload, p) for p in other[:args.unseen]]}
    chats = held_out_chats()
    return {"seen": chats[:args.seen], "unseen": chats[args.unseen_from:args.unseen_from + args.unseen]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store", type=Path, help="a store of published versions (a dvi up run's <cache>/store)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seen", type=int, default=40)
    p.add_argument("--unseen", type=int, default=24)
    p.add_argument("--unseen-from", type=int, default=347)
    p.add_argument("--workload", default=None, help="a domain of benchmarks.workloads: its live split seen, the others unseen")
    p.add_argument("--checkpoint", type=Path, action="append", default=[], help="a trainer checkpoint to measure too")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = load_config(["model.dtype=float32", *args.overrides])
    pair = resolve_pair(cfg.model)
    _, shipped = pair_dirs(cfg.model)
    sets = prompt_sets(args)
    versions = {"shipped": shipped, **{v.name: v for v in sorted(args.store.glob("d[0-9]*")) if v.is_dir()},
                **{c.name: c for c in args.checkpoint}}
    layers = tuple(pair.drafter.layer_ids)
    vocab = int(pair.target.config.vocab_size)
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "k": args.k,
              "tokens": args.tokens, "store": str(args.store), "workload": args.workload,
              "checkpoints": [str(c) for c in args.checkpoint], "sets": {}}
    for name, prompts in sets.items():
        ids = [chat_ids(pair.tokenizer, p) if isinstance(p, str) else
               chat_ids(pair.tokenizer, p.text) if p.chat else pair.tokenizer(p.text).input_ids for _, p in prompts]
        records, _ = make_records(pair, ids, 1, args.tokens, 4, True, layers, "bf16")
        batch = collate([example_from_record(r, 4096) for r in records])
        rows, cols = batch.rows.tolist(), batch.cols.tolist()
        domains = sorted({d for d, _ in prompts})
        result["sets"][name] = {"prompts": len(prompts), "domains": domains, "positions": len(rows), "versions": {}}
        for version, path in versions.items():
            own = path in args.checkpoint  # a checkpoint: the shipped drafter's files, the checkpoint's weights
            drafter = load_any_drafter(shipped if own else path, vocab, target=pair.target)
            if own:
                drafter.model.load_state_dict(checkpoint_weights(path))
            match = matches(Eagle3PositionLM(drafter.model.eval(), None), drafter.vocab_map, batch, args.k)
            by_step = [round(float((m[m >= 0] == 1).float().mean()), 4) for m in match]
            per_round = round(accepted_per_round(match, rows, cols), 4)
            result["sets"][name]["versions"][version] = {"match_by_step": by_step, f"accepted_per_round_k{args.k}": per_round}
            print(f"{name:7s} ({len(prompts)} prompts, {', '.join(domains)}) {version:8s} match by step {by_step}, "
                  f"accepted per round at K={args.k} {per_round:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
