"""`dvi serve` as a user starts it against plain vLLM's own OpenAI server at its best settings, through one client.

Every server is a real process answering HTTP, measured with `benchmarks.load_client` (streamed completions, greedy,
`ignore_eos`, a fixed output length) on the same chat prompts (the `qa` domain of `benchmarks.workloads`, or with
`--held-out` code and prose prompts from the sources the bootstrap drafter's corpus held out, through the target's
chat template), at batch 1 (one client) and batch 8 (eight at once). One server runs at a time (two torch
processes on a small machine slow each other several-fold), in a rotating order, `--rounds` times; each round's
throughputs are divided by the peer's of the same round and the medians of those ratios are reported.

The servers:

- `vLLM` (the peer): `vllm serve` (`dvi.cli.vllm.server.SERVER`, vLLM's own CLI on either build), target only, at its best settings on this machine:
  compiled, the dtype `model.dtype: auto` picks (bf16 only where the CPU has native bf16), every core for the engine
  (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`: the CPU build's default keeps one back for the API server, 0.7x here);
- `vLLM, bfloat16` (or float32, where auto picks bf16): the other dtype. On a CPU without native bf16, bf16 is
  emulated: it halves the bytes a step reads, which wins at batch 1, and costs compute, which loses at batch 8; the
  table's `x best` column divides by the faster of the two at each batch size;
- `vLLM, no prefix caching`: the peer without vLLM's prefix cache (`--no-enable-prefix-caching`, as `dvi serve` runs
  vLLM: a hot swap would leave the previous drafter's keys and values in it);
- `vLLM + drafter K=k`, `vLLM + trained K=k`: the same with the demo drafter (the pair's default, then trained) drafting a
  fixed K, as a vLLM user deploys a `draft_model` speculator;
- `dvi serve`: `dvi serve` on its defaults (engine auto = vLLM's own OpenAI server with dvi's loop as its plugin,
  compiled, the dtype auto picks, K planned per step: drafting only where it pays) with the demo drafter (the shipped
  bootstrap drafter, `dvi.drafters`), its
  DecisionRecords going to a real broker (the embedded one) and its swap thread following the control topic; MLflow
  tracking off;
- `dvi serve --no-draft`: the same, target only;
- `dvi serve, no features`, `dvi serve, trained, no features`, `dvi serve, untrained, no features`: the defaults without
  the target's features in the records (`stream.features.share=0`): what sending them costs serving;
- `dvi serve K=k`: fixed K (`serve.spec.adaptive=false`): against `vLLM + drafter K=k`, what dvi's loop costs;
- `dvi serve, trained`: the defaults with the trained drafter;
- `dvi serve, untrained`: the defaults with the demo pair's untrained drafter (`model.drafter=init`), a drafter that does
  not pay: what the planner's probing costs from a fresh start;
- `dvi serve, bfloat16` (or float32): the defaults in the other dtype.

The trained drafter is the demo drafter distilled offline (`dvi drafter distill --steps`) on records of the target's
own answers to the benchmark's prompts (its prompts: the acceptance it reaches there is what a loop trained on a
steady workload reaches), built once into the output folder (`--trained DIR` reuses one).

Run (from the checkout root): .venv/bin/python -m benchmarks.bench_vllm [--quick] [--json PATH]; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from functools import partial
from pathlib import Path

import requests

from benchmarks import load_client, workloads
from dvi import corpus, drafters
from dvi.cli.vllm.server import SERVER
from dvi.eagle3 import eagle3_config
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.hardware import pick_dtype, vllm_version
from dvi.models import EAGLE3, drafter_kind, encode_chat, end_ids, load_causal_lm, load_tokenizer, read_drafter_meta
from dvi.pairs import pair_dirs
from dvi.cli.status import replica as replica_view
from dvi.config import ModelConfig, SpecConfig, VllmConfig
from dvi.procs import Child, free_port, http_ok, spawn, wait_ready
from dvi.records import records_from_result
from dvi.cli.vllm.engine import vllm_env
from streams.broker import EmbeddedBroker

ROOT = Path(__file__).resolve().parent.parent
PEER = "vLLM"
NO_PREFIX = "vLLM, no prefix caching"
PLAIN = {PEER, "vLLM, bfloat16", "vLLM, float32", NO_PREFIX}  # plain vLLM, target only, at the settings measured in a run


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chat_prompts(tokenizer, n: int, held_out: bool = False) -> list[list[int]]:
    """The first `n` qa prompts of the live split, or with `held_out` chat prompts of code and prose (alternately) from
    the sources the shipped bootstrap drafter's corpus held out (`dvi.corpus`: no training record came from them),
    through the chat template, as token ids."""
    if not held_out:
        texts = [p.text for p in workloads.prompts("qa", "live")[:n]]
    else:
        texts = [text for _, text in held_out_chats(("code", "prose"))][:n]
    return [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def held_out_chats(domains: tuple[str, ...] = ("code", "prose", "markdown", "qa")) -> list[tuple[str, str]]:
    """(domain, text) of the chat prompts of `domains` from the sources the shipped bootstrap drafter's corpus held out
    (`dvi.corpus`: no training record came from them), the domains in turn while each has prompts left: none repeated."""
    sources = set(read_drafter_meta(drafters.SHIPPED)["bootstrap"]["corpus"]["heldout_sources"])  # as it was trained
    held = [p for p in corpus.bootstrap_prompts() if p.source in sources and p.chat]
    by_domain = [[p.text for p in held if p.domain == d] for d in domains]
    return [(d, texts[i]) for i in range(max(map(len, by_domain))) for d, texts in zip(domains, by_domain) if i < len(texts)]


def train_drafter(out: Path, target: Path, drafter: Path, prompts: list[list[int]], tokens: int, steps: int) -> Path:
    """The demo drafter distilled offline on records of the target's greedy answers to `prompts`: the last version the
    trainer published. The first record is held out for the trainer's gate (which publishes every candidate here,
    min_gain -1), the rest are trained on. Distilled once into `out`: a later run serves the same one (`trained.txt`)."""
    out.mkdir(parents=True, exist_ok=True)
    kept = out / "trained.txt"
    before = Path(kept.read_text().strip()) if kept.exists() else None
    if before is not None and before.is_dir():
        log(f"the drafter distilled before: {before}")
        return before
    records = out / "records.jsonl"
    if not records.exists():
        log(f"recording the target's answers to {len(prompts)} prompts ...")
        model = load_causal_lm(target, "target")
        layers = eagle3_config(json.loads((drafter / "config.json").read_text()))[1]["layer_ids"] if drafter_kind(drafter) == EAGLE3 else None
        engine = SpeculativeEngine(model, None, SpecConfig(), stop_ids=end_ids(model, load_tokenizer(target)), max_batch=8,
                                   features_layers=layers)  # an EAGLE-3 drafter's features, as its replica sends them
        results = engine.generate([Request(p, max_new_tokens=tokens, ignore_eos=True) for p in prompts])
        with open(records, "w") as f:
            for r in results:
                for rec in records_from_result(r, replica_id="bench", target_name=target.name, vocab_size=engine.vocab_size,
                                               sampling=Request(r.prompt_ids), domain="qa", chunk_rounds=64, topk=8):
                    f.write(json.dumps(rec.to_dict()) + "\n")
    log(f"distilling the drafter for {steps} steps (minutes) ...")
    for part in ("store", "run"):  # a distillation cut short before: its versions would leave this one nothing to publish
        shutil.rmtree(out / part, ignore_errors=True)
    cmd = [sys.executable, "-m", "dvi.cli", "drafter", "distill", "--file", str(records), "--steps", str(steps), "--json",
           f"model.target={target}", f"model.drafter={drafter}", "tracking.enabled=false", f"trainer.store={out / 'store'}",
           f"trainer.run_dir={out / 'run'}", "trainer.min_gain=-1", "trainer.gate_every=20", "trainer.gate_every_s=null",
           "trainer.holdout_first=1", "trainer.holdout_share=0.001", "trainer.gate_min_records=1"]  # one record held out for the gate
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"distill failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["published_versions"]:
        raise SystemExit(f"distill published nothing: {result}")
    kept.write_text(result["serving_dir"] + "\n")
    return Path(result["serving_dir"])


class Server:
    """One server process under test: its command, environment and how to read its acceptance."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], model: str | None, kind: str):
        self.name, self.cmd, self.env, self.model, self.kind = name, cmd, env, model, kind

    def start(self, port: int, log_dir: Path) -> tuple[Child, str]:
        url = f"http://127.0.0.1:{port}"
        child = spawn(self.name, [*self.cmd, *(["--port", str(port)] if self.kind == "vllm" else [f"serve.port={port}"])],
                      log_path=log_dir / f"{self.name.replace(' ', '_').replace('/', '_')}.log", env=self.env, cwd=ROOT)
        wait_ready(child, lambda: http_ok(url + "/health"), 900, self.name, interval_s=1.0)
        return child, url

    def acceptance(self, url: str) -> dict:
        """Accepted / drafted since the server started, and for dvi its routing decisions and schedule."""
        if self.kind == "dvi":
            h = replica_view(url, timeout_s=10)  # dvi serve's /health, or the loop's /dvi/health on vLLM's own server
            drafted = sum(v["drafted"] for v in h["by_version"].values())
            accepted = sum(v["accepted"] for v in h["by_version"].values())
            return {"drafted": drafted, "accepted": accepted, "routing": h.get("routing"), "schedule": h.get("schedule"),
                    "records": h.get("records"), "features": h.get("features")}
        text = requests.get(url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            for key in ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
                if line.startswith(key):
                    values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return {"drafted": int(values.get("vllm:spec_decode_num_draft_tokens_total", 0)),
                "accepted": int(values.get("vllm:spec_decode_num_accepted_tokens_total", 0))}


def server_env() -> dict[str, str]:
    """Every server's environment: vLLM's settings as `dvi serve` gives them (`dvi.cli.vllm.engine.vllm_env`: a 2 GiB
    KV cache, no usage reports, and the compile caches `dvi serve` uses, so that a compiled start of any server reuses
    what an earlier one compiled), but for the core reserved for vLLM's API server, the CPU build's default."""
    env = {**os.environ, **vllm_env(VllmConfig(cpu_kv_cache_gb=2))}
    env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU")
    return env


def plain_vllm(target: Path, dtype: str, *extra: str) -> list[str]:
    """vLLM's own OpenAI server on the target, as a vLLM user starts it."""
    return [*SERVER, str(target), "--dtype", dtype,
            "--max-model-len", "2048", "--max-num-seqs", "8", "--disable-uvicorn-access-log", *extra]


def servers(target: Path, drafter: Path, trained: Path, dtype: str, k: int, broker: str, name: str, store: Path,
            only: set[str] | None) -> list[Server]:
    base = server_env()
    all_cores = {**base, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    plain = plain_vllm(target, dtype)

    def spec(path: Path) -> list[str]:
        return ["--speculative-config", json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": k})]

    dvi = [sys.executable, "-m", "dvi.cli", "serve", f"model.target={target}", "tracking.enabled=false",
           f"stream.bootstrap_servers={broker}", f"stream.topic={name}.decisions", f"stream.dlq_topic={name}.dlq",
           f"stream.control_topic={name}.control", f"serve.swap.store={store}", "serve.swap.initial=none", "serve.vllm.cpu_kv_cache_gb=2"]
    other = "bfloat16" if dtype == "float32" else "float32"
    plain_other = plain_vllm(target, other)
    out = [
        Server(PEER, plain, all_cores, str(target), "vllm"),
        Server(f"vLLM, {other}", plain_other, all_cores, str(target), "vllm"),
        Server(NO_PREFIX, plain + ["--no-enable-prefix-caching"], all_cores, str(target), "vllm"),
        Server(f"vLLM + drafter K={k}", plain + spec(drafter), all_cores, str(target), "vllm"),
        Server(f"vLLM + trained K={k}", plain + spec(trained), all_cores, str(target), "vllm"),
        # dvi serve as a user starts it: on vLLM's own server with dvi's loop as its plugin (serve.engine auto)
        Server("dvi serve", dvi + [f"model.drafter={drafter}"], base, None, "dvi"),
        Server("dvi serve --no-draft", dvi[:4] + ["--no-draft"] + dvi[4:], base, None, "dvi"),
        # what sending the target's features with every record costs serving (an EAGLE-3 drafter's; the defaults send them)
        Server("dvi serve, no features", dvi + [f"model.drafter={drafter}", "stream.features.share=0"], base, None, "dvi"),
        Server("dvi serve, trained, no features", dvi + [f"model.drafter={trained}", "stream.features.share=0"], base, None, "dvi"),
        Server(f"dvi serve K={k}", dvi + [f"model.drafter={drafter}", "serve.spec.adaptive=false", f"serve.spec.k={k}"], base, None, "dvi"),
        Server("dvi serve, trained", dvi + [f"model.drafter={trained}"], base, None, "dvi"),
        # a drafter that does not pay: the demo pair's untrained one, where the planner must keep serving at plain speed
        Server("dvi serve, untrained", dvi + ["model.drafter=init"], base, None, "dvi"),
        # ... and what of its cost with drafting off is the features its records carry
        Server("dvi serve, untrained, no features", dvi + ["model.drafter=init", "stream.features.share=0"], base, None, "dvi"),
        Server(f"dvi serve, {other}", dvi + [f"model.drafter={drafter}", f"model.dtype={other}"], base, None, "dvi"),
    ]
    return [s for s in out if only is None or s.name in only]


def peer_settings(target: Path, dtype: str) -> list[Server]:
    """Plain vLLM (target only) at the settings a user could pick on a CPU, the peer's first: how the peer was chosen."""
    base = server_env()
    plain = partial(plain_vllm, target)
    other = "bfloat16" if dtype == "float32" else "float32"
    all_cores = {**base, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return [Server(PEER, plain(dtype), all_cores, str(target), "vllm"),
            Server(f"vLLM, {dtype}, a core reserved (the CPU build's default)", plain(dtype), base, str(target), "vllm"),
            Server(f"vLLM, {dtype}, eager", plain(dtype, "--enforce-eager"), all_cores, str(target), "vllm"),
            Server(f"vLLM, {other}", plain(other), all_cores, str(target), "vllm")]


def measure(server: Server, url: str, prompts: list[list[int]], output_len: int, per_batch: dict[int, int]) -> dict:
    load_client.run(url, requests_n=2, concurrency=1, input_len=0, output_len=8, model=server.model, prompt_ids=prompts)  # warm-up
    out = {}
    for batch, n in per_batch.items():
        before = server.acceptance(url)
        r = load_client.run(url, requests_n=n, concurrency=batch, input_len=0, output_len=output_len, model=server.model,
                            prompt_ids=prompts)
        after = server.acceptance(url)
        if r["problems"]:
            raise SystemExit(f"{server.name} at batch {batch}: {r['problems'][:3]}")
        drafted = after["drafted"] - before["drafted"]
        out[batch] = {"tokens_per_s": r["output_token_throughput"], "e2e_median_s": r["e2e_s"]["median"],
                      "acceptance": round((after["accepted"] - before["accepted"]) / drafted, 4) if drafted else None,
                      "drafted": drafted, **{k: after[k] for k in ("routing", "schedule", "records", "features") if k in after}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=None, help="times every server is started and measured (default 2; --quick 1)")
    ap.add_argument("--prompts", type=int, default=16, help="chat prompts (the qa domain's live split)")
    ap.add_argument("--output-len", type=int, default=None, help="tokens per request (default 64; --quick 16)")
    ap.add_argument("--held-out", action="store_true", dest="held_out", help="chat prompts of code and prose from the "
                    "sources the bootstrap drafter's corpus held out, instead of the qa domain's")
    ap.add_argument("--k", type=int, default=4, help="K of the fixed-K servers")
    ap.add_argument("--trained", type=Path, help="a trained drafter to use (default: distil one into --out once)")
    ap.add_argument("--train-steps", type=int, default=200, help="distillation steps of the trained drafter")
    ap.add_argument("--only", help="server names to run, separated by a comma with no space after it (the peer is always run)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_vllm", help="logs and the trained drafter")
    ap.add_argument("--quick", action="store_true", help="a short run that checks every server works")
    ap.add_argument("--sweep-peer", action="store_true", help="measure plain vLLM at the settings a user could pick instead "
                    "(how the peer's settings were chosen)")
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 2)
    output_len = args.output_len or (16 if args.quick else 64)
    per_batch = {1: 2, 8: 8} if args.quick else {1: 8, 8: 24}

    target, drafter = pair_dirs(ModelConfig())
    tokenizer = load_tokenizer(target, "target")
    prompts = chat_prompts(tokenizer, args.prompts, args.held_out)
    dtype = pick_dtype("auto", "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    trained = args.trained or args.sweep_peer or train_drafter(args.out / f"trained-{args.prompts}p-{output_len}t-{args.train_steps}s", target, drafter,
                                            prompts, output_len, args.train_steps)
    broker = EmbeddedBroker(free_port()).start()
    name = f"bench{uuid.uuid4().hex[:8]}"
    only = None if not args.only else {PEER, *re.split(r",(?! )", args.only)}  # names hold ", "; a bare "," separates
    if args.sweep_peer:
        todo = peer_settings(target, dtype.value)
    else:
        todo = servers(target, drafter, trained, dtype.value, args.k, broker.bootstrap, name, args.out / "store", only)
    log(f"{len(todo)} servers x {rounds} rounds; dtype {dtype}; logs in {args.out}")
    seen: dict[str, list[dict]] = {s.name: [] for s in todo}
    ratios: dict[tuple[str, int], list[float]] = {}
    best_ratios: dict[tuple[str, int], list[float]] = {}
    try:
        for rnd in range(rounds):
            order = todo[rnd % len(todo):] + todo[: rnd % len(todo)]
            this: dict[str, dict] = {}
            for server in order:
                t0 = time.perf_counter()
                child, url = server.start(free_port(), args.out)
                started = time.perf_counter() - t0
                try:
                    this[server.name] = {"start_s": round(started, 1), **measure(server, url, prompts, output_len, per_batch)}
                finally:
                    child.stop(grace_s=30)
                m = this[server.name]
                log(f"round {rnd + 1}: {server.name}: started in {started:.0f} s; " + ", ".join(
                    f"batch {b}: {m[b]['tokens_per_s']:.1f} tok/s (acceptance {m[b]['acceptance']})" for b in per_batch))
            for s, m in this.items():
                seen[s].append(m)
                for b in per_batch:
                    ratios.setdefault((s, b), []).append(m[b]["tokens_per_s"] / this[PEER][b]["tokens_per_s"])
                    # against plain vLLM at whichever of its settings measured here was fastest at this batch size
                    best = max(v[b]["tokens_per_s"] for name, v in this.items() if name in PLAIN)
                    best_ratios.setdefault((s, b), []).append(m[b]["tokens_per_s"] / best)
    finally:
        broker.stop()

    rows = []
    for s in seen:
        for b in per_batch:
            ms = [m[b] for m in seen[s]]
            acc = [m["acceptance"] for m in ms if m["acceptance"] is not None]
            rows.append({"server": s, "batch": b, "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in ms), 2),
                         "vs_vllm": round(statistics.median(ratios[(s, b)]), 3), "ratios": [round(x, 3) for x in ratios[(s, b)]],
                         "vs_best_vllm": round(statistics.median(best_ratios[(s, b)]), 3),
                         "acceptance": round(statistics.median(acc), 3) if acc else None,
                         "start_s": [m["start_s"] for m in seen[s]],
                         "last": {k: ms[-1][k] for k in ("routing", "schedule", "records", "features") if k in ms[-1]}})
    print(f"{'server':<26} {'batch':>5} {'tok/s':>8} {'x vLLM':>7} {'x best':>7} {'acceptance':>11}  x vLLM by round")
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        print(f"{r['server']:<26} {r['batch']:>5} {r['tokens_per_s']:>8.1f} {r['vs_vllm']:>7.3f} {r['vs_best_vllm']:>7.3f} {acc:>11}  {r['ratios']}")
    if args.json:
        write_json(args.json, {"rows": rows, "rounds": rounds, "output_len": output_len, "requests": per_batch, "prompts": args.prompts,
                               "k": args.k, "dtype": str(dtype), "trained": str(trained)})
    return 0


def write_json(path: Path, result: dict) -> None:
    """`result` with the machine it was measured on (CPU, versions) as JSON at `path`."""
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "?")
    machine = {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__,
               "transformers": transformers.__version__, "vllm": vllm_version()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "machine": machine}, indent=2) + "\n")
    log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
