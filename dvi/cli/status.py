"""`dvi status`: one look at the loop: what each replica serves and how well, the trainer, the publishes.

It asks each replica's `/health` (default: serve.host:serve.port; `--replica URL` for others) and MLflow's REST API
(`dvi.tracking.loop_view`: the newest trainer run's last metrics, the registered drafter versions and their
aliases). Every source may be down: its line says so and the rest is still printed. It imports neither torch nor
the mlflow package, so it answers in well under 2 s. Figures are formatted, "-" where unknown; acceptance is
accepted / drafted tokens, so rounds that drafted nothing do not dilute it. `dvi config show` prints the resolved
configuration (`dvi.config.shown`: secrets masked, credentials in URIs redacted). This module reads; it never
changes anything.
"""

from __future__ import annotations

import argparse
import json
import time

from omegaconf import OmegaConf

from dvi.cli.args import trainer_priority
from dvi.cli.output import out
from dvi.config import load_config, overrides_of, shown
from dvi.hardware import device_type, pick_dtype, pick_engine
from dvi.procs import local_get
from dvi.tracking import loop_view, redact


def replica(url: str, timeout_s: float = 1.5) -> dict:
    """A replica's view: dvi serve's `/health`, or where that is vLLM's own (serve.engine=vllm-server, or dvi's plugin in
    any vLLM server), the loop's `/dvi/health`."""
    try:
        view = json.loads(local_get(url.rstrip("/") + "/health", timeout_s) or "null")
        if not isinstance(view, dict):
            view = json.loads(local_get(url.rstrip("/") + "/dvi/health", timeout_s))
        return {"url": url, **view}
    except (OSError, ValueError) as e:
        return {"url": url, "status": f"unreachable ({type(e).__name__}: {e})"}


def fmt(value, spec: str = ".3f", unit: str = "") -> str:
    """A figure for people: formatted, or "-" when unknown."""
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:{spec}}{unit}"


def ago(t: float | None) -> str:
    if not t:
        return "-"
    s = max(0.0, time.time() - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.1f} min ago"


def drafted_acceptance(by_version: dict) -> tuple[float | None, int]:
    """(accepted / drafted over every version, drafted tokens): rounds that drafted nothing carry no signal."""
    drafted = sum(int(v.get("drafted", 0)) for v in by_version.values())
    accepted = sum(int(v.get("accepted", 0)) for v in by_version.values())
    return (accepted / drafted if drafted else None), drafted


def replica_lines(r: dict) -> list[str]:
    if r.get("status") != "ok":
        return [f"replica {r['url']}: {r.get('status')}"]
    by_version = r.get("by_version") or {}
    overall, drafted = drafted_acceptance(by_version)
    per = ", ".join(f"{v} {fmt(s.get('accepted', 0) / s['drafted'] if s.get('drafted') else None)}" for v, s in by_version.items())
    rec = r.get("records") or {}
    events = r.get("events") or {}
    return [f"replica {r.get('replica_id')} at {r['url']}: drafter {r.get('drafter_version') or '-'}"
            f"{' (on trial)' if r.get('rollout') else ''}, {r.get('requests', 0)} requests, "
            f"median {fmt(r.get('median_tokens_per_s'), '.1f', ' tok/s')}, queue {fmt(r.get('queue_depth'), 'd')}, "
            f"records sent/dropped {fmt(rec.get('sent'), 'd')}/{fmt(rec.get('dropped'), 'd')}",
            f"  acceptance {fmt(overall)} over {drafted} drafted tokens (by version: {per or '-'}); mean accepted length "
            f"{fmt(r.get('mean_accepted_length') if r.get('requests') else None, '.2f')}; swaps {events.get('swap', 0)}, promotions {events.get('promote', 0)}, "
            f"rollbacks {events.get('rollback', 0)}",
            f"  speed over target-only decoding: {vs_target_only(r.get('vs_target_only'))}",
            f"  requests' speed over target-only decoding by version: {version_speeds(r.get('vs_target_only_by_version'))}",
            *turn_lines(r.get("trainer_turns"), r.get("uptime_s"))]


def turn_lines(turns: dict | None, uptime_s: float | None) -> list[str]:
    """What serving gave the trainer's turns (dvi up's pause policy), for people; nothing where it takes none."""
    if not turns:
        return []
    share = f" ({turns['waited_s'] / uptime_s:.1%} of its {uptime_s / 60:.1f} min up)" if uptime_s else ""
    return [f"  waited for the trainer's turns on the CPU: {turns['turns']} turns, {turns['waited_s']:.1f} s{share}"]


def vs_target_only(by_bucket: dict | None) -> str:
    """The engine's measured speed over target-only decoding by batch size, for people."""
    if not by_bucket:
        return "- (not measured yet: it needs drafting and plain steps, or a start-up cost table, at one batch size)"
    return ", ".join(f"{float(x):.2f}x at batch <= {b}" for b, x in sorted(by_bucket.items(), key=lambda kv: int(kv[0])))


def version_speeds(by_version: dict | None) -> str:
    """Each drafter version's requests' speed over target-only decoding, in all and by domain, for people."""
    if not by_version:
        return "- (no request timed yet: it needs a measured target-only rate at its batch size)"
    parts = []
    for version, speed in by_version.items():
        domains = ", ".join(f"{d} {float(x):.2f}x" for d, x in (speed.get("by_domain") or {}).items())
        parts.append(f"{version} {float(speed['all']):.2f}x" + (f" ({domains})" if domains else ""))
    return "; ".join(parts)


def trainer_lines(m: dict) -> list[str]:
    t = m.get("trainer")
    if not t:
        return ["trainer: no run in MLflow yet"]
    metrics = t["metrics"]

    def v(key: str):
        return (metrics.get(key) or {}).get("value")

    step = max((x["step"] for x in metrics.values()), default=None)
    lines = [f"trainer: run {t.get('run_name') or t['run_id'][:8]} ({(t.get('status') or '-').lower()}), step {fmt(step, 'd')}, "
             f"{fmt(v('count/records'), '.0f')} records ({fmt(v('count/trained'), '.0f')} trained, "
             f"{fmt(v('count/held_out'), '.0f')} held out), consumer lag {fmt(v('consumer_lag'), '.0f')}, loss {fmt(v('loss'), '.3f')}, "
             f"retrain requests {fmt(v('count/retrains'), '.0f')}"]
    if (share := v("trigger/busy_share")) is not None:  # under dvi up's pause policy (trainers.triggers.Claim)
        lines[0] += f", claims {100 * share:.3g}% of serving's busy time"
    gate = metrics.get("gate/candidate_acceptance")
    if gate:
        outcome = "passed" if v("gate/passed") == 1.0 else "refused" if v("gate/passed") == 0.0 else "-"
        last = (f"last gate at step {gate['step']} {ago(gate['time'])}: {outcome}, candidate {fmt(gate['value'], '.4f')} "
                f"vs serving {fmt(v('gate/serving_acceptance'), '.4f')} on {fmt(v('gate/holdout_records'), '.0f')} held-out records")
        slice_at = metrics.get("gate/anchor_acceptance")
        if slice_at and slice_at["step"] == gate["step"]:  # the candidate passed on live traffic: its bootstrap slice
            last += (f", on the bootstrap's held-out slice {fmt(slice_at['value'], '.4f')} (the starting drafter's "
                     f"{fmt(v('gate/anchor_start'), '.4f')})")
    else:
        last = "no gate has run yet"
    nxt = metrics.get("gate/next_in_s")
    due = f"in {max(0.0, nxt['time'] + nxt['value'] - time.time()):.0f} s or " if nxt else ""
    lines.append(f"  {last}; next gate {due}at step {fmt(v('gate/next_step'), '.0f')} "
                 f"({fmt(v('count/gates'), '.0f')} gates, {fmt(v('count/published'), '.0f')} published, {fmt(v('count/refused'), '.0f')} refused)")
    return lines


def publish_lines(m: dict) -> list[str]:
    versions = m.get("versions") or []
    aliases = ", ".join(f"{a}={v}" for a, v in sorted((m.get("aliases") or {}).items())) or "none"
    if not versions:
        metrics = (m.get("trainer") or {}).get("metrics") or {}
        held, needed = ((metrics.get(k) or {}).get("value") for k in ("holdout/records", "holdout/needed"))
        if held is not None and needed is not None and held < needed:
            why = f"the gate waits for held-out records: {held:.0f} of {needed:.0f}"
        elif "gate/candidate_acceptance" in metrics:
            why = "the gate has refused every candidate so far (see the trainer's last gate)"
        else:
            why = "no gate has run yet"
        return [f"published: none yet: {why}"]
    newest = versions[0]
    tags = newest["tags"]

    def gate(key: str) -> str:
        try:
            return f"{float(tags[key]):.4f}"
        except (KeyError, ValueError):
            return "-"

    return [f"published: {len(versions)} versions, newest {newest['version']} ({ago(newest['created'])}, parent "
            f"{tags.get('parent_version', '-')}, {tags.get('records_trained', '-')} records trained, gate "
            f"{gate('gate.serving_acceptance')} -> {gate('gate.candidate_acceptance')}); aliases {aliases}"]


def status(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args))
    urls = args.replica or [f"http://{cfg.serve.host}:{cfg.serve.port}"]
    view = {"replicas": [replica(u) for u in urls], "mlflow": loop_view(cfg.tracking) if cfg.tracking.enabled else None}
    if args.json:
        out(json.dumps(view, default=str))
        return 0
    lines = [line for r in view["replicas"] for line in replica_lines(r)]
    m = view["mlflow"]
    if m is None:
        lines.append("mlflow: tracking disabled (trainer and publishes are shown from MLflow)")
    elif "error" in m and "versions" not in m:
        lines.append(f"mlflow {m['uri']}: {m['error']}")
    else:
        lines += trainer_lines(m) + publish_lines(m) + [f"mlflow: {m['link']}"]
    out("\n".join(lines))
    return 0


def config_show(args: argparse.Namespace) -> int:
    """The configuration every dvi command would run with, given these overrides, as YAML."""
    cfg = load_config(overrides_of(args))
    priority = trainer_priority(cfg)  # before any output: a core it may not use is the command's one error
    text = OmegaConf.to_yaml(OmegaConf.create(shown(cfg)))
    out(redact(text), end="")
    # what the auto settings settle to here (a comment: the YAML above stays the config as given)
    device = device_type(cfg.model.device)
    out(f"# on this machine: serve.engine -> {pick_engine(cfg.serve.engine)}")
    out(f"# on this machine: model.dtype -> {pick_dtype(cfg.model.dtype, device)} on {device}")
    out(f"# on this machine: trainer.cpu_priority -> {priority} beside dvi serve")
    return 0

