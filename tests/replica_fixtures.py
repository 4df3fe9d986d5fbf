"""A serving replica of the tests: `replica` (the tiny pair following the test's control topic, as `dvi serve`
wires it), `Running` (it behind uvicorn in this process, on a free port), `service_config`, `scrape` (/metrics
parsed by prometheus_client) and `publish_noisy` (a noisy copy of a model, published into a store)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import requests
import torch

from dvi import store
from dvi.config import DviConfig, ModelConfig, ServeConfig, SpecConfig, SwapConfig, TrackingConfig
from dvi.models import load_causal_lm
from dvi.pairs import resolve_pair
from dvi.procs import free_port
from dvi.serving.replica import Replica
from streams.control import ControlChannel


def replica(cfg: DviConfig, **channels) -> Replica:
    """A replica of the tiny pair following the test's control topic (as `dvi serve` wires it)."""
    return Replica(cfg, resolve_pair(cfg.model), control=ControlChannel(cfg.stream, client_id="test-replica"), **channels)


class Running:
    """A replica behind uvicorn in this process, on a free port."""

    def __init__(self, service: Replica):
        import uvicorn

        from dvi.serving.api import create_app

        self.service = service.start()
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body, **kw) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(self.url + path, data=data, timeout=120, **kw)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.service.close()


def service_config(stream_cfg, dirs, store_root: Path, **serve) -> DviConfig:
    target, drafter = dirs
    # dvi's engine unless a test names another: these replicas decode the tiny pair, about the replica, not the engine
    s = dict(engine="dvi", spec=SpecConfig(k=3, adaptive=False), swap=SwapConfig(store=str(store_root), initial="none", window_tokens=10**9),
             max_batch=4, metrics_every_s=3600, plot_every_s=3600)
    s.update(serve)
    # fp32 whatever the CPU: tests compare greedy answers with the target's own, exactly
    return DviConfig(model=ModelConfig(target=str(target), drafter=str(drafter), dtype="float32"), stream=stream_cfg,
                     serve=ServeConfig(**s), tracking=TrackingConfig(enabled=False))


def scrape(url: str) -> dict[tuple, float]:
    """/metrics parsed by prometheus_client: (sample name, *sorted (label, value) pairs) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=10).text
    return {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def publish_noisy(store_root: Path, target_dir: Path, version: str, noise: float, seed: int) -> store.Published:
    """A copy of the target with relative Gaussian noise `noise` on every matrix (noise 10: unrelated weights)."""
    model = load_causal_lm(target_dir, "drafter")
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for k, v in model.state_dict().items():
        weights[k] = v + torch.randn(v.shape, generator=g) * noise * v.std() if v.ndim >= 2 else v.clone()
    return store.publish(store_root, version, weights, target_dir, {"parent": "test"})
