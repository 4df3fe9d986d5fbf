"""vLLM's own OpenAI server as dvi starts it (serve.engine=vllm-server): its command line and environment.

`dvi serve` on this engine runs `vllm serve` (as `python -m dvi.cli.vllm serve`: vLLM's supported command line, on
the CPU build too) on the configured pair, with dvi's loop enabled in it as a vLLM plugin (`dvi.cli.vllm.plugin`):
vLLM's API, processes and `/metrics` unchanged, and the records, hot swaps, live judge and tracking of `dvi serve`. The
same command without the plugin's variables is plain vLLM (`plain=True`), what benchmarks compare against. This module
builds argument lists and environments; it starts nothing and does not know the loop.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dvi.cli.vllm.plugin import ENABLE, NAME, OVERRIDES, PORT
from dvi.config import DviConfig, api_key
from dvi.engine_api import MAX_LOGPROBS
from dvi.drafter_kinds import kind_of_dir
from dvi.errors import DviError
from dvi.cli.vllm.engine import aot_compile_off, vllm_env
from dvi.cli.vllm.worker import runner_problem

SERVER = [sys.executable, "-m", "dvi.cli.vllm", "serve"]  # `vllm serve`, on either build (dvi.cli.vllm)


def command(cfg: DviConfig, target: Path, drafter: Path | None, dtype: str, *, port: int | None = None,
            host: str | None = None, k: int | None = None) -> list[str]:
    """The server's command line: the target in `dtype` under dvi's model name (serve.served_model_name, else the
    target's directory name), the drafter (None: none) as its `draft_model` speculator drafting up to `k` tokens
    (default: serve.spec.k_max with adaptive K, which dvi's planner lowers where drafting does not pay, else
    serve.spec.k), serve.max_batch requests at once, browser calls from serve.allowed_origins only. An EAGLE-3 drafter's directory is its `eagle3` speculator instead
    (`DrafterKind.vllm_method`, `dvi.drafter_kinds.kind_of_dir`)."""
    s, v = cfg.serve, cfg.serve.vllm
    cmd = [*SERVER, str(target), "--dtype", dtype, "--max-model-len", str(v.max_model_len),
           "--max-num-seqs", str(s.max_batch), "--max-logprobs", str(MAX_LOGPROBS), "--seed", "0", "--disable-uvicorn-access-log",
           "--gpu-memory-utilization", str(v.gpu_memory_utilization),  # serve.vllm's (a CPU ignores it)
           "--host", host or s.host, "--port", str(port or s.port),
           "--served-model-name", s.served_model_name or target.name,  # the name dvi serve answers to
           "--allowed-origins", json.dumps(list(s.allowed_origins))]  # no web page of another site may call it (CORS)
    if v.enforce_eager:
        cmd.append("--enforce-eager")
    if not v.prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if drafter is not None:
        k = k or (s.spec.k_max if s.spec.adaptive else s.spec.k)
        method = kind_of_dir(drafter).vllm_method
        cmd += ["--speculative-config", json.dumps({"method": method, "model": str(drafter), "num_speculative_tokens": k})]
    return cmd


def environment(cfg: DviConfig, base: dict[str, str], *, overrides: list[str] | None = None, loop_port: int | None = None,
                plain: bool = False) -> dict[str, str]:
    """The server's environment: `base` with vLLM's settings (`dvi.cli.vllm.engine.vllm_env`) and, unless `plain`,
    dvi's loop enabled with these Hydra `overrides` and its view on 127.0.0.1:`loop_port` (relayed at /dvi/health and
    /dvi/metrics). dvi's API key (`dvi.config.api_key`: serve.api_key, $DVI_API_KEY or serve.api_key_file) becomes
    vLLM's ($VLLM_API_KEY), unless that is set already. A `base` that asks for vLLM's Model Runner V2, which the loop
    does not hook, is refused (`dvi.cli.vllm.worker.runner_problem`)."""
    env = {**base, **vllm_env(cfg.serve.vllm)}
    aot_compile_off(env)  # off on vLLM's CPU build, unless `base` sets it
    for key in (ENABLE, OVERRIDES, PORT):
        env.pop(key, None)
    if plain:
        return env
    problem = runner_problem(base)  # the loop's plugin would refuse it once vLLM had started
    if problem:
        raise DviError(problem)
    env.update({ENABLE: "1", OVERRIDES: json.dumps(list(overrides or [])), "VLLM_PLUGINS": NAME})
    if loop_port:
        env[PORT] = str(loop_port)
    key = api_key(cfg.serve, base)
    if key and not base.get("VLLM_API_KEY"):
        env["VLLM_API_KEY"] = key
    return env
