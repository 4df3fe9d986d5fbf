"""How soon a new user sees the loop work: `dvi up` on its defaults, README-style chat requests, the first publish.

Starts `dvi up` (free ports, a fresh cache for logs, store and trainer; the model pair from the usual cache) and
sends chat requests of `--max-tokens` tokens one after another, alternating a code and a prose prompt, each
tagged with its domain, as the README's quick start does. It watches the decision lines `dvi up` relays and
prints, from the moment the stack was ready: minutes and requests to the first publish, to its swap and to its
promotion, and per drafter version the live acceptance (accepted / drafted), the median request latency and tokens/s
of the requests it served alone. Stops after `--after` requests on the new drafter or `--requests` in all. Then, in
the same run, the stack stopped, a target-only replica (`dvi serve --no-draft`, the same engine and settings) answers
the first `--target-only` of the same requests: every version's latency and tokens/s are also given as a ratio to it.

    python -m benchmarks.first_publish [--requests 60] [--after 10] [--target-only 10] [--json] [--screenshots DIR]
                                       [key=value overrides]

It measures; it asserts nothing (tests/dvi/cli/test_up.py asserts the publish and the swap).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import mlflow_screenshots
from dvi.cli.status import replica as replica_view
from dvi.config import load_config
from dvi.hardware import pick_engine
from dvi.pairs import pair_dirs
from dvi.procs import free_port, http_ok, local_post, sigterm_interrupts, spawn, wait_ready

CODE = ["Write a Python function that reverses a string.", "Write a Python function that checks whether a number is prime.",
        "Write a Python function that returns the n-th Fibonacci number.", "Write a Python function that counts the words in a text.",
        "Write a Python function that merges two sorted lists.", "Write a Python function that removes duplicates from a list.",
        "Write a Python class for a stack with push and pop.", "Write a Python function that flattens a nested list.",
        "Write a Python function that reads a CSV file into a list of dicts.", "Write a Python function that computes a factorial."]
PROSE = ["Write a short paragraph about the sea at night.", "Describe a busy train station in the morning.",
         "Write a few sentences about autumn in a small town.", "Tell a short story about a lost cat that finds its way home.",
         "Describe the smell of bread in a bakery.", "Write a short paragraph about a mountain hike.",
         "Describe a thunderstorm over a city.", "Write a few sentences about learning to ride a bicycle.",
         "Tell a short story about a lighthouse keeper.", "Describe a quiet library on a rainy afternoon."]


def requests_of(n: int) -> list[tuple[str, str]]:
    """(domain, prompt): code and prose alternating."""
    return [("code", CODE[(i // 2) % len(CODE)]) if i % 2 == 0 else ("prose", PROSE[(i // 2) % len(PROSE)]) for i in range(n)]


def drafted_by_version(api: str) -> dict[str, tuple[int, int]]:
    """The replica's (drafted, accepted) by drafter version since it started (its /health, or /dvi/health on vLLM's own
    server)."""
    view = replica_view(api, timeout_s=10)
    return {v: (x["drafted"], x["accepted"]) for v, x in view.get("by_version", {}).items() if v != "none"}


def chat(api: str, domain: str, prompt: str, max_tokens: int, vllm_server: bool) -> tuple[dict, dict]:
    """One chat request tagged with its domain: the answer, and its seconds `s` and completion `tokens`."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
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


def speed(rows: list[dict]) -> dict:
    """Median request latency (s) and tokens/s of answered requests (each with its seconds `s` and `tokens`)."""
    if not rows:
        return {"requests": 0, "latency_s": None, "tokens_per_s": None}
    return {"requests": len(rows), "latency_s": round(statistics.median(x["s"] for x in rows), 3),
            "tokens_per_s": round(statistics.median(x["tokens"] / x["s"] for x in rows), 2)}


def target_only(overrides: list[str], api_port: int, n: int, max_tokens: int, vllm_server: bool) -> list[dict]:
    """The first `n` requests of the run answered by a target-only replica (`dvi serve --no-draft`, the same engine and
    settings as the stack's, no tracking, no records), one after another: [{s, tokens}]."""
    cmd = [sys.executable, "-m", "dvi.cli", "serve", "--no-draft", *overrides, "tracking.enabled=false", "serve.log_decisions=false",
           "serve.swap.enabled=false"]
    child = spawn("target-only", cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    api = f"http://127.0.0.1:{api_port}"
    try:
        wait_ready(child, lambda: http_ok(api + "/health"), 900, "the target-only replica", interval_s=1.0)
        chat(api, "code", CODE[0], 8, vllm_server)  # warm-up
        return [chat(api, domain, prompt, max_tokens, vllm_server)[1] for domain, prompt in requests_of(n)]
    finally:
        child.stop(grace_s=30)


class Output:
    """dvi up's output, collected by a thread; `seen(text)` is when a line with `text` first appeared."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            print(line, end="", flush=True)

    def seen(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=60, help="stop after this many requests in all")
    p.add_argument("--after", type=int, default=10, help="stop after this many requests on the published drafter")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--target-only", type=int, default=10, help="requests a target-only replica answers after the stack stops (0: none)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--screenshots", metavar="DIR", help="before stopping the stack, screenshot its MLflow pages into DIR "
                   "(benchmarks.mlflow_screenshots; needs chromium)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.overrides)
    target, drafter = pair_dirs(cfg.model)
    vllm_server = pick_engine(cfg.serve.engine).value == "vllm-server"
    api_port, mlflow_port = free_port(), free_port()
    cache = tempfile.mkdtemp(prefix="dvi-first-publish-")
    overrides = [f"model.target={target}", f"model.drafter={drafter}", f"model.cache_dir={cache}", f"stream.port={free_port()}",
                 f"tracking.port={mlflow_port}", f"tracking.root={cache}/mlflow", f"serve.port={api_port}", *args.overrides]
    proc = subprocess.Popen([sys.executable, "-m", "dvi.cli", "up", *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out, api, served = Output(proc), f"http://127.0.0.1:{api_port}", []
    t_start = ready = time.time()
    with sigterm_interrupts():  # SIGTERM or Ctrl-C: stop the stack and print what was measured
        try:
            while out.seen("Ctrl-C stops everything") is None:
                if proc.poll() is not None:
                    raise SystemExit(f"dvi up exited (status {proc.returncode})")
                time.sleep(0.5)
            ready = out.seen("Ctrl-C stops everything")
            for i, (domain, prompt) in enumerate(requests_of(args.requests)):
                t0 = time.time()
                r = ask(api, domain, prompt, args.max_tokens, vllm_server)
                served.append({"i": i + 1, "t": t0 - ready, "domain": domain, **r})
                print(f"request {i + 1} ({domain}) at {t0 - ready:.0f} s: {r['s']:.1f} s, drafter "
                      f"{r['versions']}, acceptance {r['accepted']}/{r['drafted']}", flush=True)
                first = next((x["versions"][0] for x in served if x["versions"]), None)  # the drafter it started with
                newer = [x for x in served if x["versions"] and x["versions"][0] != first and len(x["versions"]) == 1]
                if len(newer) >= args.after:
                    break
        except KeyboardInterrupt:
            print("first_publish: interrupted; stopping the stack", flush=True)
        finally:
            if args.screenshots and proc.poll() is None:
                time.sleep(12)  # the replica's next metrics interval, and its tracker's flush
                mlflow_screenshots.main(["--out", args.screenshots, *overrides])  # the stack's MLflow, with its login
            proc.send_signal(signal.SIGTERM)
            proc.wait(180)
    plain = target_only(overrides, api_port, min(args.target_only, len(served)), args.max_tokens, vllm_server) \
        if args.target_only and served else []
    base = speed(plain)

    def versus(rows: list[dict]) -> dict:
        """`speed` of the rows, with its ratios to the target-only replica's (latency: below 1 is faster)."""
        s = speed(rows)
        if base["latency_s"] and s["latency_s"]:
            s["latency_vs_target_only"] = round(s["latency_s"] / base["latency_s"], 3)
            s["tokens_per_s_vs_target_only"] = round(s["tokens_per_s"] / base["tokens_per_s"], 3)
        return s

    def at(text: str) -> dict | None:
        t = out.seen(text)
        if t is None:
            return None
        return {"minutes": round((t - ready) / 60, 2), "requests": sum(1 for x in served if x["t"] + x["s"] <= t - ready)}

    def acceptance(rows: list[dict]) -> float | None:
        d = sum(x["drafted"] for x in rows)
        return round(sum(x["accepted"] for x in rows) / d, 3) if d else None

    initial = next((x["versions"][0] for x in served if x["versions"]), None)
    before = [x for x in served if x["versions"] == [initial]]
    after = [x for x in served if x["versions"] and initial not in x["versions"]]
    result = {"ready_s": round(ready - t_start, 1), "requests": len(served), "first_publish": at(" published (parent "),
              "swap": at(" swapped in (was "), "promotion": at(" promoted: live acceptance"),
              "acceptance_before": acceptance(before), "acceptance_after": acceptance(after),
              "by_domain": {d: {"before": acceptance([x for x in before if x["domain"] == d]),
                                "after": acceptance([x for x in after if x["domain"] == d])} for d in ("code", "prose")},
              # requests served by one drafter version alone, per version in the order they served
              "by_version": {v: {**versus(rows), "acceptance": acceptance(rows)}
                             for v in dict.fromkeys(x["versions"][0] for x in served if len(x["versions"]) == 1)
                             for rows in [[x for x in served if x["versions"] == [v]]]},
              "target_only": base, "before": versus(before), "after": versus(after),
              # the measure: requests within the first 10 minutes of the first one, against target-only
              "first_10_minutes": versus([x for x in served if x["t"] - served[0]["t"] <= 600]) if served else None,
              "decision_lines": [line for _, line in out.lines if " dvi.decision." in line]}
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
