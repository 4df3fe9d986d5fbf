"""`dvi drafter bootstrap`: a general drafter for a target, made offline from packaged text by dvi's own trainer.

Five stages in a work directory, each resumable after a kill (a stage that finished is not run again):

1. corpus: `dvi.corpus.bootstrap_prompts` (or a corpus file given), written as `corpus.jsonl` with its manifest;
2. answers: the target answers every prompt (training prompts `samples` times: the first greedy, the others sampled
   at temperature 0.8, as EAGLE-3 drafters are trained on their target's own output; held-out prompts once, greedy),
   in batches (by vLLM's engine where it is installed: `dvi drafter bootstrap --engine`; else the target's own
   `generate`); each answer becomes DecisionRecords of target-only rounds carrying the target's top-k log-probs at every
   position, as serving logs them (`records-train.jsonl`, `records-heldout.jsonl`). A batch's records are appended
   and then the batch is noted in `answers.progress` with the files' sizes: a restart truncates the files to the last
   noted sizes and goes on with the next batch. A progress bar says how many answers are left and how long they take;
3. training: the trainer (`trainers.recipe.Trainer`, as `dvi drafter distill` runs it: the gate on its own held-out
   share of the records, the store, checkpoints in `run/` that a restart resumes from) over the training records, for
   `minutes` (from each start) or `steps` (in all); records carry no features, so an EAGLE-3 drafter's come from the
   trainer's copy of the target (`trainer.features=recompute`);
4. evaluation: expected, greedy and realized acceptance on the held-out records, per domain, for the drafter the run
   started from and for the one it published last;
5. export: that version in bf16 (`dvi.eagle3.save_bf16`) at `out`, with `bootstrap.json` (the corpus manifest, the
   figures per domain, times, hardware, the command), and beside it the held-out slice the trainer's gate keeps when
   the loop adapts the drafter (`trainers.anchor`: `<out>.heldout.jsonl.gz`).

`answer_slice` writes that slice for a drafter made earlier (`dvi drafter bootstrap --slice-only`).

This module wires the corpus, the target and the trainer; it knows nothing of HTTP serving, Kafka or MLflow's server.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import platform
import random
import subprocess
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import LogitsProcessorList

from dvi import corpus, store
from dvi.config import DviConfig, flat_params
from dvi.errors import DviError
from dvi.files import sha256_file
from dvi.models import encode_chat, end_ids, read_drafter_meta
from dvi.pairs import load_any_drafter, resolve_pair
from dvi.records import DecisionRecord, RoundRecord, Sampling, Target
from dvi.tracking import Tracker
from trainers import anchor
from trainers.data import FileSource
from trainers.ds import merged_state_dict
from trainers.gate import evaluate_each, pooled
from trainers.recipe import Trainer

SAMPLED_TEMPERATURE = 0.8
TOPK = 8  # teacher columns per position, as serving logs them (stream.topk)
CHUNK_ROUNDS = 64  # rounds per record (stream.chunk_rounds)
REPORT = "bootstrap.json"


@dataclass(frozen=True)
class Plan:
    """What a bootstrap run makes, and where."""

    work: Path
    out: Path
    prompts: int | None = None  # None: the whole corpus
    corpus_file: Path | None = None  # a corpus made earlier (`corpus.jsonl`), instead of mining this Python's text
    samples: int = 2
    new_tokens: int = 192
    max_prompt_tokens: int = 448
    batch: int = 16
    answer_minutes: float | None = None  # answering stops after this long (the rest of the corpus left out)
    minutes: float | None = 10.0
    steps: int | None = None
    seed: int = 0


# ----------------------------------------------------------------------------------------------
# 1. corpus


def corpus_stage(plan: Plan) -> tuple[list[corpus.CorpusPrompt], dict]:
    path, man = plan.work / "corpus.jsonl", plan.work / "corpus-manifest.json"
    if not (path.is_file() and man.is_file()):
        prompts = corpus.read_corpus(plan.corpus_file) if plan.corpus_file else corpus.bootstrap_prompts(plan.prompts, plan.seed)
        if plan.corpus_file and plan.prompts:
            prompts = prompts[: plan.prompts]
        tmp = path.with_suffix(".tmp")
        manifest = corpus.write_corpus(prompts, tmp)
        if plan.corpus_file:  # mined elsewhere: this Python's text is not what it came from
            manifest["mined_from"] = {"corpus_file": str(plan.corpus_file)}
        man.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, path)
    manifest = json.loads(man.read_text())
    if sha256_file(path) != manifest["file_sha256"]:
        raise DviError(f"{path} does not match its manifest's sha256 ({man}): remove both to mine the corpus again")
    return corpus.read_corpus(path), manifest


# ----------------------------------------------------------------------------------------------
# 2. answers


@dataclass(frozen=True)
class Job:
    prompt: corpus.CorpusPrompt
    sample: int  # 0: greedy
    ids: tuple[int, ...]


def jobs(prompts: list[corpus.CorpusPrompt], tokenizer, samples: int, max_prompt_tokens: int) -> list[Job]:
    """Every answer to make, in a fixed order (by prompt length, so a batch pads little): the training prompts
    `samples` times, the held-out ones once, each prompt once; prompts longer than `max_prompt_tokens` are left out."""
    out, seen = [], set()
    for p in prompts:
        if p.id in seen:  # a prompt given twice is answered once
            continue
        seen.add(p.id)
        ids = tuple(encode_chat(tokenizer, [{"role": "user", "content": p.text}]) if p.chat else tokenizer(p.text)["input_ids"])
        if 0 < len(ids) <= max_prompt_tokens:
            out += [Job(p, s, ids) for s in range(samples if p.split == "train" else 1)]
    return sorted(out, key=lambda j: (len(j.ids), j.prompt.id, j.sample))


class _TopK:
    """A logits processor that keeps the target's top-k log-probs (temperature 1, unwarped) of every step."""

    def __init__(self, k: int):
        self.k, self.steps = k, []

    def __call__(self, input_ids, scores):
        top = torch.log_softmax(scores.float(), dim=-1).topk(self.k, dim=-1)
        self.steps.append((top.indices.to(torch.int32), top.values))
        return scores


def answer(target, batch: list[Job], stops: set[int], new_tokens: int, seed: int, pad_id: int):
    """The target's answers to `batch` (all greedy or all sampled): per job, (generated ids, [n, TOPK] ids, [n, TOPK]
    log-probs), cut after the first stop token."""
    device = next(target.parameters()).device
    width = max(len(j.ids) for j in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, j in enumerate(batch):  # left-padded
        ids[i, width - len(j.ids):] = torch.tensor(j.ids)
        mask[i, width - len(j.ids):] = 1
    topk = _TopK(TOPK)
    sampled = batch[0].sample > 0
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = target.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                              do_sample=sampled, temperature=SAMPLED_TEMPERATURE if sampled else None, top_k=0 if sampled else None,
                              top_p=1.0 if sampled else None, logits_processor=LogitsProcessorList([topk]),
                              eos_token_id=sorted(stops), pad_token_id=pad_id, return_dict_in_generate=False)
    gen = out[:, width:].cpu().numpy()
    top_ids = torch.stack([s[0] for s in topk.steps], 1).cpu().numpy()  # [B, steps, TOPK]
    top_lps = torch.stack([s[1] for s in topk.steps], 1).cpu().numpy()
    answers = []
    for i in range(len(batch)):
        n = gen.shape[1]
        for t in range(gen.shape[1]):
            if int(gen[i, t]) in stops:
                n = t + 1
                break
        answers.append((gen[i, :n].tolist(), top_ids[i, :n], top_lps[i, :n]))
    return answers


def target_records(job: Job, generated: list[int], top_ids: np.ndarray, top_lps: np.ndarray, target_name: str,
                   vocab_size: int, seed: int) -> list[DecisionRecord]:
    """One answer as the DecisionRecords of target-only decoding (a round per token: k = 0, the token, the target's
    top-k at its position), CHUNK_ROUNDS rounds a record, tagged with the prompt's domain."""
    sampling = Sampling(SAMPLED_TEMPERATURE if job.sample else 0.0, 1.0, seed if job.sample else None)
    request_id = uuid.uuid5(uuid.NAMESPACE_OID, f"{job.prompt.id}:{job.sample}").hex
    records = []
    starts = list(range(0, len(generated), CHUNK_ROUNDS))
    for c, start in enumerate(starts):
        end = min(start + CHUNK_ROUNDS, len(generated))
        rounds = [RoundRecord(t, 0, [], 0, int(generated[t]), top_ids[t : t + 1], top_lps[t : t + 1].astype(np.float32))
                  for t in range(start, end)]
        records.append(DecisionRecord(request_id=request_id, replica_id="bootstrap", chunk_index=c, final=c == len(starts) - 1,
                                      target=Target(target_name, vocab_size), drafter_version=None, sampling=sampling,
                                      prompt_ids=list(job.ids), prefix_ids=list(generated[:start]),
                                      generated_ids=list(generated[start:end]), rounds=rounds, topk=TOPK,
                                      domain=job.prompt.domain, record_id=uuid.uuid5(uuid.NAMESPACE_OID, f"{request_id}:{c}").hex))
    return records


def _resume_answers(work: Path, settings: dict) -> int:
    """Batches already answered (each line of `answers.progress` is a whole snapshot: the last one that parses holds);
    the record files cut back to what it noted, and the progress file to that line. DviError when the answers were
    begun with other settings (batches, samples, lengths, prompts), which number the batches differently."""
    progress = work / "answers.progress"
    done, sizes, last = 0, {"train": 0, "heldout": 0}, None
    if progress.is_file():
        for line in progress.read_text().splitlines():
            try:
                entry = json.loads(line)
                done, sizes, last = int(entry["batches"]), entry["bytes"], entry
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill, or one appended to it: the snapshots around it hold
    if last is not None and last.get("settings") != settings:
        raise DviError(f"{work} holds answers begun with {last.get('settings')}, not {settings}: give the same options, "
                       "or another --work")
    for split, size in sizes.items():
        path = work / f"records-{split}.jsonl"
        with open(path, "ab") as f:
            f.truncate(size)
    _replace_text(progress, json.dumps(last) + "\n" if last else "")
    return done


def batches_of(todo: list[Job], size: int, seed: int) -> list[list[Job]]:
    """Batches of `size` jobs of one sample index each (a batch is all greedy or all sampled), neighbours in prompt
    length, in an order shuffled with `seed`: answering stopped early (`Plan.answer_minutes`) leaves a sample of every
    domain and length, not the short prompts only."""
    out = []
    for s in sorted({j.sample for j in todo}):
        same = [j for j in todo if j.sample == s]
        out += [same[i : i + size] for i in range(0, len(same), size)]
    random.Random(f"batches:{seed}").shuffle(out)
    return out


def answers_stage(plan: Plan, target, tokenizer, prompts: list[corpus.CorpusPrompt], target_name: str, answerer=None) -> dict:
    """Make (or finish making) the record files; their counts. With `plan.answer_minutes`, batches not started by then
    are left out (counted in `left_out`). `answerer`: what answers a batch as `answer` does, without the target
    (vLLM's engine: `dvi.cli.vllm.answers`); None: `answer`, the target's own `generate`."""
    answerer = answerer or functools.partial(answer, target)
    todo = jobs(prompts, tokenizer, plan.samples, plan.max_prompt_tokens)
    batches = batches_of(todo, plan.batch, plan.seed)
    settings = {"batch": plan.batch, "samples": plan.samples, "new_tokens": plan.new_tokens,
                "max_prompt_tokens": plan.max_prompt_tokens, "seed": plan.seed, "answers": len(todo)}
    done = _resume_answers(plan.work, settings)
    stops, vocab = end_ids(target, tokenizer), int(target.config.vocab_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    files = {s: open(plan.work / f"records-{s}.jsonl", "a") for s in corpus.SPLITS}
    bar = tqdm(total=sum(len(b) for b in batches), initial=sum(len(b) for b in batches[:done]), unit=" answers",
               desc="dvi drafter bootstrap: answers", disable=None, smoothing=0.1)
    t0 = time.perf_counter()
    answered = done
    try:
        for n in range(done, len(batches)):
            if plan.answer_minutes is not None and time.perf_counter() - t0 > plan.answer_minutes * 60:
                break
            batch = batches[n]
            seed = plan.seed * 1_000_003 + n
            for job, (gen, ids, lps) in zip(batch, answerer(batch, stops, plan.new_tokens, seed, pad), strict=True):
                for r in target_records(job, gen, ids, lps, target_name, vocab, seed):
                    files[job.prompt.split].write(json.dumps(r.to_dict()) + "\n")
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
            entry = {"batches": n + 1, "bytes": {s: f.tell() for s, f in files.items()}, "time": time.time(), "settings": settings}
            with open(plan.work / "answers.progress", "a") as p:
                p.write(json.dumps(entry) + "\n")
            bar.update(len(batch))
            answered = n + 1
    finally:
        bar.close()
        for f in files.values():
            f.close()
    counts = {s: sum(1 for _ in open(plan.work / f"records-{s}.jsonl")) for s in corpus.SPLITS}
    return {"answers": sum(len(b) for b in batches[:answered]), "left_out": sum(len(b) for b in batches[answered:]),
            "batches": len(batches), "seconds_this_start": time.perf_counter() - t0, "records": counts}


# ----------------------------------------------------------------------------------------------
# 3-5. training, evaluation, export


def trainer_config(cfg: DviConfig, plan: Plan) -> DviConfig:
    """The trainer's settings for an offline run over the record file: epochs (replay when every fresh record is
    trained), features recomputed, checkpoints and the store in the work directory unless the config names them."""
    t = cfg.trainer
    t = replace(t, run_dir=str(plan.work / "run"), store=t.store or str(plan.work / "store"), features="recompute",
                replay_when_idle=True, idle_exit_s=None, max_steps=plan.steps, holdout_first=min(t.holdout_first, 16),
                max_seconds=plan.minutes * 60 if plan.minutes else None, max_version_age=10**6,
                pending_size=max(t.pending_size, 10**6), replay_size=max(t.replay_size, 10**6), replay_mb=max(t.replay_mb, 65536.0),
                pending_mb=max(t.pending_mb, 65536.0))
    return replace(cfg, trainer=t, trigger=replace(cfg.trigger, kind="continuous"))


def by_domain(trainer, records: list[DecisionRecord], module=None) -> dict:
    """Acceptance figures (`trainers.gate.evaluate`) of the trainer's student (or `module`) per domain and in all."""
    module = module or trainer.student.module
    out = {}
    domains = sorted({r.domain for r in records})
    examples = {d: [trainer.intake.example(r) for r in records if r.domain == d] for d in domains}
    each = {d: evaluate_each(module, ex, trainer.vocab_size, trainer.vocab_map, trainer.teacher_lm, trainer.tcfg.batch_tokens,
                             trainer.gate_rule, trainer.precision) for d, ex in examples.items()}
    for d in domains:
        out[d] = {**pooled(each[d]), "records": len(examples[d])}
    out["all"] = {**pooled([f for d in domains for f in each[d]]), "records": sum(len(e) for e in examples.values())}
    return out


def answer_slice(cfg: DviConfig, drafter_dir: Path, per_domain: int = anchor.PER_DOMAIN, new_tokens: int = CHUNK_ROUNDS,
                 batch: int = 16, seed: int = 0) -> dict:
    """The held-out slice of a bootstrap drafter made earlier (`trainers.anchor`), written beside it: its corpus's
    held-out prompts mined again from this Python's text (only sources whose prompts match the manifest's sha256),
    `per_domain` of them a domain drawn at random, answered greedily by the target; what was written."""
    report = read_drafter_meta(drafter_dir)["bootstrap"]["corpus"]
    held = set(report["heldout_sources"])
    mined = [p for p in corpus.bootstrap_prompts() if p.source in held]
    now = corpus.manifest(mined)["source_sha256"]
    same = {s for s in held if now.get(s) == report["source_sha256"].get(s)}
    chosen = anchor.draw({d: [p for p in mined if p.source in same and p.domain == d] for d in corpus.DOMAINS}, per_domain, seed)
    pair = resolve_pair(cfg.model, with_drafter=False)
    todo = jobs([replace(p, split="heldout") for p in chosen], pair.tokenizer, 1, Plan.max_prompt_tokens)
    stops, vocab = end_ids(pair.target, pair.tokenizer), int(pair.target.config.vocab_size)
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else min(stops)
    records = []
    for n, b in enumerate(batches_of(todo, batch, seed)):
        for job, (gen, ids, lps) in zip(b, answer(pair.target, b, stops, new_tokens, seed * 1_000_003 + n, pad)):
            records += target_records(job, gen, ids, lps, Path(pair.target_dir).name, vocab, seed)[:1]
    out = anchor.slice_path(drafter_dir)
    written = anchor.write(anchor.pick(records, per_domain, seed), out)
    return {"path": str(out), **written, "sources": {"held_out": len(held), "matching": len(same)},
            "by_domain": dict(Counter(r.domain for r in records)), "new_tokens": new_tokens}


def hardware() -> dict:
    out = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    else:
        try:
            out["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
    return out


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _replace_text(path: Path, text: str) -> None:
    """`path` holds `text`, or what it held before: written beside it, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _save(report: dict, work: Path) -> None:
    _replace_text(work / REPORT, json.dumps(report, indent=1, default=str))


def run(cfg: DviConfig, plan: Plan, command: str = "", answerer=None) -> dict:
    """Every stage that has not finished (see the module docstring); the report, also written to `<work>/bootstrap.json`
    and into the drafter's dvi_drafter.json. `answerer`: None (the target's own `generate`), or a callable that, given
    the target's directory, returns an answerer for `answers_stage` with a `close()` (vLLM's engine) and its name."""
    store.check_version_name(plan.out.name)
    plan.work.mkdir(parents=True, exist_ok=True)
    report = json.loads((plan.work / REPORT).read_text()) if (plan.work / REPORT).is_file() else {}
    if (plan.out / store.SUMS).exists():
        if report.get("out", {}).get("path") == str(plan.out):
            return report  # this work directory made it: nothing left to do
        raise DviError(f"{plan.out} already holds a drafter that {plan.work} did not make: name another --out")
    prompts, manifest = corpus_stage(plan)
    for stale in ("trainer", "after", "version", "out"):  # of an earlier run into another --out: this one's come below
        report.pop(stale, None)
    report.update(command=command or report.get("command"), commit=commit(), hardware=hardware(), corpus=manifest,
                  plan={k: str(v) for k, v in vars(plan).items()})
    report.setdefault("seconds", {})
    if not report.get("answers"):
        t0 = time.perf_counter()
        pair = resolve_pair(cfg.model, with_drafter=False, target_weights=answerer is None)  # an answerer loads its own
        name = Path(pair.target_dir).name
        engine = answerer(pair.target_dir) if answerer else None
        try:
            report["answers"] = answers_stage(plan, pair.target, pair.tokenizer, prompts, name, engine)
        finally:
            if engine is not None:
                engine.close()
        report["answers"]["engine"] = getattr(engine, "name", "generate")
        report["seconds"]["answers"] = report["seconds"].get("answers", 0.0) + time.perf_counter() - t0
        del pair
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _save(report, plan.work)

    t0 = time.perf_counter()
    tcfg = trainer_config(cfg, plan)
    source = FileSource(str(plan.work / "records-train.jsonl"))
    tracker = Tracker(tcfg.tracking, run_name="bootstrap", params=flat_params(tcfg),
                      tags={"dvi.role": "bootstrap", "dvi.started": time.strftime("%Y-%m-%d %H:%M:%S")})
    trainer = Trainer(tcfg, source, tracker=tracker, offline=True)
    heldout = FileSource(str(plan.work / "records-heldout.jsonl"), trainer.vocab_size).poll(0.0, max_records=10**7)
    heldout_records = [d.record for d in heldout]
    if "before" not in report:
        report["before"] = by_domain(trainer, heldout_records)
        _save(report, plan.work)
    try:
        trainer.run()
        trainer.gate_and_publish(why="bootstrap done")
        report["seconds"]["training"] = report["seconds"].get("training", 0.0) + time.perf_counter() - t0
        report["trainer"] = {"steps": trainer.state.step, **trainer.state.counters.to_dict(), "precision": trainer.precision,
                             "batch_tokens": tcfg.trainer.batch_tokens, "last_gate": trainer.last_gate}
        version, served = trainer.state.lineage[-1], trainer.state.serving_dir
        if served is None or len(trainer.state.lineage) < 2:
            raise DviError(f"the gate published no version in {trainer.state.step} steps: train longer (--minutes, --steps)")
        published = load_any_drafter(served, trainer.vocab_size, torch.float32, trainer.device, target=trainer.target)
        module = trainer.kind.student(published.model, trainer.features_target)
        report["after"] = by_domain(trainer, heldout_records, module)
        report["version"] = version
        weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
                   for k, v in merged_state_dict(published.model).items()}
        report["out"] = {"path": str(plan.out)}  # a kill after the publish: the rerun finds it this run's
        _save(report, plan.work)
        pub = store.publish(plan.out.parent, plan.out.name, weights, Path(served),
                            {"parent": version, "bootstrap": report, "dtype": "bfloat16"}, published.vocab_map)
        report["out"] = {"path": str(pub.path), "sha256sums": pub.sha256, "bytes": pub.bytes}
        report["slice"] = {"path": str(anchor.slice_path(pub.path)),
                           **anchor.write(anchor.pick(heldout_records, seed=plan.seed), anchor.slice_path(pub.path))}
        _save(report, plan.work)
    finally:
        source.close()
        tracker.close()
        trainer.close()
    return report
