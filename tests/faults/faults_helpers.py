"""Helpers of the fault-injection suite (issue: kill every part under load, feed it bad input, lose nothing).

Every test here is marked `faults` (run them all with `pytest -m faults`, one scenario with its file) and runs against real
parts: `dvi serve` / `dvi train` processes on the real demo pair, the embedded Kafka-protocol broker, a real MLflow
server, DeepSpeed. Each asserts its pass criterion and prints its figures (`pytest -s` shows them).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import requests
from child_env import clean_env

from dvi.procs import Child, free_port, http_ok, spawn, wait_ready


def stream_overrides(stream_cfg) -> list[str]:
    return [f"stream.bootstrap_servers={stream_cfg.bootstrap}", f"stream.topic={stream_cfg.topic}",
            f"stream.dlq_topic={stream_cfg.dlq_topic}", f"stream.control_topic={stream_cfg.control_topic}"]


# the serving engines a scenario runs on, vLLM's eager here (compiling takes minutes on 2 cores; tests/dvi/cli/test_up.py
# runs the compiled default end to end): the loop's scenarios on the default, vLLM's own server with dvi's loop as its
# plugin, and on dvi's own engine; scenarios about dvi's HTTP server run serve.engine=dvi, the engine behind it
LOOP_ENGINES = ("vllm-server", "dvi")


def engine_overrides(engine: str) -> list[str]:
    if engine == "vllm-server":
        return [f"serve.engine={engine}", "serve.vllm.enforce_eager=true", "serve.vllm.cpu_kv_cache_gb=1"]
    return [f"serve.engine={engine}"]


class Serve:
    """A `dvi serve` process on a free port, on `engine` (dvi, or vllm-server: see LOOP_ENGINES), waited on until
    /health answers."""

    def __init__(self, log_dir: Path, *overrides: str, name: str = "serve", no_draft: bool = False, ready_s: float = 240,
                 env: dict[str, str] | None = None, engine: str = "dvi"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = engine
        cmd = [sys.executable, "-m", "dvi.cli", "serve", *(["--no-draft"] if no_draft else []), f"serve.port={self.port}",
               *engine_overrides(engine), *overrides]
        self.child: Child = spawn(name, cmd, log_path=log_dir / f"{name}.log", env=clean_env(**(env or {})))
        wait_ready(self.child, lambda: http_ok(self.url + "/health"), ready_s, f"dvi serve ({name})", interval_s=0.25)

    def health(self) -> dict:
        """The replica's view: dvi serve's /health, the loop's /dvi/health on vLLM's own server."""
        return requests.get(self.url + ("/dvi/health" if self.engine == "vllm-server" else "/health"), timeout=10).json()

    def stop(self) -> int | None:
        return self.child.stop(grace_s=30)


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(interval_s)
