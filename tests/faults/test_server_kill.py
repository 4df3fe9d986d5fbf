"""Scenario 3, a server killed mid-stream: a client gets an error or a complete answer, never a silently
truncated one; a restarted server picks up the current production drafter. `dvi serve` on the real demo pair,
its store holding a version kept in production (d0001) and a newer one that live traffic rolled back (d0002)."""

from __future__ import annotations

import signal
import threading

import pytest
import requests
import torch

from broker_fixtures import stream_config
from faults_helpers import Serve, stream_overrides

from benchmarks.soak import stream_end

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.broker, pytest.mark.real_model]

LONG = {"prompt": "Here is a long story about a lighthouse keeper.", "max_tokens": 400, "stream": True}


def read_stream(url: str, body: dict, events: list, started: threading.Event) -> str:
    """Read a streamed completion into `events`; how it ended: 'complete' (a finish_reason, then [DONE]), 'error'
    (an error event, or the connection broke), or 'truncated' (it just stopped)."""
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            if r.status_code != 200:
                return "error"
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                events.append(line[6:].decode())
                started.set()
        return stream_end(events)
    except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
        return "error"
    finally:
        started.set()


def stream_then(server: Serve, kill) -> tuple[str, list]:
    events, started, out = [], threading.Event(), {}
    t = threading.Thread(target=lambda: out.setdefault("end", read_stream(server.url, LONG, events, started)), daemon=True)
    t.start()
    assert started.wait(120) and len(events) >= 1
    kill()
    t.join(120)
    return out["end"], events


@pytest.fixture
def production_store(tmp_path, demo_drafter_dir, demo_target_dir):
    from dvi import store
    from dvi.models import load_drafter

    root = tmp_path / "store"
    weights = load_drafter(demo_drafter_dir, 49152).model.state_dict()
    store.publish(root, "d0001", weights, demo_drafter_dir, {"parent": "init"})
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + torch.randn(v.shape, generator=g) * v.std() if v.ndim >= 2 else v for k, v in weights.items()}
    store.publish(root, "d0002", noisy, demo_drafter_dir, {"parent": "d0001"})
    store.record_verdict(root, "d0001", store.PRODUCTION, replica_id="earlier")
    store.record_verdict(root, "d0002", store.REJECTED, replica_id="earlier", reason="live acceptance fell")
    return root


def test_killed_mid_stream_a_client_sees_an_error_and_a_restart_serves_production(broker, production_store, tmp_path):
    scfg = stream_config(broker.bootstrap)
    # the store's versions are layer drafters: a replica serves versions of its configured drafter's kind
    args = [*stream_overrides(scfg), "tracking.enabled=false", f"serve.swap.store={production_store}", "serve.drain_s=2",
            "model.drafter_kind=layers"]
    ends = {}

    server = Serve(tmp_path, *args, name="serve-1")
    assert served_version(server) == "d0001"  # the production version, not the newer rolled-back d0002
    # SIGTERM mid-stream: in flight longer than serve.drain_s, the stream ends with an error event
    status = {}
    ends["sigterm"], events = stream_then(server, lambda: status.setdefault("sigterm", server.child.stop(grace_s=60)))
    assert status["sigterm"] == 0, "dvi serve did not stop cleanly on SIGTERM"
    assert ends["sigterm"] == "error" and "shutting down" in events[-1], events[-3:]

    server = Serve(tmp_path, *args, name="serve-2")
    assert served_version(server) == "d0001"
    ends["sigkill"], events = stream_then(server, lambda: server.child.stop(sig=signal.SIGKILL))
    assert ends["sigkill"] == "error", events[-3:]  # the connection broke: the client knows

    server = Serve(tmp_path, *args, name="serve-3")
    try:
        assert served_version(server) == "d0001"
        ends["undisturbed"], events = stream_then(server, lambda: None)
        assert ends["undisturbed"] == "complete"
    finally:
        server.stop()
    print(f"\nhow streams ended: {ends}; each restart served d0001 (production), never the rolled-back d0002")


def served_version(server: Serve) -> str:
    return server.health()["drafter_version"]
