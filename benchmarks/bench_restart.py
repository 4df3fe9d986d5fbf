"""A replica starting beside a loaded one on the same machine, by how their engines are pinned to cores.

vLLM's CPU worker pins its OpenMP threads to cores from the moment its process starts (`serve.vllm.cpu_bind`, vLLM's
VLLM_CPU_OMP_THREADS_BIND). A soak of the default stack with two replicas on one 2-core machine saw a killed replica
not come back within 20 minutes while the other served. This benchmark takes that moment apart, with every part real:
vLLM's own OpenAI server as `dvi serve` starts it (`dvi.cli.vllm.engine.vllm_env`: bf16, compiled, the compile
cache under dvi's cache), without dvi's plugin (its loop does not change how the engine starts), on the demo target.

For each binding scheme, in turn and alone on the machine:

1. replica A starts and serves `--clients` clients that send streamed, greedy 64-token completions back to back;
   its tokens/s over `--window-s` is A alone;
2. replica B starts beside it; the seconds until B's /health answers (at most `--limit-s`: beyond, "not up", and
   A's clients stop until B is up beside an idle A), and A's tokens/s while B started;
3. once B is up, both serve `--clients` clients each for `--window-s`: the two replicas' tokens/s together.

The schemes: `auto` (both replicas vLLM's default: every core, each replica's first thread on the first core),
`split` (each replica its own half of the cores, `serve.vllm.cpu_bind=0` and `=1` on 2 cores: vLLM pins the
worker's threads; `dvi serve` since narrows every process of such a replica to its cores as well, which this benchmark
does not), `nobind` (no pinning). Every number comes from the same run, so the schemes compare as ratios.

Run (alone on the machine, from the checkout root): .venv/bin/python -m benchmarks.bench_restart [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

from benchmarks import load_client
from benchmarks.bench_vllm import plain_vllm
from dvi.config import ModelConfig, VllmConfig
from dvi.errors import DviError
from dvi.hardware import pick_dtype, vllm_version
from dvi.pairs import pair_dirs
from dvi.procs import free_port, http_ok, spawn, wait_ready
from dvi.cli.vllm.engine import vllm_env

SCHEMES = ("auto", "split", "nobind")
OUTPUT_LEN = 64


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def halves(cores: list[int]) -> tuple[str, str]:
    """Two disjoint core lists covering `cores` (the first half, the rest), as serve.vllm.cpu_bind takes them."""
    cut = max(1, len(cores) // 2)
    return ",".join(map(str, cores[:cut])), ",".join(map(str, cores[cut:]))


def binds(scheme: str, cores: list[int]) -> tuple[str, str]:
    """serve.vllm.cpu_bind of replica A and of replica B under `scheme`."""
    if scheme == "split":
        return halves(cores)
    return scheme, scheme


class Clients:
    """`n` clients sending completions to `url` back to back, until stopped; tokens counted as they finish."""

    def __init__(self, url: str, n: int, prompts: list[list[int]]):
        self.url, self.prompts = url, prompts
        self.done: list[tuple[float, int]] = []  # (when it finished, tokens)
        self.failed = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        k = i
        while not self._stop.is_set():
            o = load_client.one(self.url, None, self.prompts[k % len(self.prompts)], OUTPUT_LEN, None)
            k += len(self._threads)
            if o.ok:
                self.done.append((time.monotonic(), o.completion_tokens or 0))
            else:
                self.failed += 1

    def tokens_per_s(self, since: float, until: float) -> float:
        return sum(n for t, n in self.done if since <= t < until) / max(until - since, 1e-9)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=700)


def start(name: str, bind: str, target: Path, dtype: str, logs: Path):
    """A replica (vLLM's own server, pinned as `bind` says) starting; (its child, its URL)."""
    port = free_port()
    env = {**os.environ, **vllm_env(VllmConfig(cpu_bind=bind))}
    child = spawn(name, plain_vllm(target, dtype, "--port", str(port)), log_path=logs / f"{name}.log", env=env)
    return child, f"http://127.0.0.1:{port}"


def ready_after(child, url: str, limit_s: float, what: str) -> float | None:
    """Seconds until the replica at `url` answers /health; None where it did not within `limit_s` (or stopped)."""
    t0 = time.monotonic()
    try:
        wait_ready(child, lambda: http_ok(url + "/health"), limit_s, what, interval_s=1.0)
    except DviError as e:
        log(str(e).splitlines()[0])
        return None
    return round(time.monotonic() - t0, 1)


def run_scheme(scheme: str, target: Path, dtype: str, cores: list[int], a: argparse.Namespace, logs: Path) -> dict:
    bind_a, bind_b = binds(scheme, cores)
    prompts = load_client.prompts(16, 128, (1000, 30000), 0)
    row: dict = {"scheme": scheme, "cpu_bind": {"A": bind_a, "B": bind_b}}
    children = []
    try:
        child_a, url_a = start(f"{scheme}-A", bind_a, target, dtype, logs)
        children.append(child_a)
        t0 = time.monotonic()
        wait_ready(child_a, lambda: http_ok(url_a + "/health"), 900, "replica A", interval_s=1.0)
        row["A_start_s"] = round(time.monotonic() - t0, 1)
        load_client.run(url_a, requests_n=a.clients, concurrency=a.clients, input_len=128, output_len=8)  # warm
        clients_a = Clients(url_a, a.clients, prompts)
        t0 = time.monotonic()
        time.sleep(a.window_s)
        row["A_alone_tok_s"] = round(clients_a.tokens_per_s(t0, time.monotonic()), 1)
        log(f"{scheme}: A up in {row['A_start_s']} s, {row['A_alone_tok_s']} tokens/s alone with {a.clients} clients")

        child_b, url_b = start(f"{scheme}-B", bind_b, target, dtype, logs)
        children.append(child_b)
        t0 = time.monotonic()
        up = row["B_start_s"] = ready_after(child_b, url_b, a.limit_s, "replica B")
        row["A_tok_s_while_B_started"] = round(clients_a.tokens_per_s(t0, time.monotonic()), 1)
        log(f"{scheme}: B {'up in %.1f s' % up if up is not None else 'not up within %d s' % a.limit_s}; "
            f"A served {row['A_tok_s_while_B_started']} tokens/s meanwhile")
        if up is None:  # B's start with A idle, so that the two can still be measured together
            clients_a.stop()
            up = row["B_start_beside_idle_A_s"] = ready_after(child_b, url_b, a.limit_s, "replica B beside an idle A")
            log(f"{scheme}: with A's clients stopped, B was up {up} s later")
            clients_a = Clients(url_a, a.clients, prompts)
        if up is not None:
            clients_b = Clients(url_b, a.clients, prompts)
            time.sleep(5)  # B's first requests compile nothing more, but its first steps warm its caches
            t0 = time.monotonic()
            time.sleep(a.window_s)
            t1 = time.monotonic()
            row["together_tok_s"] = {"A": round(clients_a.tokens_per_s(t0, t1), 1), "B": round(clients_b.tokens_per_s(t0, t1), 1)}
            row["together_tok_s"]["sum"] = round(row["together_tok_s"]["A"] + row["together_tok_s"]["B"], 1)
            log(f"{scheme}: together {row['together_tok_s']} tokens/s")
            clients_b.stop()
            row["B_failed"] = clients_b.failed
        clients_a.stop()
        row["A_failed"] = clients_a.failed
    finally:
        for child in reversed(children):
            child.stop()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, of {', '.join(SCHEMES)}")
    p.add_argument("--clients", type=int, default=4, help="clients per replica (default 4)")
    p.add_argument("--window-s", type=float, default=45.0, help="seconds each throughput is measured over")
    p.add_argument("--limit-s", type=float, default=600.0, help="how long B may take to start")
    p.add_argument("--logs", default="outputs/bench_restart", help="the servers' logs")
    p.add_argument("--json", help="write the result here too")
    a = p.parse_args(argv)
    schemes = [s for s in a.schemes.split(",") if s]
    if not schemes or any(s not in SCHEMES for s in schemes):
        p.error(f"--schemes takes {', '.join(SCHEMES)}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 and "split" in schemes:
        p.error("split needs two cores or more")
    target, _ = pair_dirs(ModelConfig(), with_drafter=False)
    dtype = pick_dtype("auto", "cpu").value
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    rows = [run_scheme(s, target, dtype, cores, a, logs) for s in schemes]
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": len(cores),
                          "vllm": vllm_version(), "dtype": dtype, "python": platform.python_version()},
              "clients": a.clients, "window_s": a.window_s, "limit_s": a.limit_s, "rows": rows}
    print(json.dumps(result, indent=2))
    auto = next((r for r in rows if r["scheme"] == "auto"), None)
    if auto and auto.get("A_alone_tok_s"):
        for r in rows:
            r_alone = r.get("A_alone_tok_s") or 0
            log(f"{r['scheme']}: B start {r.get('B_start_s')} s; A alone {r_alone / auto['A_alone_tok_s']:.2f}x auto's; "
                f"together {r.get('together_tok_s', {}).get('sum')} tokens/s")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
