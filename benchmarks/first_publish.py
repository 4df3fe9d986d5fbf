"""`dvi up` as a new user meets it: chat requests that never repeat, the first publish, and every drafter version's
latency against plain vLLM's on the same prompts.

Starts `dvi up` (free ports, a fresh cache for logs, store and trainer; the model pair from the usual cache) and
sends chat requests of `--max-tokens` tokens one after another, each tagged with its domain: the chat prompts of the
sources the shipped bootstrap drafter's corpus held out (`benchmarks.bench_vllm.held_out_chats`: code, prose,
markdown and qa in turn, none repeated), greedy (`temperature` 0: the target's answer, whoever serves it). It watches
the decision lines `dvi up` relays and the trainer's log, and prints, from the moment the stack was ready: minutes and
requests to the first publish, to its swap and to its promotion; per drafter version the live acceptance (accepted /
drafted), the median latency and tokens/s of the requests it served alone; the trainer's positions a second (its
`count/positions` in the stack's MLflow, logged every step). It
stops after `--minutes` from the first request, or (without `--minutes`) after `--after` requests on a new drafter or
`--requests` in all; `--paced` waits as long as each answer took before sending the next (a client with pauses).

Then, the stack stopped, the peer answers the same requests one after another: plain vLLM's own OpenAI server at its
best settings (`benchmarks.bench_vllm`'s peer: compiled, the dtype auto picks, every core), or where `dvi up` runs
dvi's own engine (no vLLM installed) a target-only replica (`dvi serve --no-draft`). Each request's latency is divided
by the peer's on the same prompt (the same greedy answer), and the medians of those ratios are given per drafter
version and per two minutes from the first request (`by_minutes`: the headline's minutes 10-12 among them).

    python -m benchmarks.first_publish [--minutes 12] [--paced] [--requests 60] [--after 10] [--peer-requests N] [--json]
                                       [--screenshots DIR] [key=value overrides]

`benchmarks.sharing` runs `session` under each way of sharing the machine with the trainer. It measures; it asserts
nothing (tests/dvi/cli/test_up.py asserts the publish and the swap).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from benchmarks import mlflow_screenshots
from benchmarks.bench_vllm import PEER, Server, held_out_chats, plain_vllm, server_env
from dvi.cli.status import replica as replica_view
from dvi.config import load_config
from dvi.hardware import pick_dtype, pick_engine
from dvi.pairs import pair_dirs
from dvi.procs import free_port, local_post, sigterm_interrupts

def prompts_of(n: int) -> list[tuple[str, str]]:
    """(domain, prompt) of `n` chat requests, none repeated."""
    chats = held_out_chats()
    if n > len(chats):
        raise SystemExit(f"{n} requests: only {len(chats)} distinct held-out chat prompts")
    return chats[:n]


def drafted_by_version(api: str) -> dict[str, tuple[int, int]]:
    """The replica's (drafted, accepted) by drafter version since it started (its /health, or /dvi/health on vLLM's own
    server)."""
    view = replica_view(api, timeout_s=10)
    return {v: (x["drafted"], x["accepted"]) for v, x in view.get("by_version", {}).items() if v != "none"}


def chat(api: str, domain: str, prompt: str, max_tokens: int, vllm_server: bool, model: str | None = None) -> tuple[dict, dict]:
    """One greedy chat request tagged with its domain: the answer, and its seconds `s` and completion `tokens`."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            **({"model": model} if model else {})}
    body.update({"vllm_xargs": {"dvi_domain": domain}} if vllm_server else {"dvi": {"domain": domain}})
    t0 = time.time()
    r = json.loads(local_post(f"{api}/v1/chat/completions", json.dumps(body).encode(), timeout_s=600))
    return r, {"s": time.time() - t0, "tokens": r["usage"]["completion_tokens"]}


def ask(api: str, domain: str, prompt: str, max_tokens: int, vllm_server: bool) -> dict:
    """One chat request; its drafter versions and (drafted, accepted): dvi's API says them in the answer (`dvi`), on
    vLLM's own server they are the replica's counts before and after it (requests are sent one at a time)."""
    before = drafted_by_version(api) if vllm_server else {}
    r, timing = chat(api, domain, prompt, max_tokens, vllm_server)
    if not vllm_server:
        return {"versions": r["dvi"]["drafter_versions"], "drafted": r["dvi"]["stats"]["drafted"],
                "accepted": r["dvi"]["stats"]["accepted"], **timing}
    after = drafted_by_version(api)
    grew = {v: (d - before.get(v, (0, 0))[0], a - before.get(v, (0, 0))[1]) for v, (d, a) in after.items() if d > before.get(v, (0, 0))[0]}
    return {"versions": list(grew), "drafted": sum(d for d, _ in grew.values()), "accepted": sum(a for _, a in grew.values()), **timing}


def turn_waits(api: str) -> dict:
    """What the replica's steps have waited for the trainer's turns so far (`trainer_turns` of its health view: turns,
    seconds); zeros where it takes none or cannot say."""
    try:
        turns = replica_view(api, timeout_s=10).get("trainer_turns")
    except Exception:  # a view that fails to answer costs this figure, not the run
        turns = None
    return turns or {"turns": 0, "waited_s": 0.0}


def trainer_positions(store: Path) -> list[tuple[float, float]]:
    """(time, teacher positions trained so far) of each of the trainer's steps, from its `count/positions` in the
    stack's local MLflow store (`store`: its sqlite file; the trainer logs it every step with trainer.log_every=1)."""
    if not store.exists():
        return []
    with closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT timestamp, value FROM metrics WHERE key = 'count/positions' ORDER BY timestamp").fetchall()
    return [(t / 1000, v) for t, v in rows]


def positions_per_s(history: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """Teacher positions a second trained between times `t0` and `t1`, from `trainer_positions`' history (the last
    count at or before each time; none before the first: 0)."""
    if t1 <= t0:
        return None
    at = lambda t: max((v for tt, v in history if tt <= t), default=0.0)  # noqa: E731
    return round((at(t1) - at(t0)) / (t1 - t0), 2)


def median_or_none(values) -> float | None:
    values = list(values)
    return round(statistics.median(values), 3) if values else None


def speed(rows: list[dict]) -> dict:
    """Median latency (s), tokens/s, and latency over the peer's on the same prompt, of answered requests (each with
    its seconds `s`, `tokens`, and where the peer answered it `vs_peer`)."""
    if not rows:
        return {"requests": 0, "latency_s": None, "tokens_per_s": None, "latency_vs_peer": None}
    return {"requests": len(rows), "latency_s": median_or_none(x["s"] for x in rows),
            "tokens_per_s": median_or_none(x["tokens"] / x["s"] for x in rows),
            "latency_vs_peer": median_or_none(x["vs_peer"] for x in rows if "vs_peer" in x)}


def acceptance(rows: list[dict]) -> float | None:
    d = sum(x["drafted"] for x in rows)
    return round(sum(x["accepted"] for x in rows) / d, 3) if d else None


class Output:
    """dvi up's output, collected by a thread; `seen(text)` is when a line with `text` first appeared."""

    def __init__(self, proc: subprocess.Popen, echo: bool = True):
        self.lines: list[tuple[float, str]] = []
        self.echo = echo
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            if self.echo:
                print(line, end="", flush=True)

    def seen(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)


@dataclass(frozen=True)
class Phase:
    """A stretch of one client's requests: `minutes` long (None: until the stop rule), `paced`: waiting as long as
    each answer took before the next request."""

    name: str
    minutes: float | None
    paced: bool = False


def session(overrides: list[str], phases: list[Phase], max_tokens: int, requests: int, after: int | None = None,
            screenshots: str | None = None, echo: bool = True, flags: list[str] = ()) -> dict:
    """`dvi up` with `flags` and `overrides` (and its own ports and cache) answering one client through `phases`, at most
    `requests` requests in all (and with `after`, until that many were served by a drafter newer than the first):
    the requests (`rows`: index `i`, seconds from the first request `t`, `phase`, `domain`, versions, counts,
    seconds and tokens), the trainer's positions a second per phase, the stack's lines and its start-up seconds."""
    cfg = load_config(overrides)
    target, drafter = pair_dirs(cfg.model)
    vllm_server = pick_engine(cfg.serve.engine).value == "vllm-server"
    api_port, mlflow_port = free_port(), free_port()
    cache = Path(tempfile.mkdtemp(prefix="dvi-first-publish-"))
    stack = [f"model.target={target}", f"model.drafter={drafter}", f"model.cache_dir={cache}", f"stream.port={free_port()}",
             f"tracking.port={mlflow_port}", f"tracking.root={cache}/mlflow", f"serve.port={api_port}", "trainer.log_every=1",
             *overrides]
    proc = subprocess.Popen([sys.executable, "-m", "dvi.cli", "up", *flags, *stack], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out, api, served, bounds, waited = Output(proc, echo), f"http://127.0.0.1:{api_port}", [], {}, {}
    chats = prompts_of(requests)
    t_start = ready = time.time()
    first_t, newer = None, []
    with sigterm_interrupts():  # SIGTERM or Ctrl-C: stop the stack and report what was measured
        try:
            while out.seen("Ctrl-C stops everything") is None:
                if proc.poll() is not None:
                    raise SystemExit(f"dvi up exited (status {proc.returncode})")
                time.sleep(0.5)
            ready = out.seen("Ctrl-C stops everything")
            for phase in phases:
                t0_phase, turns_before = time.time(), turn_waits(api)
                while len(served) < len(chats) and (phase.minutes is None or time.time() - t0_phase < phase.minutes * 60):
                    domain, prompt = chats[len(served)]
                    t0 = time.time()
                    first_t = first_t or t0
                    r = ask(api, domain, prompt, max_tokens, vllm_server)
                    served.append({"i": len(served), "t": round(t0 - first_t, 2), "phase": phase.name, "domain": domain, **r})
                    print(f"request {len(served)} ({domain}, {phase.name}) at {t0 - ready:.0f} s: {r['s']:.1f} s, drafter "
                          f"{r['versions']}, acceptance {r['accepted']}/{r['drafted']}", flush=True)
                    first = next((x["versions"][0] for x in served if x["versions"]), None)  # the drafter it started with
                    newer = [x for x in served if x["versions"] and x["versions"][0] != first and len(x["versions"]) == 1]
                    if after is not None and len(newer) >= after:
                        break
                    if phase.paced:
                        time.sleep(r["s"])
                t1_phase = time.time()
                bounds[phase.name] = (t0_phase, t1_phase)
                turns_after = turn_waits(api)
                waited_s = turns_after["waited_s"] - turns_before["waited_s"]
                waited[phase.name] = {"turns": turns_after["turns"] - turns_before["turns"], "waited_s": round(waited_s, 2),
                                      "share": round(waited_s / max(t1_phase - t0_phase, 1e-9), 4)}
                if after is not None and len(newer) >= after:
                    break  # the stop rule ends the session, not just its phase
        except KeyboardInterrupt:
            print("first_publish: interrupted; stopping the stack", flush=True)
        finally:
            if screenshots and proc.poll() is None:
                time.sleep(12)  # the replica's next metrics interval, and its tracker's flush
                mlflow_screenshots.main(["--out", screenshots, *stack])  # the stack's MLflow, with its login
            proc.send_signal(signal.SIGTERM)
            proc.wait(180)
    history = trainer_positions(cache / "mlflow" / "mlflow.db")  # the stack's local MLflow (tracking.root)
    trained = {name: {"seconds": round(t1 - t0, 1), "positions_per_s": positions_per_s(history, t0, t1),
                      "serving_waited": waited.get(name)} for name, (t0, t1) in bounds.items()}
    return {"ready_s": round(ready - t_start, 1), "rows": served, "trainer": trained, "lines": out.lines, "ready": ready,
            "first": first_t or ready,
            "vllm_server": vllm_server, "target": str(target), "stack": stack, "banner": [line for _, line in out.lines
                                                                                           if line.startswith("  trainer ")]}


def peer_answers(overrides: list[str], chats: list[tuple[str, str]], max_tokens: int, vllm_server: bool) -> tuple[str, list[dict]]:
    """`chats` answered one after another by the peer: plain vLLM at its best settings where `dvi up` runs vLLM's
    server, else a target-only replica (`dvi serve --no-draft`, the same engine and settings, no records): (its name,
    [{s, tokens}])."""
    cfg = load_config(overrides)
    target, _ = pair_dirs(cfg.model)
    if vllm_server:
        env = {**server_env(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        server = Server(PEER, plain_vllm(target, pick_dtype(cfg.model.dtype, "cpu").value), env, str(target), "vllm")
    else:
        cmd = [sys.executable, "-m", "dvi.cli", "serve", "--no-draft", *overrides, f"model.target={target}",
               "tracking.enabled=false", "serve.log_decisions=false", "serve.swap.enabled=false"]
        server = Server("dvi serve --no-draft", cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, None, "dvi")
    child, api = server.start(free_port(), Path(tempfile.mkdtemp(prefix="dvi-peer-")))
    try:
        chat(api, "code", chats[0][1], 8, vllm_server, server.model)  # warm-up
        return server.name, [chat(api, domain, prompt, max_tokens, vllm_server, server.model)[1] for domain, prompt in chats]
    finally:
        child.stop(grace_s=30)


def report(run: dict, peer: list[dict], peer_name: str) -> dict:
    """What `session` measured, each request against the peer's answer to the same prompt."""
    served, ready = run["rows"], run["ready"]
    for x, p in zip(served, peer):
        x["vs_peer"] = x["s"] / p["s"]
        x["peer_s"] = round(p["s"], 3)

    def at(text: str) -> dict | None:
        t = next((t for t, line in run["lines"] if text in line), None)
        if t is None:
            return None
        return {"minutes": round((t - ready) / 60, 2), "requests": sum(1 for x in served if run["first"] + x["t"] + x["s"] <= t)}

    initial = next((x["versions"][0] for x in served if x["versions"]), None)
    before = [x for x in served if x["versions"] == [initial]]
    after = [x for x in served if x["versions"] and initial not in x["versions"]]
    minutes = int(max((x["t"] for x in served), default=0) // 120) + 1
    return {"ready_s": run["ready_s"], "requests": len(served), "peer": peer_name, "peer_speed": speed(peer),
            "trainer": run["trainer"], "banner": run["banner"],
            "first_publish": at(" published (parent "), "swap": at(" swapped in (was "), "promotion": at(" promoted: live acceptance"),
            "acceptance_before": acceptance(before), "acceptance_after": acceptance(after),
            # requests served by one drafter version alone, per version in the order they served
            "by_version": {v: {**speed(rows), "acceptance": acceptance(rows)}
                           for v in dict.fromkeys(x["versions"][0] for x in served if len(x["versions"]) == 1)
                           for rows in [[x for x in served if x["versions"] == [v]]]},
            "by_phase": {ph: {**speed(rows), "acceptance": acceptance(rows)}
                         for ph in dict.fromkeys(x["phase"] for x in served) for rows in [[x for x in served if x["phase"] == ph]]},
            # every two minutes from the first request: the headline's minutes 10-12 among them
            "by_minutes": {f"{2 * k}-{2 * k + 2}": {**speed(rows), "acceptance": acceptance(rows)}
                           for k in range(minutes) for rows in [[x for x in served if 2 * k * 60 <= x["t"] < (2 * k + 2) * 60]]},
            "all": speed(served),
            "requests_by": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in x.items()} for x in served],
            "decision_lines": [line for _, line in run["lines"] if " dvi.decision." in line]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, help="stop this long after the first request (else by --after / --requests)")
    p.add_argument("--paced", action="store_true", help="wait as long as each answer took before the next request")
    p.add_argument("--requests", type=int, default=None, help="stop after this many requests in all (default 60; with "
                   "--minutes, as many as there are distinct prompts)")
    p.add_argument("--after", type=int, default=10, help="without --minutes: stop after this many requests on the "
                   "published drafter")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--peer-requests", type=int, default=None, help="requests the peer answers (default: every one sent)")
    p.add_argument("--json", type=Path, help="also write the result here")
    p.add_argument("--screenshots", metavar="DIR", help="before stopping the stack, screenshot its MLflow pages into DIR "
                   "(benchmarks.mlflow_screenshots; needs chromium)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    requests = args.requests or (len(held_out_chats()) if args.minutes else 60)
    phase = Phase("paced" if args.paced else "continuous", args.minutes, args.paced)
    run = session(args.overrides, [phase], args.max_tokens, requests, after=None if args.minutes else args.after,
                  screenshots=args.screenshots)
    chats = prompts_of(len(run["rows"]))[: args.peer_requests]
    peer_name, peer = peer_answers(args.overrides, chats, args.max_tokens, run["vllm_server"]) if chats else ("", [])
    result = report(run, peer, peer_name)
    print(json.dumps({k: v for k, v in result.items() if k not in ("requests_by", "decision_lines")}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
