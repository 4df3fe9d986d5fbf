"""dvi's loop inside an unmodified `vllm serve`: a vLLM plugin, inert unless `DVI_LOOP` is set.

Registered under vLLM's `vllm.general_plugins` entry point (`register`, which vLLM calls in each of its processes).
Enabled (`DVI_LOOP=1`), in vLLM's engine-core process, the one whose busy loop steps the engine, it:

- makes dvi's worker extension (`dvi.cli.vllm.worker`) vLLM's `--worker-extension-cls` (another extension there is
  one clear error) and, with adaptive K, gives the speculative config the batch-size schedule dvi's planner rewrites;
- before the busy loop starts, builds a `dvi.serving.replica.Replica` around `VllmEngine.attach(core)`: every request
  vLLM decodes leaves its DecisionRecords on the decision stream, drafter announcements on the control topic are
  checked, swapped in between steps, judged on live traffic, promoted or rolled back, and metrics go to MLflow, as
  `dvi serve` does; the code that decides all of it is the replica's own;
- serves that replica's view on 127.0.0.1:`DVI_LOOP_PORT` when the variable is set: `GET /health` (its JSON: drafter,
  acceptance by version, records sent and dropped, routing) and `GET /metrics` (dvi's Prometheus counters).

In vLLM's API-server process, `dvi.cli.vllm.loop.DviCollector` adds those counters to vLLM's own `/metrics`, and the endpoint plugin
`dvi.cli.vllm.loop.DviEndpoints` (entry point `vllm.endpoint_plugins`, loaded when `VLLM_PLUGINS` names `dvi`) relays the view at
`/dvi/health` and `/dvi/metrics` on vLLM's port and puts `dvi.cli.vllm.middleware.DviRequests` around vLLM's completions: dvi's
domain tag (`X-DVI-Domain`, the body's `dvi` object), the per-client cap and each JSON answer's `dvi` field.

Configuration: `DVI_LOOP_OVERRIDES`, a JSON list of Hydra overrides of conf/ (`["stream.bootstrap_servers=kafka:9092"]`);
the target and drafter are vLLM's (`--model`, the `model` of `--speculative-config`), the batch size its
`--max-num-seqs`; a request's domain is the `dvi_domain` of its `vllm_xargs`. vLLM must be the release dvi's worker
extension reads: another is one clear error at start. Decoding never waits on Kafka or MLflow.
This module knows how vLLM starts its engine core; it does not know HTTP beyond the relay, or the loop's policies.
"""

from __future__ import annotations

import importlib
import os

ENABLE = "DVI_LOOP"  # "1": the loop runs in this vLLM server
OVERRIDES = "DVI_LOOP_OVERRIDES"  # a JSON list of Hydra overrides of conf/
PORT = "DVI_LOOP_PORT"  # where the engine-core process serves the loop's /health and /metrics (127.0.0.1)
NAME = "dvi"  # the plugin's name in VLLM_PLUGINS

_registered = False


def enabled() -> bool:
    return os.environ.get(ENABLE, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point, called in every vLLM process. Inert (it imports nothing more) unless
    `DVI_LOOP` is set; then `dvi.cli.vllm.loop.install` hooks vLLM."""
    global _registered
    if _registered or not enabled():
        return
    _registered = True
    importlib.import_module("dvi.cli.vllm.loop").install()
