"""The drift benchmark: acceptance falling on new traffic, and the online loop winning it back.

Run from the checkout root: `python -m benchmarks.drift [--quick] [options] [key=value ...]` (the trailing
Hydra overrides go to every part it starts). One run, side by side on the same machine and the same prompts:

1. the stack: the embedded broker and MLflow (unless config points at running ones), then
2. bootstrap: the demo drafter is distilled offline on domain A (its `bootstrap` split, decoded here, then
   `dvi drafter distill --json --file ... --steps N`, whose JSON result names the versions it published); the
   last of them is the first drafter of the run (`--stack up`: no bootstrap here; the run starts from the drafter
   dvi ships, trained offline on the four domains of `dvi.corpus`, as `dvi up` does);
3. three replicas start from that version (the store's newest, `serve.swap.initial`): `online` follows the control
   topic and logs its decisions for the trainer, `frozen` does neither (the loop off), `plain` decodes target-only;
   `dvi train` distills from the online replica's decisions and publishes better drafters, which `online`
   hot-swaps in; the replay starts once the trainer says its consumer group has joined (the embedded broker holds a
   join for half the session timeout: 30 s for the paused trainer's 60 s session). `--stack` picks what serves: `dvi` (`+experiment=drift`: dvi's engine, fixed K, a drafter over the
   8,192 most frequent tokens, `plain` is `dvi serve --no-draft`) or `vllm` (`+experiment=drift_vllm`, the default
   stack: `dvi serve` as vLLM's own OpenAI server with dvi's loop as its plugin (serve.engine=vllm-server) at the
   model's dtype, compiled, adaptive K, the drafter's full head, and `plain` is plain vLLM's own OpenAI server at the
   same settings, as a vLLM user runs it) or `up` (the same stack with no experiment config: every part on its
   defaults, as `dvi up` runs them, from the shipped drafter); with `--trainer-cores`
   (the vllm stack) the trainer runs on those cores alone (`trainer.cpu_bind`) and the three servers on the others
   (`serve.vllm.cpu_bind`, and plain vLLM's server likewise), as on a machine whose trainer has a device of its own;
4. replay: the schedule (A -> B -> C -> A by default) of `live` prompts from `benchmarks.workloads`, each prompt
   sent to `online` and `frozen` at once (and to `plain` every few prompts) through the HTTP API, each phase lasting
   a budget of the online replica's verification rounds; with `--serial`, one prompt at a time, to the sides one after
   another (the order turning with each prompt), so that each answer is timed without the other servers decoding
   beside it (nor beside the spinning that follows plain vLLM's answers: `PEER_SPIN_S`; pausing, the frozen
   replica's vLLM readers park as the online one's do): on a machine of few cores, servers decoding at once measure
   how they share the cores; `--batch N` sends N prompts to a side at once (batch N) before the next side's turn;
   `--pause-trainer` stops the trainer
   during the frozen and target-only turns, so that those sides run as they do without a trainer and the online
   side as `dvi up` runs it (the trainer then trains only during the online side's turns): beside its requests, or,
   where `trainer.cpu_priority` settles to pause (auto's choice for a trainer on the CPU cores serving runs on:
   `dvi.hardware.pick_cpu_priority`), stopped while the online replica has a request in flight but for
   `trainer.pause_share` of the time, which it runs alone while the online replica waits between two steps, as
   `dvi up` stops it (`dvi.cli.up.HoldWhileBusy` over its `dvi.busy` files, the trainer keeping its side of them:
   a turn it has no use for ends early, and it claims less of the time while its gate refuses its candidates:
   `trainers.triggers.Claim`); `--paced` follows each of the online
   side's turns with a pause as long as its answers took, still the online side's turn (a client with pauses, as
   `benchmarks.first_publish --paced`): the online replica idle, its trainer free to train, the others not timed then;
5. analysis (pure functions below): acceptance, mean accepted length and tokens/s by phase, domain, side and
   drafter version; how many rounds each new domain took to recover to within `tolerance` of the level the online
   drafter reached on A; whether A holds its level when it comes back; on `--stack up` the headline's targets
   (`UP_TARGETS`: every phase against target-only, the domains the shipped drafter's corpus lacks against frozen). A plot, a summary table and every sample
   go to MLflow (run `drift-<time>`) and to the output directory.

The analysis knows samples, not HTTP; the orchestration knows processes and URLs, not the maths of decoding.
It drives dvi from outside, through its commands, HTTP API, store and config; nothing in dvi imports it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import statistics
import subprocess
import sys
import time
import urllib.error
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from matplotlib.figure import Figure

from benchmarks import workloads
from benchmarks.bench_vllm import Server, plain_vllm, server_env
from dvi import store
from dvi.alloc import limit_arenas
from dvi.busy import ENV as BUSY_ENV
from dvi.cli.args import trainer_priority
from dvi.cli.up import DutyCycle, Hold, HoldWhileBusy, Part, Supervisor, banner, plan
from dvi.config import flat_params, load_config, overrides_of
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.errors import DviError
from dvi.hardware import bound_cores, pick_dtype, split_cores
from dvi.models import encode_prompt
from dvi.pairs import pair_dirs, resolve_pair
from dvi.procs import free_port, http_ok, local_post
from dvi.records import records_from_result
from dvi.tracking import Tracker
from trainers.recipe import JOINED

log = logging.getLogger("benchmarks.drift")

SIDES = ("online", "frozen", "plain")
# a paused trainer's consumer-group session (--pause-trainer): longer than the other sides' answers it is stopped
# through (a wave of 8 at batch 8, with the online side's held share between them), short against a run, for the
# embedded broker holds a group join for about half of it before the replay can start (300 s cost 150 s a run)
PAUSED_SESSION_MS = 60_000
# --serial: the pause after each of plain vLLM's turns, so that no side's answer is timed beside it: vLLM's readers of
# its shared-memory queues spin, yielding the core, for a second after their last read (`SpinCondition.busy_loop_s`)
PEER_SPIN_S = 1.0
# --stack: the experiment config every part runs with (up: none, the defaults `dvi up` runs on)
STACKS = {"dvi": "drift", "vllm": "drift_vllm", "up": None}


# ----------------------------------------------------------------------------------------------
# Samples and their analysis (pure)


@dataclass(frozen=True)
class Sample:
    """One answered request. `slot` pairs the sides: the same prompt sent to each side has the same slot."""

    slot: int
    phase: int
    domain: str
    side: str
    t: float  # seconds since the replay started, at the answer
    version: str | None  # the drafter that drafted the request's last round (None: target-only)
    rounds: int  # verification rounds
    drafted: int
    accepted: int
    tokens: int  # generated tokens
    seconds: float  # wall time the client waited

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def acceptance(samples: list[Sample]) -> float | None:
    """accepted / drafted over the samples (None: nothing drafted)."""
    drafted = sum(s.drafted for s in samples)
    return sum(s.accepted for s in samples) / drafted if drafted else None


def mean_accepted_length(samples: list[Sample]) -> float | None:
    """Tokens per verification round, the recovered or bonus token included (so at least 1)."""
    rounds = sum(s.rounds for s in samples)
    return sum(s.tokens for s in samples) / rounds if rounds else None


def median_tokens_per_s(samples: list[Sample]) -> float | None:
    return statistics.median(s.tokens_per_s for s in samples) if samples else None


def paired_ratio(num: list[Sample], den: list[Sample]) -> float | None:
    """Median over slots served by both of num's tokens/s / den's tokens/s."""
    by_slot = {s.slot: s for s in den}
    ratios = [s.tokens_per_s / by_slot[s.slot].tokens_per_s for s in num if s.slot in by_slot and by_slot[s.slot].tokens_per_s > 0]
    return statistics.median(ratios) if ratios else None


def trailing(samples: list[Sample], rounds: int) -> list[Sample]:
    """The latest samples that together cover at least `rounds` verification rounds (all of them if fewer)."""
    out, covered = [], 0
    for s in reversed(samples):
        if covered >= rounds:
            break
        out.append(s)
        covered += s.rounds
    return out[::-1]


def rolling_acceptance(samples: list[Sample], window: int) -> list[tuple[int, float | None]]:
    """(rounds so far, acceptance over the trailing `window` rounds) after each sample, in order."""
    out, total = [], 0
    for i, s in enumerate(samples):
        total += s.rounds
        out.append((total, acceptance(trailing(samples[: i + 1], window))))
    return out


def recovery_rounds(samples: list[Sample], level: float, tolerance: float, window: int) -> int | None:
    """Verification rounds into a phase until the trailing `window` rounds' acceptance first reaches
    `level - tolerance` (a full window: never fewer than `window` rounds); None if it never does."""
    for total, acc in rolling_acceptance(samples, window):
        if total >= window and acc is not None and acc >= level - tolerance:
            return total
    return None


def thirds(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """(first third, last third) of a phase's samples by slot: early and late traffic of the same phase."""
    slots = sorted({s.slot for s in samples})
    if len(slots) < 3:
        return samples, samples
    lo, hi = slots[len(slots) // 3], slots[-(len(slots) // 3)]
    return [s for s in samples if s.slot < lo], [s for s in samples if s.slot >= hi]


@dataclass(frozen=True)
class Targets:
    tolerance: float = 0.05  # recovery: within this of the phase's own final level ...
    recovery_rounds: int = 1000  # ... within this many online rounds of the switch
    forgetting: float = 0.03  # back on the first domain: at most this below its first-phase level
    acceptance_gain: float = 0.15  # online over frozen on shifted domains (last third), absolute
    speedup: float = 1.15  # online over frozen tokens/s on shifted domains (last third)
    speedup_vs_plain: float = 1.25  # online over target-only tokens/s on shifted domains (last third)
    speed_every_phase: bool = False  # True: online over target-only on every phase, not only the shifted ones


# the stack as `dvi up` runs it (--stack up): its drafter starts from the shipped bootstrap, which covers the four
# workload domains; the targets of the headline, by batch size
UP_TARGETS = {1: Targets(acceptance_gain=0.10, speedup_vs_plain=1.25, speed_every_phase=True),
              8: Targets(acceptance_gain=0.10, speedup_vs_plain=1.0, speed_every_phase=True)}


def summarize(samples: list[Sample], schedule: list[str], window: int, targets: Targets = Targets(),
              covered: set[str] | None = None) -> dict:
    """Per phase and side: acceptance, mean accepted length, tokens/s (whole phase, first and last third),
    paired speedups, recovery rounds; and the targets, each with its measured value and whether it holds.
    'Shifted' phases are those whose domain the starting drafter was not trained on (`covered`; None: the first
    domain only, which the run's own bootstrap distills on); their figures are taken over the last third of the
    phase (after the loop had time to adapt) and over the whole phase."""
    def side(rows: list[Sample], name: str) -> list[Sample]:
        return [s for s in rows if s.side == name]

    first = schedule[0]
    covered = {first} if covered is None else covered
    phase0_online = side([s for s in samples if s.phase == 0], "online")
    level = acceptance(trailing(phase0_online, window))
    phases, checks = [], []
    for i, domain in enumerate(schedule):
        rows = [s for s in samples if s.phase == i]
        early, late = thirds(rows)
        p = {"phase": i, "domain": domain, "slots": len({s.slot for s in rows}),
             "online_rounds": sum(s.rounds for s in side(rows, "online"))}
        for name in SIDES:
            for part, subset in (("", rows), ("early_", early), ("late_", late)):
                these = side(subset, name)
                p[f"{part}{name}_acceptance"] = acceptance(these)
                p[f"{part}{name}_tokens_per_s"] = median_tokens_per_s(these)
            p[f"{name}_mean_accepted_length"] = mean_accepted_length(side(rows, name))
        for part, subset in (("", rows), ("late_", late)):
            p[f"{part}online_vs_frozen"] = paired_ratio(side(subset, "online"), side(subset, "frozen"))
            p[f"{part}online_vs_plain"] = paired_ratio(side(subset, "online"), side(subset, "plain"))
            p[f"{part}frozen_vs_plain"] = paired_ratio(side(subset, "frozen"), side(subset, "plain"))
        p["versions"] = sorted({s.version for s in side(rows, "online") if s.version})
        phases.append(p)
        if level is None:
            continue
        if i > 0:
            online = side(rows, "online")
            final = acceptance(trailing(online, window))  # the level the phase ended on
            p["final_online_acceptance"] = final
            p["recovery_rounds"] = recovery_rounds(online, final, targets.tolerance, window) if final is not None else None
            rec = p["recovery_rounds"]
            checks.append({"target": f"phase {i} ({domain}): online acceptance within {targets.tolerance} of the phase's "
                           f"final level {_fmt(final)} within {targets.recovery_rounds} rounds of the switch", "measured": rec,
                           "ok": rec is not None and rec <= targets.recovery_rounds})
        shifted = domain not in covered
        goals = [("late_online_vs_frozen", "frozen", targets.speedup)] if shifted else []
        if shifted or targets.speed_every_phase:
            goals.append(("late_online_vs_plain", "target-only", targets.speedup_vs_plain))
        if shifted:
            gain = _diff(p["late_online_acceptance"], p["late_frozen_acceptance"])
            checks.append({"target": f"phase {i} ({domain}): acceptance online - frozen >= {targets.acceptance_gain} "
                           "(last third)", "measured": gain, "ok": gain is not None and gain >= targets.acceptance_gain})
        for key, name, goal in goals:
            checks.append({"target": f"phase {i} ({domain}): tokens/s online / {name} >= {goal} (last third)",
                           "measured": p[key], "ok": p[key] is not None and p[key] >= goal})
        if i > 0 and domain == first:
            acc = p["online_acceptance"]
            checks.append({"target": f"phase {i} ({domain} again): acceptance >= {first}'s level {level:.3f} - "
                           f"{targets.forgetting} (no forgetting)", "measured": acc,
                           "ok": acc is not None and acc >= level - targets.forgetting})
    return {"schedule": schedule, "window_rounds": window, "level": level, "phases": phases, "targets": checks,
            "swaps": swaps(side(samples, "online"))}


def rounds_axis(samples: list[Sample]) -> dict[int, int]:
    """slot -> the online replica's verification rounds up to and including that slot: the time axis of the plot
    and of the MLflow metrics, on which every side's sample of a slot stands at the same place."""
    x_of, total = {}, 0
    for s in sorted((s for s in samples if s.side == "online"), key=lambda s: s.slot):
        total += s.rounds
        x_of[s.slot] = total
    return x_of


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def swaps(online: list[Sample]) -> list[dict]:
    """Where the online replica's drafter changed: the first sample answered by each new version."""
    out, current = [], None
    for s in sorted(online, key=lambda s: s.slot):
        if s.version and s.version != current:
            if current is not None:
                out.append({"slot": s.slot, "t": s.t, "phase": s.phase, "version": s.version, "previous": current})
            current = s.version
    return out


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(summary: dict) -> str:
    """The summary as a markdown table, then the targets."""
    lines = ["| phase | domain | prompts | online rounds | acceptance online | frozen | plain tok/s | "
             "online tok/s | frozen tok/s | online / frozen | online / plain | last third: acc. online | frozen | "
             "online / frozen | recovered in (rounds) | drafters |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in summary["phases"]:
        lines.append("| " + " | ".join([
            str(p["phase"]), p["domain"], str(p["slots"]), str(p["online_rounds"]), _fmt(p["online_acceptance"]),
            _fmt(p["frozen_acceptance"]), _fmt(p["plain_tokens_per_s"], 1), _fmt(p["online_tokens_per_s"], 1),
            _fmt(p["frozen_tokens_per_s"], 1), _fmt(p["online_vs_frozen"], 2), _fmt(p["online_vs_plain"], 2),
            _fmt(p["late_online_acceptance"]), _fmt(p["late_frozen_acceptance"]), _fmt(p["late_online_vs_frozen"], 2),
            _fmt(p.get("recovery_rounds")), ", ".join(p["versions"])]) + " |")
    lines.append("")
    level = summary["level"]
    lines.append(f"Level on {summary['schedule'][0]}: {_fmt(level)} (online acceptance over the last "
                 f"{summary['window_rounds']} rounds of phase 0); swaps on the online replica: {len(summary['swaps'])}.")
    lines.append("")
    for c in summary["targets"]:
        lines.append(f"- {'met' if c['ok'] else 'NOT met'}: {c['target']}: measured {_fmt(c['measured'])}")
    return "\n".join(lines)


def plot(samples: list[Sample], summary: dict, path: str) -> None:
    """Acceptance (trailing window) and tokens/s over the online replica's verification rounds, by side; domain
    boundaries as dashed lines, swaps as dotted ones, domain A's level minus the tolerance as a band."""
    window = summary["window_rounds"]
    online = sorted((s for s in samples if s.side == "online"), key=lambda s: s.slot)
    x_of = rounds_axis(samples)
    fig = Figure(figsize=(11, 7))  # no pyplot: no global figure state, no display backend
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    colors = {"online": "tab:blue", "frozen": "tab:orange", "plain": "tab:gray"}
    for name in SIDES:
        rows = sorted((s for s in samples if s.side == name and s.slot in x_of), key=lambda s: s.slot)
        if not rows:
            continue
        xs = [x_of[s.slot] for s in rows]
        if name != "plain":
            accs = [acceptance(trailing(rows[: i + 1], window)) for i in range(len(rows))]
            ax1.plot(xs, [a if a is not None else float("nan") for a in accs], color=colors[name], label=f"{name} drafter")
        speeds = [statistics.median(r.tokens_per_s for r in rows[max(0, i - 4): i + 1]) for i in range(len(rows))]
        ax2.plot(xs, speeds, color=colors[name], label="target only" if name == "plain" else f"{name} drafter")
    if summary["level"] is not None:
        ax1.axhline(summary["level"] - 0.05, color="tab:green", lw=0.8, ls="-.", label=f"{summary['schedule'][0]} level - 0.05")
    for p in summary["phases"]:
        starts = [x_of[s.slot] - s.rounds for s in online if s.phase == p["phase"]]
        if starts:
            for ax in (ax1, ax2):
                ax.axvline(min(starts), color="black", lw=0.8, ls="--")
            ax1.text(min(starts), 1.01, f" {p['domain']}", transform=ax1.get_xaxis_transform(), fontsize=9)
    for sw in summary["swaps"]:
        for ax in (ax1, ax2):
            ax.axvline(x_of.get(sw["slot"], 0), color="tab:blue", lw=0.5, ls=":", alpha=0.7)
    ax1.set_ylabel(f"acceptance (last {window} rounds)")
    ax1.set_ylim(0, 1)
    ax1.legend(loc="upper right", fontsize=8)
    ax2.set_ylabel("tokens/s (5-request median)")
    ax2.set_xlabel("verification rounds of the online replica (dotted: drafter swaps; dashed: domain switches)")
    ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle("dvi drift: online loop vs frozen drafter vs target only")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------------
# The run


@dataclass
class Options:
    schedule: list[str] = field(default_factory=lambda: ["code", "prose", "qa", "code"])
    rounds: int = 2400  # online verification rounds per phase
    first_rounds: int | None = None  # the first phase's budget (None: `rounds`)
    boot_prompts: int = 96
    boot_steps: int = 100
    max_tokens: int = 48
    concurrency: int = 2
    plain_every: int = 4  # every n-th prompt also goes to the target-only replica
    window: int = 300  # rounds of the trailing acceptance window (level and recovery)
    seed: int = 0
    stack: str = "dvi"  # what serves (STACKS): dvi's engine, or vLLM's own server with plain vLLM as the target-only side
    trainer_cores: str | None = None  # vllm stack: the trainer on these cores, every server on the others (None: all share)
    serial: bool = False  # each prompt to the sides one after another (each timed alone), not to all at once
    batch: int = 1  # serial: prompts sent to one side at once (its batch), the next side's turn once all are answered
    pause_trainer: bool = False  # serial: the trainer stopped (SIGSTOP) while the frozen and target-only sides answer
    paced: bool = False  # serial: after the online side's turn, a pause as long as it took (a client with pauses)
    out: Path = Path("outputs/drift")

    def budgets(self) -> list[int]:
        return [self.first_rounds or self.rounds] + [self.rounds] * (len(self.schedule) - 1)


# the CI-sized run: a short first phase, a longer shifted one, small bootstrap
QUICK = dict(schedule=["code", "prose"], rounds=1500, first_rounds=120, boot_prompts=12, boot_steps=12, max_tokens=32,
             plain_every=2, window=100)


def parse_schedule(text: str) -> list[str]:
    schedule = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in schedule if d not in workloads.ALL_DOMAINS]
    if bad or len(schedule) < 2:
        raise DviError(f"--domains {text!r}: expected two or more of {', '.join(workloads.ALL_DOMAINS)}, comma-separated")
    return schedule


def ask(base: str, prompt, max_tokens: int, model: str | None = None) -> tuple[dict, float]:
    """One request to a replica's API, or with `model` to plain vLLM's server of that model (no dvi extension):
    (its answer, the seconds the client waited); DviError when it fails."""
    url = base + prompt.path
    body = prompt.body(max_tokens)
    if model is not None:
        body = {**{k: v for k, v in body.items() if k != "dvi"}, "model": model}
    t0 = time.perf_counter()
    try:
        answer = json.loads(local_post(url, json.dumps(body).encode(), timeout_s=600))
    except urllib.error.HTTPError as e:
        raise DviError(f"{url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from e
    except (urllib.error.URLError, OSError) as e:
        raise DviError(f"{url}: {getattr(e, 'reason', e)}") from e
    return answer, time.perf_counter() - t0


def sample_of(answer: dict, seconds: float, *, slot: int, phase: int, domain: str, side: str, t: float) -> Sample:
    """A Sample of an answer: dvi's extension (the answer's `dvi` field) gives its rounds and drafts; plain vLLM's
    (none) decoded a token a round. A replica's answer without it is a DviError: its drafts would count as none."""
    tokens = int(answer["usage"]["completion_tokens"])
    ext = answer.get("dvi")
    if ext is None:
        if side != "plain":
            raise DviError(f"the {side} replica's answer has no `dvi` field (its drafted and accepted counts), which dvi's "
                           "API and dvi's plugin in vLLM's own server add to a JSON answer")
        ext = {"stats": {"rounds": tokens, "drafted": 0, "accepted": 0}}
    stats, versions = ext["stats"], ext.get("drafter_versions") or []
    return Sample(slot=slot, phase=phase, domain=domain, side=side, t=round(t, 3), version=versions[-1] if versions else None,
                  rounds=int(stats["rounds"]), drafted=int(stats["drafted"]), accepted=int(stats["accepted"]),
                  tokens=tokens, seconds=round(seconds, 4))


def bootstrap(cfg, opt: Options, overrides: list[str], work: Path, say) -> str:
    """Distill the demo drafter offline on the first domain's bootstrap prompts; returns the published version."""
    pair = resolve_pair(cfg.model, with_drafter=True)
    engine = SpeculativeEngine(pair.target, pair.drafter, cfg.serve.spec, stop_ids={pair.tokenizer.eos_token_id}, max_batch=4)
    chosen = workloads.prompts(opt.schedule[0], "bootstrap", opt.seed)[: opt.boot_prompts]
    records_file = work / "bootstrap.jsonl"
    t0 = time.perf_counter()
    with records_file.open("w") as f, torch.inference_mode():
        for i in range(0, len(chosen), 4):
            batch = chosen[i: i + 4]
            reqs = [Request(encode_prompt(pair.tokenizer, p.text, raw=not p.chat), max_new_tokens=opt.max_tokens) for p in batch]
            for p, req, res in zip(batch, reqs, engine.generate(reqs)):
                for rec in records_from_result(res, replica_id="bootstrap", target_name=pair.target_dir.name,
                                               vocab_size=engine.vocab_size, sampling=req, domain=p.domain, topk=cfg.stream.topk):
                    f.write(json.dumps(rec.to_dict()) + "\n")
    say(f"drift: bootstrap records: {len(chosen)} {opt.schedule[0]} prompts decoded in {time.perf_counter() - t0:.0f} s")
    del engine, pair
    # its gate judges on the records it holds out: one is enough (a few bootstrap prompts hold out few)
    cmd = [sys.executable, "-m", "dvi.cli", "-v", "drafter", "distill", "--json", "--file", str(records_file), "--steps",
           str(opt.boot_steps), *overrides, f"trainer.run_dir={work / 'bootstrap'}", "trainer.gate_min_records=1",
           f"trainer.gate_every={opt.boot_steps}"]  # one version at the end
    log_file = work / "logs" / "bootstrap.log"
    t0 = time.perf_counter()
    with log_file.open("w") as logf:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=logf, text=True)
    if done.returncode != 0:
        raise DviError(f"the bootstrap distillation failed (status {done.returncode}); see {log_file}")
    result = distill_result(done.stdout, log_file)
    published = result["published_versions"]
    if not published:
        raise DviError(f"the bootstrap distillation published nothing (step {result.get('step')}, "
                       f"serving {result.get('serving')}); see {log_file}")
    version = published[-1]
    if not (store.default_root(cfg) / version).is_dir():
        raise DviError(f"the bootstrap distillation published {version}, which is not in the store "
                       f"{store.default_root(cfg)}; see {log_file}")
    say(f"drift: bootstrap drafter {version}: {opt.boot_steps} steps in {time.perf_counter() - t0:.0f} s "
        f"(step {result.get('step')}, published {', '.join(published)})")
    return version


def distill_result(stdout: str, log_file: Path) -> dict:
    """The JSON object `dvi drafter distill --json` prints as its last line of output: the step, the counters,
    `serving` and `serving_dir`, and `published_versions` (the versions this run published, oldest first)."""
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict) or not isinstance(result.get("published_versions"), list):
        raise DviError(f"the bootstrap distillation printed no JSON result with a 'published_versions' list "
                       f"(last line: {lines[-1][:200] if lines else 'none'!r}); see {log_file}")
    return result


def replay(urls: dict[str, str], opt: Options, say, tick=lambda: None, models: dict[str, str] | None = None,
           turn_of=lambda side: None, keep=lambda sample: None) -> list[Sample]:
    """The schedule through the replicas' HTTP APIs (see the module docstring); every answer becomes a Sample, handed
    to `keep` as it comes. `models`: the sides that are plain vLLM's server, and the model each serves; `turn_of(side)`:
    called, in the serial replay, before each side's turn."""
    models = models or {}
    streams = {d: workloads.cycle(workloads.prompts(d, "live", opt.seed)) for d in set(opt.schedule)}  # A again: fresh prompts
    samples: list[Sample] = []
    slot, errors, t0, budgets = 0, 0, time.monotonic(), opt.budgets()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(SIDES) * max(opt.concurrency, opt.batch)) as pool:
        for phase, domain in enumerate(opt.schedule):
            done_rounds, started = 0, time.monotonic()
            # progress on a terminal (stderr; off when it is not a terminal, e.g. under tests or in a log)
            bar = tqdm(total=budgets[phase], desc=f"drift: phase {phase} ({domain})", unit=" rounds", disable=None, leave=False)
            while done_rounds < budgets[phase]:
                asks = []
                if opt.serial:  # a batch of prompts to one side at a time, all answered before the next side's turn
                    batch = [(slot + i, next(streams[domain])) for i in range(opt.batch)]
                    group = slot // opt.batch
                    sides = [s for s in SIDES if s in urls and (s != "plain" or group % opt.plain_every == 0)]
                    for side in turn(sides, group):
                        turn_of(side)
                        began = time.monotonic()
                        futs = [(n, side, pool.submit(ask, urls[side], prompt, opt.max_tokens, models.get(side))) for n, prompt in batch]
                        concurrent.futures.wait([f for _, _, f in futs])
                        asks += futs
                        if side in models:  # plain vLLM's queue readers spin on after its answers: the next turn not beside them
                            time.sleep(PEER_SPIN_S)
                        if opt.paced and side == "online":  # the client's pause, still the online side's turn: the trainer's
                            time.sleep(time.monotonic() - began)
                    slot += opt.batch
                for _ in range(0 if opt.serial else opt.concurrency):
                    prompt = next(streams[domain])
                    sides = [s for s in SIDES if s in urls and (s != "plain" or slot % opt.plain_every == 0)]
                    asks += [(slot, side, pool.submit(ask, urls[side], prompt, opt.max_tokens, models.get(side))) for side in sides]
                    slot += 1
                for s, side, fut in asks:
                    try:
                        answer, seconds = fut.result()
                        sample = sample_of(answer, seconds, slot=s, phase=phase, domain=domain, side=side, t=time.monotonic() - t0)
                    except DviError as e:  # a failed request, or an answer without its counts: counted, not a sample
                        errors += 1
                        log.warning("slot %d, %s: %s", s, side, e)
                        if errors > 20:
                            raise DviError(f"more than 20 requests failed; the last: {e}") from e
                        continue
                    samples.append(sample)
                    keep(sample)
                    if side == "online":
                        done_rounds += sample.rounds
                        bar.update(sample.rounds)
                online = [x for x in samples if x.phase == phase and x.side == "online"]
                bar.set_postfix_str(f"online acceptance {_fmt(acceptance(online))}, drafter {online[-1].version if online else '-'}")
                tick()
            bar.close()
            ph = [s for s in samples if s.phase == phase]
            say(f"drift: phase {phase} ({domain}) done in {time.monotonic() - started:.0f} s: "
                + ", ".join(f"{name} acceptance {_fmt(acceptance([s for s in ph if s.side == name]))}" for name in ("online", "frozen"))
                + f"; online drafters {sorted({s.version for s in ph if s.side == 'online' and s.version})}")
    return samples


def turn(sides: list[str], slot: int) -> list[str]:
    """The order the serial replay asks `sides` in for prompt `slot`: turned by one place a prompt, so that no side
    always goes first (a server just idle, or just after another's burst, can decode faster or slower)."""
    k = slot % len(sides) if sides else 0
    return sides[k:] + sides[:k]


def run(overrides: list[str], opt: Options, say=print) -> dict:
    """The whole benchmark (see the module docstring); returns the summary, and writes it with the plot and the
    samples into `opt.out`."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = opt.out.expanduser().resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    user = load_config(overrides)
    # a store and topics of this run's own; the broker and MLflow of its own too, unless config names running ones
    experiment = [f"+experiment={STACKS[opt.stack]}"] if STACKS[opt.stack] else []
    base = [*experiment, f"trainer.store={work / 'store'}", f"stream.topic=dvi.drift-{stamp}.decisions",
            f"stream.dlq_topic=dvi.drift-{stamp}.decisions.dlq", f"stream.control_topic=dvi.drift-{stamp}.control",
            f"trainer.group_id=dvi-drift-{stamp}"]
    if user.stream.bootstrap_servers is None:
        base.append(f"stream.port={free_port()}")
    if user.tracking.enabled and user.tracking.uri is None:
        base += [f"tracking.port={free_port()}", f"tracking.root={work / 'mlflow'}"]
    common = [*base, *overrides]
    cfg = load_config(common)
    infra = Supervisor(plan(cfg, only={"broker", "mlflow"}), common, work / "logs", say=say)
    infra.start()
    tracker = Tracker(cfg.tracking, run_name=f"drift-{stamp}", params={"bench": {k: str(v) for k, v in asdict(opt).items()},
                      **flat_params(cfg)}, tags={"dvi.role": "bench", "dvi.bench": "drift"})
    try:
        # the up stack starts from what `dvi up` starts from: the shipped drafter (model.drafter), no bootstrap here
        version = None if opt.stack == "up" else bootstrap(cfg, opt, common, work, say)
        ports = {side: free_port() for side in SIDES}
        urls = {side: f"http://{cfg.serve.host}:{port}" for side, port in ports.items()}

        serving_cores = trainer_cores = None
        if opt.trainer_cores is not None:  # the trainer on cores of its own, the three servers on the rest
            serving_cores, trainer_cores = split_cores(bound_cores("auto"), opt.trainer_cores)
            say(f"drift: the servers on cores {serving_cores}, the trainer on {trainer_cores}")
        pinned = [f"serve.vllm.cpu_bind={serving_cores}"] if serving_cores else []

        # the replicas and the trainer start together (the broker and MLflow are up): `needs` none
        ready_s = 900 if opt.stack == "up" else 300  # up: three servers compiling at once on every core (dvi up: 900 s)

        own = [f"trainer.cpu_bind={trainer_cores}"] if trainer_cores else []
        # --pause-trainer: during the online turns, the trainer stopped while that replica answers, as `dvi up` stops it,
        # where its priority settles to pause (without --pause-trainer the trainer runs beside every side alike)
        pausing = opt.pause_trainer and trainer_priority(load_config([*common, *pinned, *own])).value == "pause"
        busy_dir = work / "busy"

        def replica(side: str, *extra: str, env: dict[str, str] | None = None) -> Part:
            return Part(side, ["serve", *extra, *pinned, f"serve.port={ports[side]}", f"stream.replica_id={side}"],
                        lambda _: http_ok(f"{urls[side]}/health"), ready_s, needs=(), env=env)

        # pausing, the online replica's vLLM readers park once it is not stepping (dvi.cli.vllm.loop.park_idle_readers):
        # the frozen one's too, over a directory of its own that no watch reads, else its readers spin a second after
        # each answer, through the start of the online side's next turn
        parts = [replica("online", env={BUSY_ENV: str(busy_dir)} if pausing else None),
                 replica("frozen", "serve.swap.enabled=false", "serve.log_decisions=false",
                         env={BUSY_ENV: str(work / "busy-frozen")} if pausing else None)]
        models, plain = {}, None
        if opt.stack == "dvi":
            parts.append(replica("plain", "--no-draft", "serve.swap.enabled=false", "serve.log_decisions=false"))
        parts.append(Part("train", ["train", *([f"model.drafter={store.default_root(cfg) / version}"] if version else []),
                                    f"trainer.run_dir={work / 'trainer'}", *own,
                                    # stopped while other sides answer: its consumer group must not expire meanwhile
                                    *([f"stream.session_timeout_ms={PAUSED_SESSION_MS}"] if opt.pause_trainer else [])],
                          # ready once it reads the stream: a group join takes half the session timeout on the embedded
                          # broker (30 s for a paused trainer's), which must not eat into the replay's first phase
                          banner(f"dvi.decision.trainer: {JOINED}", anywhere=True), ready_s, needs=(),
                          # pausing, its side of the turns as under `dvi up`: it says when a turn is of no use to it,
                          # steps a short batch in its turn and says how much of the online replica's time it claims
                          env={BUSY_ENV: str(busy_dir)} if pausing else None))
        # each part names its drafter (the trainer the bootstrap version, the replicas the store's newest): a
        # model.drafter given to the run picks what the bootstrap distills, and must not override theirs
        services = Supervisor(parts, [o for o in common if not o.startswith("model.drafter=")] if version else common,
                              work / "logs", say=say)
        hold = Hold(services, "train") if opt.pause_trainer else None
        turn = ["online"]  # whose turn it is (--serial)

        def turn_of(side: str) -> None:
            turn[0] = side
            # another side's turn: stopped at once; the online side's: let go, or, pausing, the watch decides (a look of
            # the watch begun before the switch may let the trainer go once more, for at most its 20 ms)
            if opt.pause_trainer and (side != "online" or not pausing):
                hold.set(side != "online")

        # the online side's turns as `dvi up` runs it: stopped while it answers, but for pause_share of the time (its
        # duty clock standing still through the other sides' turns, when the trainer is stopped anyway)
        watch = HoldWhileBusy(hold, busy_dir, duty=DutyCycle(cfg.trainer.pause_share),
                              also=lambda: turn[0] != "online") if pausing else None
        try:
            if opt.stack in ("vllm", "up"):  # the peer: plain vLLM's own server at the same dtype, compiled, no drafter
                target_dir, _ = pair_dirs(cfg.model, False)
                dtype = pick_dtype(cfg.model.dtype, "cpu").value
                env, cmd = {**server_env(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, plain_vllm(target_dir, dtype)
                if serving_cores:  # on the replicas' cores, as a replica given serve.vllm.cpu_bind runs: every process
                    env["VLLM_CPU_OMP_THREADS_BIND"], cmd = serving_cores, ["taskset", "-c", serving_cores, *cmd]
                peer = Server("plain-vllm", cmd, env, str(target_dir), "vllm")
                plain, urls["plain"] = peer.start(ports["plain"], work / "logs")
                models["plain"] = str(target_dir)
                say(f"drift: plain vLLM ({dtype}, compiled) at {urls['plain']}")
            services.start()
            if watch:
                watch.start()
            say(f"drift: replaying {' -> '.join(opt.schedule)} ({', '.join(map(str, opt.budgets()))} online "
                f"rounds) against {', '.join(urls.values())}")
            with (work / "samples.jsonl").open("w") as kept:  # each sample as it comes: a run that fails keeps what it had
                samples = replay(urls, opt, say, tick=services.tick, models=models,
                                 turn_of=turn_of,
                                 keep=lambda sample: (kept.write(json.dumps(asdict(sample)) + "\n"), kept.flush()))
        finally:
            if watch:
                watch.close()
            if hold:
                online = " and the online replica's requests but for trainer.pause_share" if pausing else ""
                say(f"drift: the trainer was stopped {hold.held_s:.0f} s of the replay (the frozen and target-only turns{online})")
                hold.set(False)
            services.stop()
            if plain is not None:
                plain.stop(grace_s=30)
        if opt.stack == "up":  # the shipped drafter covers the workload domains of its corpus; the headline's targets
            summary = summarize(samples, opt.schedule, opt.window, UP_TARGETS.get(opt.batch, UP_TARGETS[8]), set(workloads.DOMAINS))
        else:
            summary = summarize(samples, opt.schedule, opt.window)
        summary.update(bootstrap_version=version or "shipped", options={k: str(v) for k, v in asdict(opt).items()})
        (work / "summary.json").write_text(json.dumps(summary, indent=2))
        (work / "summary.md").write_text(table(summary) + "\n")
        plot(samples, summary, str(work / "drift.png"))
        _track(tracker, samples, summary, work)
    finally:
        stats = tracker.close(timeout_s=60)  # before MLflow stops
        infra.stop()
    if cfg.tracking.enabled and stats.dropped:
        say(f"drift: MLflow lost {stats.dropped} metric points")
    return summary


def _track(tracker, samples: list[Sample], summary: dict, work: Path) -> None:
    """The run in MLflow: trailing acceptance and tokens/s per side over the online replica's rounds (the plot's
    x axis), the phase index and the online drafter's publish number; summary figures; the files as artifacts."""
    window = summary["window_rounds"]
    x_of = rounds_axis(samples)
    total = max(x_of.values(), default=0)
    for name in SIDES:
        rows = sorted((s for s in samples if s.side == name and s.slot in x_of), key=lambda s: s.slot)
        for i, s in enumerate(rows):
            point = {f"{name}/tokens_per_s": s.tokens_per_s}
            if name != "plain":
                acc = acceptance(trailing(rows[: i + 1], window))
                if acc is not None:
                    point[f"{name}/acceptance"] = acc
                    point[f"{name}/acceptance/{s.domain}"] = acc
            if name == "online":
                point["phase"] = s.phase
            tracker.log_metrics(point, step=x_of[s.slot])
    flat = {}
    for p in summary["phases"]:
        for k, v in p.items():
            if isinstance(v, (int, float)) and k != "phase":
                flat[f"summary/phase{p['phase']}_{p['domain']}/{k}"] = float(v)
    flat["summary/targets_met"] = float(sum(c["ok"] for c in summary["targets"]))
    flat["summary/targets"] = float(len(summary["targets"]))
    tracker.log_metrics(flat, step=total)
    for name in ("drift.png", "summary.md", "summary.json", "samples.jsonl"):
        tracker.log_artifact(str(work / name), "drift")


# ----------------------------------------------------------------------------------------------
# python -m benchmarks.drift


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.drift",
                                description="acceptance under domain drift: online loop vs frozen drafter vs target-only")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    p.add_argument("--domains", "--schedule", dest="schedule", help="the phases' domains in order, comma-separated, from "
                   f"{', '.join(workloads.DOMAINS)} (default code,prose,qa,code)")
    p.add_argument("--rounds", type=int, help="online verification rounds per phase (default 2400)")
    p.add_argument("--first-rounds", type=int, dest="first_rounds", help="the first phase's budget (default --rounds)")
    p.add_argument("--boot-prompts", type=int, dest="boot_prompts", help="bootstrap prompts of the first domain (default 96)")
    p.add_argument("--boot-steps", type=int, dest="boot_steps", help="bootstrap distillation steps (default 100)")
    p.add_argument("--max-tokens", type=int, dest="max_tokens", help="new tokens per request (default 48)")
    p.add_argument("--concurrency", type=int, help="prompts in flight per replica (default 2)")
    p.add_argument("--plain-every", type=int, dest="plain_every", help="every n-th prompt also goes target-only (default 4)")
    p.add_argument("--window", type=int, help="rounds of the trailing acceptance window (default 300)")
    p.add_argument("--seed", type=int, help="workload shuffle seed (default 0)")
    p.add_argument("--stack", choices=sorted(STACKS), help="what serves: dvi's engine (dvi, the default), the default stack "
                   "with the benchmark's drafter and trainer settings, vLLM's own server with dvi's loop, plain vLLM's own "
                   "server as the target-only side (vllm), or the default stack as `dvi up` runs it, every setting its "
                   "default and the shipped drafter the start (up)")
    p.add_argument("--trainer-cores", dest="trainer_cores", help="the vllm and up stacks: the trainer on these cores (a list "
                   "such as 1 or 2-3), the three servers on the others (default: every part on every core)")
    p.add_argument("--serial", action="store_true", help="each prompt to the sides one after another, each timed "
                   "alone (--batch prompts in flight; --concurrency is not used), not to all sides at once")
    p.add_argument("--batch", type=int, help="--serial: prompts sent to one side at once (default 1)")
    p.add_argument("--pause-trainer", action="store_true", dest="pause_trainer", help="--serial: the trainer stopped "
                   "while the frozen and target-only sides answer (each as it runs without a trainer beside it)")
    p.add_argument("--paced", action="store_true", help="--serial: after each of the online side's turns, a pause as "
                   "long as its answers took (a client with pauses: the online replica idle, its trainer free to train)")
    p.add_argument("--out", help="output directory (default outputs/drift-<time>)")
    p.add_argument("--quick", action="store_true", help="the CI-sized run: code -> prose, small budgets (minutes)")
    p.add_argument("overrides", nargs="*", help="Hydra config overrides, key=value (given to every part)")
    return p


def options_of(args: argparse.Namespace) -> Options:
    """The run's options: the defaults (or --quick's), then each option given."""
    opt = Options(**(QUICK if args.quick else {}))
    for name in ("rounds", "first_rounds", "boot_prompts", "boot_steps", "max_tokens", "concurrency", "plain_every", "window", "seed",
                 "batch"):
        value = getattr(args, name)
        if value is not None:
            if value < (0 if name == "seed" else 1):
                raise DviError(f"--{name.replace('_', '-')}={value}: expected a positive integer")
            setattr(opt, name, value)
    if args.schedule:
        opt.schedule = parse_schedule(args.schedule)
    if args.stack:
        opt.stack = args.stack
    opt.serial = bool(args.serial)
    opt.pause_trainer, opt.paced = bool(args.pause_trainer), bool(args.paced)
    if (opt.pause_trainer or opt.paced or opt.batch != 1) and not opt.serial:
        raise DviError("--batch, --pause-trainer and --paced: with --serial (without it every side is asked at once)")
    if args.trainer_cores:
        if opt.stack not in ("vllm", "up"):
            raise DviError("--trainer-cores: with --stack vllm or up (their servers are pinned by serve.vllm.cpu_bind)")
        split_cores(bound_cores("auto"), args.trainer_cores)  # checked before anything starts
        opt.trainer_cores = args.trainer_cores
    opt.out = Path(args.out) if args.out else Path("outputs") / f"drift-{time.strftime('%Y%m%d-%H%M%S')}"
    return opt


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    args.overrides = list(args.overrides or []) + unknown  # overrides may come between options
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        overrides = overrides_of(args)
        opt = options_of(args)
        limit_arenas()  # before any thread starts (see dvi.alloc)
        summary = run(overrides, opt)
    except DviError as e:
        print(f"drift: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(table(summary))
    print(f"\ndrift: plot, table and samples in {opt.out.resolve()} (and the MLflow run's artifacts, drift/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
