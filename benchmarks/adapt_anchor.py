"""What adapting the shipped bootstrap drafter to one domain costs on the bootstrap's held-out slice, with the gate's
guard (`trainer.anchor_max_drop`, default 0.03) and without it (1.0: any drop allowed).

One workload domain's live prompts (`benchmarks.workloads`: the drift benchmark's phase of that domain), answered by
the target and distilled into the shipped drafter by `dvi drafter bootstrap --corpus` (the trainer as it runs online:
the gate, the store, the slice beside the held-out share of the new records), once per setting, from the same answers.
Reported per published version: acceptance on the new domain's held-out records (the gate's) and on the slice, in
all and per domain, against the shipped drafter's; and the new domain's held-out acceptance before and after.

    python -m benchmarks.adapt_anchor --domain qa --prompts 96 --minutes 5 --out benchmarks/results/adapt_anchor-cpu.json

`--lrs` compares learning rates instead (each with the guard): what fine-tuning the shipped drafter, trained at 8,192
positions a step, takes at the trainer's 512 a step.

    python -m benchmarks.adapt_anchor --domain math --minutes 4 --lrs 3e-4,1e-4,3e-5 --out benchmarks/results/adapt_lr-math-cpu.json

Run it alone: it trains on every core. This module knows the bootstrap command's work directory and report; the
training and the guard are the trainer's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks import emit, workloads
from dvi import corpus
from dvi.config import load_config
from dvi.errors import DviError
from dvi.models import read_drafter_meta
from trainers import bootstrap

SETTINGS = {"guarded": 0.03, "unguarded": 1.0}  # trainer.anchor_max_drop


def corpus_file(domain: str, n: int, heldout: int, path: Path) -> None:
    """`n` live prompts of `domain`, the last `heldout` of them held out (the gate's share and the report's figures).
    A corpus names the bootstrap's domains only: one it lacks (math) is filed as qa, its source saying which it is."""
    chosen = workloads.prompts(domain, "live")[:n]
    filed = domain if domain in corpus.DOMAINS else "qa"
    prompts = [corpus.CorpusPrompt(corpus.prompt_id(filed, p.chat, p.text), filed, f"live:{domain}",
                                   "heldout" if i >= n - heldout else "train", p.chat, p.text) for i, p in enumerate(chosen)]
    path.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_corpus(prompts, path)


def versions(store_dir: Path) -> list[dict]:
    """Every version the run published, oldest first: its step and its gate's figures."""
    out = []
    for d in sorted(p for p in store_dir.iterdir() if (p / "dvi_drafter.json").is_file()):
        meta = read_drafter_meta(d)
        out.append({"version": d.name, "step": meta.get("step"), **meta.get("gate", {})})
    return out


def settings(lrs: str | None) -> dict[str, list[str]]:
    """The settings compared, each as its config overrides: the guard on and off, or (`lrs`) one per learning rate."""
    if not lrs:
        return {name: [f"trainer.anchor_max_drop={drop}"] for name, drop in SETTINGS.items()}
    return {f"lr-{lr}": [f"trainer.anchor_max_drop={SETTINGS['guarded']}", f"trainer.lr={lr}"]
            for lr in (x.strip() for x in lrs.split(",")) if lr}


def run(setting: str, overrides: list[str], args, work: Path, answered: Path | None) -> dict:
    if answered is not None and not work.exists():  # the answers of the first setting: the same records
        work.mkdir(parents=True)
        for name in ("corpus.jsonl", "corpus-manifest.json", "records-train.jsonl", "records-heldout.jsonl", "answers.progress"):
            shutil.copy2(answered / name, work / name)
        report = json.loads((answered / bootstrap.REPORT).read_text())
        (work / bootstrap.REPORT).write_text(json.dumps({k: report[k] for k in ("answers", "before", "seconds") if k in report}))
    cfg = load_config(["tracking.enabled=false", *overrides, *args.override])
    plan = bootstrap.Plan(work=work, out=work / "out" / f"adapted-{setting}", corpus_file=work.parent / "corpus.jsonl",
                          samples=1, new_tokens=args.new_tokens, batch=args.batch, minutes=args.minutes)
    t0 = time.perf_counter()
    try:
        report = bootstrap.run(cfg, plan, command=f"benchmarks.adapt_anchor {setting}")
        error = None
    except DviError as e:  # the gate published nothing
        report, error = json.loads((work / bootstrap.REPORT).read_text()), str(e)
    return {"anchor_max_drop": cfg.trainer.anchor_max_drop, "lr": cfg.trainer.lr,
            "seconds": round(time.perf_counter() - t0, 1), "error": error,
            "before": report.get("before"), "after": report.get("after"), "trainer": report.get("trainer"),
            "published": versions(work / "store") if (work / "store").is_dir() else []}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--domain", default="qa", choices=workloads.ALL_DOMAINS)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128, dest="new_tokens")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=5.0, help="training time per setting")
    ap.add_argument("--work", default="/tmp/dvi-adapt-anchor")
    ap.add_argument("--lrs", help="learning rates to compare, comma-separated (each with the guard), not the guard")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("override", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    corpus_file(args.domain, args.prompts, args.heldout, work / "corpus.jsonl")
    results, first = {}, None
    for setting, overrides in settings(args.lrs).items():
        results[setting] = run(setting, overrides, args, work / setting, first)
        first = first or work / setting
        print(json.dumps({setting: results[setting]["published"]}), file=sys.stderr, flush=True)
    out = {"what": "adapting the shipped bootstrap drafter to one domain: acceptance on the bootstrap's held-out "
                   "slice per published version, " + (f"at learning rates {args.lrs}" if args.lrs
                                                      else "with the gate's guard and without"),
           "domain": args.domain, "prompts": args.prompts, "heldout": args.heldout, "minutes": args.minutes,
           "hardware": bootstrap.hardware(), "commit": bootstrap.commit(), "results": results}
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
