"""The gate's estimate against the acceptance vLLM realizes, on the same traffic: is the figure the trainer publishes on
the one serving then sees?

`dvi serve` on the default engine (vLLM's own OpenAI server with dvi's loop as its plugin) serves a trained EAGLE-3
drafter at a fixed K (`serve.spec.adaptive=false`: every step drafts), its records going to a real broker; one client
sends prompts no record the drafter trained on came from (the code domain's eval split, as `benchmarks.workloads`
sends them), greedy and then sampled (`--temperature`). From the records of that traffic:

- live: what vLLM realized, per sampling mode: the share of drafting rounds whose first draft was accepted (the
  figure the gate estimates: the drafter's first draft after the target verified a position) and accepted / drafted;
- gate: what the trainer's gate says of the same drafter on the same records (from the records' features, no target),
  at the positions where a round's first draft was made: the acceptance as vLLM realizes it (`trainer.gate_rule=argmax`:
  vLLM drafts the drafter's argmax; a greedy request accepts it when it is the target's, a sampled one with the
  target's probability of it under the request's sampling), and the figure the gate ranked on before, the expected
  acceptance of a draft sampled from the drafter (sum min(p, q) at temperature 1).

Run alone: .venv/bin/python -m benchmarks.bench_gate --drafter STORE/VERSION [--requests 24] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

import requests
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import workloads  # noqa: E402
from benchmarks.bench_vllm import server_env, write_json  # noqa: E402
from dvi.config import ModelConfig, StreamConfig  # noqa: E402
from dvi.eagle3 import read_target_embedding  # noqa: E402
from dvi.models import encode_chat, load_tokenizer  # noqa: E402
from dvi.pairs import load_any_drafter, pair_dirs  # noqa: E402
from dvi.procs import free_port, http_ok, spawn, wait_ready  # noqa: E402
from streams.broker import EmbeddedBroker  # noqa: E402
from streams.consumer import DecisionConsumer  # noqa: E402
from trainers.data import collate, example_from_record  # noqa: E402
from trainers.losses import teacher_acceptance, teacher_from_topk  # noqa: E402
from trainers.gate import realized_acceptance  # noqa: E402
from trainers.students import Eagle3PositionLM  # noqa: E402


def first_draft_positions(record) -> list[int]:
    """Indices into the record's generated tokens of each drafting round's first draft (round position less prefix)."""
    base = len(record.prefix_ids)
    return [r.position - base for r in record.rounds if r.k > 0 and r.position - base < len(record.generated_ids)]


def live(records) -> dict:
    rounds = [r for rec in records for r in rec.rounds if r.k > 0]
    return {"rounds": len(rounds), "first_draft": sum(r.accepted >= 1 for r in rounds) / max(len(rounds), 1),
            "per_drafted_token": sum(r.accepted for r in rounds) / max(sum(r.k for r in rounds), 1)}


@torch.no_grad()
def gate(records, drafter_dir: Path, target_dir: Path, vocab: int) -> dict:
    """The gate's figures of the drafter at the records' first-draft positions, under both rules."""
    drafter = load_any_drafter(drafter_dir, vocab, torch.float32, "cpu", embed=read_target_embedding(target_dir))
    student = Eagle3PositionLM(drafter.model.eval(), None)
    sums = {"argmax": 0.0, "expected": 0.0, "positions": 0}
    for rec in records:
        e = example_from_record(rec, 1 << 20)
        if e.features is None:
            continue
        at = set(first_draft_positions(rec))
        # the example's targets index its window of the sequence, which starts `shift` tokens in
        first = len(rec.prompt_ids) + len(rec.prefix_ids) - (rec.length - len(e.tokens))
        keep = torch.tensor([int(t) - first in at for t in e.targets])
        if not bool(keep.any()):
            continue
        batch = collate([e])
        logits = student(batch.input_ids, batch.attention_mask, batch.rows, batch.cols, features=batch.features)
        log_q = logits.float().log_softmax(-1)
        teacher = teacher_from_topk(batch.topk_ids, batch.topk_logprobs, vocab, drafter.vocab_map)
        best = drafter.vocab_map[logits.argmax(-1)]
        sums["argmax"] += float(realized_acceptance("argmax", batch, teacher, log_q, best, batch.topk_ids[:, 0])[keep].sum())
        sums["expected"] += float(teacher_acceptance(teacher, log_q)[keep].sum())
        sums["positions"] += int(keep.sum())
    n = max(sums["positions"], 1)
    return {"positions": sums["positions"], "argmax": sums["argmax"] / n, "expected": sums["expected"] / n}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", type=Path, required=True, help="a trained EAGLE-3 drafter (a store version's directory)")
    ap.add_argument("--requests", type=int, default=24, help="requests per sampling mode")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_gate")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    target, _ = pair_dirs(ModelConfig(), with_drafter=False)
    tokenizer = load_tokenizer(target, "target")
    prompts = [p for p in workloads.prompts("code", "eval")][: args.requests]
    args.out.mkdir(parents=True, exist_ok=True)
    broker = EmbeddedBroker(free_port()).start()
    name = f"gate{uuid.uuid4().hex[:8]}"
    stream = StreamConfig(bootstrap_servers=broker.bootstrap, topic=f"{name}.decisions", dlq_topic=f"{name}.dlq",
                          control_topic=f"{name}.control")
    port = free_port()
    cmd = [sys.executable, "-m", "dvi.cli", "serve", f"model.target={target}", f"model.drafter={args.drafter}",
           "tracking.enabled=false", f"stream.bootstrap_servers={broker.bootstrap}", f"stream.topic={stream.topic}",
           f"stream.dlq_topic={stream.dlq_topic}", f"stream.control_topic={stream.control_topic}", "serve.swap.enabled=false",
           "serve.spec.adaptive=false", f"serve.spec.k={args.k}", f"serve.port={port}"]
    child = spawn("dvi serve", cmd, log_path=args.out / "serve.log", env=server_env(), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    modes = {"greedy": 0.0, "sampled": args.temperature}
    ids: dict[str, set[str]] = {m: set() for m in modes}
    try:
        wait_ready(child, lambda: http_ok(url + "/health"), 900, "dvi serve", interval_s=1.0)
        for mode, temperature in modes.items():
            for i, p in enumerate(prompts):
                r = requests.post(url + "/v1/completions", timeout=600, json={
                    "prompt": encode_chat(tokenizer, [{"role": "user", "content": p.text}]) if p.chat
                    else tokenizer(p.text)["input_ids"],
                    "max_tokens": args.max_tokens, "temperature": temperature, "seed": i, "ignore_eos": True})
                r.raise_for_status()
                ids[mode].add(r.json()["id"])
        time.sleep(3.0)  # the last records leave the replica's producer
    finally:
        child.stop(grace_s=30)
    with DecisionConsumer(stream, group_id=None) as consumer:
        got = [d.record for d in consumer.poll_until(10**6, timeout_s=20)]
    broker.stop()
    out = {"drafter": str(args.drafter), "k": args.k, "requests": args.requests, "max_tokens": args.max_tokens,
           "temperature": args.temperature, "modes": {}}
    for mode in modes:
        records = [r for r in got if any(r.request_id.startswith(i) for i in ids[mode])]
        figures = {"records": len(records), "with_features": sum(r.features is not None for r in records),
                   "live": live(records), "gate": gate(records, args.drafter, target, 49152)}
        out["modes"][mode] = figures
        print(f"{mode}: {len(records)} records; live first-draft acceptance {figures['live']['first_draft']:.3f} "
              f"({figures['live']['rounds']} rounds), accepted / drafted {figures['live']['per_drafted_token']:.3f}; gate at "
              f"those positions: as vLLM realizes it {figures['gate']['argmax']:.3f}, expected (sum min(p, q)) "
              f"{figures['gate']['expected']:.3f}",
              flush=True)
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
