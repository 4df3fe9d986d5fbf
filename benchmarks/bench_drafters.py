"""Which drafter kind pays on this machine: the 2-layer drafter against EAGLE-3, from the same records and the same
training time, then served by vLLM against plain vLLM.

One run, side by side:

1. records: the target's own greedy answers (fp32, dvi's engine, `--tokens` tokens each, top-8 teacher) to the
   `bootstrap` prompts of each domain of `--domains` (`benchmarks.workloads`: code and prose by default), and to their
   `eval` prompts, which no training record comes from. The eval records go first in the file and are all held out
   (`trainer.holdout_first`), so the trainer's gate measures every candidate on them;
2. training: each drafter kind starts from what `dvi drafter init` builds (the 2-layer drafter: the target's first
   two layers and its head; EAGLE-3: one decoder layer over the target's low, middle and high features, a draft
   vocabulary of `--vocab` tokens) and `dvi drafter distill --file --minutes` trains it for the same wall time,
   publishing at every gate (`trainer.min_gain=-1`); the held-out expected acceptance (sum of min(p, q) over the eval
   records' teacher positions) of the initial and of the final drafter come from the first and the last gate;
3. cost: c, a drafter step in target decoding steps at batch 1 in the serving dtype, as dvi's engine measures it
   at start-up (`SpeculativeEngine.warm_up`), for each trained drafter;
4. serving: plain vLLM's own OpenAI server at its best settings here (the peer: the dtype `auto` picks, compiled,
   every core for the engine), the same with each trained drafter at K=`--k` (`draft_model` for the layer drafter,
   `eagle3` for EAGLE-3), through `benchmarks.load_client` (streamed, greedy, `ignore_eos`, `--output-len` tokens) on
   the eval prompts at batch 1 and batch 8; vLLM's own spec-decode counters give the live acceptance. Every server
   starts `--rounds` times in a rotating order; ratios to the peer of the same round, medians reported.

    python -m benchmarks.bench_drafters [--minutes 10] [--quick] [--json PATH]

It measures; it asserts nothing. The table and the JSON say the hardware and versions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import workloads
from benchmarks.bench_vllm import PEER, ROOT, Server, log, measure, plain_vllm, server_env, write_json
from dvi import eagle3
from dvi.config import SpecConfig
from dvi.eagle3 import default_layer_ids
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.hardware import pick_dtype
from dvi.models import build_drafter, encode_chat, end_ids, fetch_demo_target, load_causal_lm, load_tokenizer
from dvi.pairs import load_any_drafter
from dvi.procs import free_port
from dvi.records import records_from_result

KINDS = ("layer", "eagle3")


def encoded(tokenizer, prompt: workloads.Prompt) -> list[int]:
    """A workload prompt as the server would get it: through the chat template for a chat one, raw text otherwise."""
    if prompt.chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt.text}])
    return list(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])


def record_answers(path: Path, target: Path, prompts: list[tuple[str, list[int]]], tokens: int) -> int:
    """The target's greedy answers to (domain, prompt ids) as DecisionRecords (JSON lines, in order), carrying the
    target's features of the default EAGLE-3 layers (as a replica serving the EAGLE-3 drafter sends them); the count."""
    model = load_causal_lm(target, "target")
    engine = SpeculativeEngine(model, None, SpecConfig(), stop_ids=end_ids(model, load_tokenizer(target)), max_batch=8,
                               features_layers=default_layer_ids(model.config.num_hidden_layers))
    results = engine.generate([Request(ids, max_new_tokens=tokens, ignore_eos=True) for _, ids in prompts])
    n = 0
    with open(path, "w") as f:
        for (domain, _), r in zip(prompts, results):
            for rec in records_from_result(r, replica_id="bench", target_name=target.name, vocab_size=engine.vocab_size,
                                           sampling=Request(r.prompt_ids), domain=domain, chunk_rounds=64, topk=8):
                f.write(json.dumps(rec.to_dict()) + "\n")
                n += 1
    return n


def initial_drafter(kind: str, target: Path, out: Path, vocab: int) -> Path:
    """What `dvi drafter init` builds for `kind`, in `out` (built once)."""
    if (out / "config.json").exists():
        return out
    if kind == "eagle3":
        return eagle3.build_eagle3(target, out, vocab)
    return build_drafter(target, out, layers=2)


def distill(kind: str, target: Path, drafter: Path, records: Path, held_out: int, minutes: float, out: Path) -> dict:
    """`dvi drafter distill` for `minutes` on `records` (the first `held_out` held out for the gate); its JSON result."""
    cmd = [sys.executable, "-m", "dvi.cli", "drafter", "distill", "--file", str(records), "--minutes", str(minutes), "--json",
           f"model.target={target}", f"model.drafter={drafter}", "tracking.enabled=false", f"trainer.store={out / 'store'}",
           f"trainer.run_dir={out / 'run'}", "trainer.min_gain=-1", "trainer.gate_every=1000000",
           f"trainer.gate_every_s={max(30.0, minutes * 60 / 5):.0f}", f"trainer.holdout_first={held_out}",
           "trainer.holdout_share=0.0001", f"trainer.gate_min_records={held_out}"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"distilling the {kind} drafter failed: {done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if not result["published_versions"]:
        raise SystemExit(f"distilling the {kind} drafter published nothing: {result}")
    return result


def cost_ratio(target: Path, drafter: str, dtype: torch.dtype, reps: int) -> dict:
    """c, a drafter step's cost in target decoding steps at batch 1, as dvi's engine measures it at start-up
    (`SpeculativeEngine.warm_up`: medians of `reps` interleaved runs on a 32-token context) in `dtype`."""
    model = load_causal_lm(target, "target", dtype)
    engine = SpeculativeEngine(model, load_any_drafter(drafter, int(model.config.vocab_size), dtype, target=model), SpecConfig())
    costs = engine.warm_up(reps=reps)
    draft, step = costs["draft_step_s"]["b1"], costs["verify_s"]["b1/k0"]
    return {"c": round(draft / step, 3), "draft_step_ms": round(draft * 1000, 2), "target_step_ms": round(step * 1000, 2),
            "dtype": str(dtype).removeprefix("torch.")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=None, help="training wall time per drafter kind (default 10; --quick 1)")
    ap.add_argument("--domains", default="code,prose", help="workload domains of the records and the eval prompts")
    ap.add_argument("--train-prompts", type=int, default=None, help="bootstrap prompts per domain (default 48; --quick 8)")
    ap.add_argument("--eval-prompts", type=int, default=8, help="eval prompts per domain (no record comes from them)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens of each recorded answer")
    ap.add_argument("--vocab", type=int, default=8192, help="EAGLE-3's draft vocabulary")
    ap.add_argument("--k", type=int, default=3, help="tokens drafted per step when served")
    ap.add_argument("--output-len", type=int, default=None, help="tokens per served request (default 64; --quick 16)")
    ap.add_argument("--rounds", type=int, default=None, help="times every server starts (default 2; --quick 1)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="drafter kinds to train and serve")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_drafters")
    ap.add_argument("--quick", action="store_true", help="a short run that checks every step works")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    minutes = args.minutes or (1.0 if args.quick else 10.0)
    n_train = args.train_prompts or (8 if args.quick else 48)
    output_len = args.output_len or (16 if args.quick else 64)
    rounds = args.rounds or (1 if args.quick else 2)
    per_batch = {1: 2, 8: 8} if args.quick else {1: 8, 8: 24}
    kinds = args.kinds.split(",")
    domains = args.domains.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; the kinds are {', '.join(KINDS)}")

    target = fetch_demo_target()
    tokenizer = load_tokenizer(target, "target")
    evals = [(d, encoded(tokenizer, p)) for d in domains for p in workloads.prompts(d, "eval")[: args.eval_prompts]]
    train = [(d, encoded(tokenizer, p)) for d in domains for p in workloads.prompts(d, "bootstrap")[:n_train]]
    args.out.mkdir(parents=True, exist_ok=True)
    records = args.out / f"records-{'-'.join(domains)}-{n_train}-{args.eval_prompts}-{args.tokens}.jsonl"
    held_out_file = records.with_suffix(".held_out")
    if not records.exists():
        log(f"recording the target's answers to {len(evals)} eval and {len(train)} training prompts ...")
        held_out = record_answers(records.with_suffix(".eval.jsonl"), target, evals, args.tokens)
        record_answers(records.with_suffix(".train.jsonl"), target, train, args.tokens)
        records.write_text(records.with_suffix(".eval.jsonl").read_text() + records.with_suffix(".train.jsonl").read_text())
        held_out_file.write_text(str(held_out))
    held_out = int(held_out_file.read_text())

    trained: dict[str, dict] = {}
    for kind in kinds:
        start = initial_drafter(kind, target, args.out / f"init-{kind}", args.vocab)
        log(f"distilling the {kind} drafter for {minutes:g} minutes ({held_out} held-out records) ...")
        result = distill(kind, target, start, records, held_out, minutes, args.out / f"{kind}-{minutes:g}min-{time.strftime('%H%M%S')}")
        first, last = result["first_gate"], result["last_gate"]
        trained[kind] = {"initial": str(start), "final": result["serving_dir"], "steps": result["step"], "wall_s": result["wall_s"],
                         "published": len(result["published_versions"]), "positions": result["positions"],
                         "held_out_acceptance_initial": first.get("serving_acceptance"),
                         "held_out_acceptance_final": last.get("candidate_acceptance"),
                         "held_out_greedy_initial": first.get("serving_greedy"), "held_out_greedy_final": last.get("candidate_greedy")}
        log(f"{kind}: {result['step']} steps; held-out acceptance {trained[kind]['held_out_acceptance_initial']} -> "
            f"{trained[kind]['held_out_acceptance_final']}")

    dtype = pick_dtype("auto", "cpu").value
    for kind, t in trained.items():
        t["cost"] = cost_ratio(target, t["final"], getattr(torch, dtype), reps=3 if args.quick else 10)
        log(f"{kind}: c = {t['cost']['c']} ({t['cost']['draft_step_ms']} ms a drafter step, {t['cost']['target_step_ms']} ms a "
            f"target step, {dtype}, dvi's engine at batch 1)")
    env = {**server_env(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    plain = plain_vllm(target, dtype)

    def spec(method: str, path: str) -> list[str]:
        return ["--speculative-config", json.dumps({"method": method, "model": path, "num_speculative_tokens": args.k})]

    todo = [Server(PEER, plain, env, str(target), "vllm")]
    if "layer" in trained:
        todo.append(Server(f"vLLM + layer drafter K={args.k}", plain + spec("draft_model", trained["layer"]["final"]), env, str(target), "vllm"))
    if "eagle3" in trained:
        todo.append(Server(f"vLLM + EAGLE-3 K={args.k}", plain + spec("eagle3", trained["eagle3"]["final"]), env, str(target), "vllm"))
    prompts = [ids for _, ids in evals]
    seen: dict[str, list[dict]] = {s.name: [] for s in todo}
    ratios: dict[tuple[str, int], list[float]] = {}
    for rnd in range(rounds):
        this: dict[str, dict] = {}
        for server in todo[rnd % len(todo):] + todo[: rnd % len(todo)]:
            child, url = server.start(free_port(), args.out)
            try:
                this[server.name] = measure(server, url, prompts, output_len, per_batch)
            finally:
                child.stop(grace_s=30)
            log(f"round {rnd + 1}: {server.name}: " + ", ".join(
                f"batch {b}: {this[server.name][b]['tokens_per_s']:.1f} tok/s (acceptance {this[server.name][b]['acceptance']})"
                for b in per_batch))
        for name, m in this.items():
            seen[name].append(m)
            for b in per_batch:
                ratios.setdefault((name, b), []).append(m[b]["tokens_per_s"] / this[PEER][b]["tokens_per_s"])

    rows = []
    for name, ms in seen.items():
        for b in per_batch:
            acc = [m[b]["acceptance"] for m in ms if m[b]["acceptance"] is not None]
            rows.append({"server": name, "batch": b, "tokens_per_s": round(statistics.median(m[b]["tokens_per_s"] for m in ms), 2),
                         "vs_vllm": round(statistics.median(ratios[(name, b)]), 3), "ratios": [round(x, 3) for x in ratios[(name, b)]],
                         "acceptance": round(statistics.median(acc), 3) if acc else None})
    print(f"{'drafter':<8} {'steps':>6} {'held-out acceptance':>22} {'greedy match':>15} {'c':>6}")
    for kind, t in trained.items():
        print(f"{kind:<8} {t['steps']:>6} {t['held_out_acceptance_initial']:>10.3f} -> {t['held_out_acceptance_final']:<9.3f} "
              f"{t['held_out_greedy_initial']:>6.3f} -> {t['held_out_greedy_final']:.3f} {t['cost']['c']:>6.3f}")
    print(f"\n{'server':<28} {'batch':>5} {'tok/s':>8} {'x vLLM':>7} {'acceptance':>11}  x vLLM by round")
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        print(f"{r['server']:<28} {r['batch']:>5} {r['tokens_per_s']:>8.1f} {r['vs_vllm']:>7.3f} {acc:>11}  {r['ratios']}")
    if args.json:
        write_json(args.json, {"trained": trained, "rows": rows, "minutes": minutes, "domains": domains, "train_prompts": n_train,
                               "eval_prompts": args.eval_prompts, "held_out_records": held_out, "tokens": args.tokens,
                               "vocab": args.vocab, "k": args.k, "output_len": output_len, "rounds": rounds,
                               "requests": per_batch, "dtype": dtype})
    return 0


if __name__ == "__main__":
    sys.exit(main())
