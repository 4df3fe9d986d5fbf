"""The serving replica over real HTTP (uvicorn on a free port), the real broker and a real model store.

The tiny pair (a random Llama with the demo tokenizer, tests/conftest.py) keeps decoding fast; the drafters
swapped in are noisy copies of the target published into the store with `dvi.store.publish`, and announced on
a control topic of the test's own. The last test runs `dvi serve` itself on the real demo pair.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from kafka import KafkaProducer
from replica_fixtures import Running, publish_noisy, replica, scrape, service_config

from dvi import busy, keys, store
from dvi.config import DviConfig, ModelConfig, ServeConfig, SpecConfig, SwapConfig, TrackingConfig, keys_dir
from dvi.control import DrafterPublished, DrafterRejected
from dvi.control import encode as encode_control
from dvi.drafters import shipped_version
from dvi.errors import DviError
from dvi.models import load_causal_lm
from dvi.pairs import resolve_pair
from dvi.procs import free_port
from dvi.serving.replica import REJECTED_KEPT, Replica
from streams.control import ControlChannel, ControlReader
from streams.control import send as control_send

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def announce(stream_cfg, p: store.Published) -> None:
    control_send(stream_cfg, DrafterPublished(p.version, str(p.path), p.sha256, parent="test"))


@pytest.fixture
def running(stream_cfg, tiny_dirs, tmp_path):
    cfg = service_config(stream_cfg, tiny_dirs, tmp_path / "store")
    r = Running(replica(cfg))
    yield r
    r.close()


PROMPTS = [[(7 * i + 13 * j) % 40000 + 100 for j in range(6 + i % 5)] for i in range(24)]


def reference_greedy(dirs, n_tokens: int) -> list[list[int]]:
    """The target's own greedy continuation of each prompt (engine without a drafter)."""
    from dvi.engine import SpeculativeEngine
    from dvi.engine_api import Request

    engine = SpeculativeEngine(load_causal_lm(dirs[0], "target"), None, SpecConfig(), max_batch=8)
    return [r.token_ids for r in engine.generate([Request(p, max_new_tokens=n_tokens) for p in PROMPTS])]


def test_ten_swaps_under_load_keep_every_answer_exact_and_tagged(running, stream_cfg, tiny_dirs, tmp_path):
    store_root = tmp_path / "store"
    initial = running.service.engine.drafter.version
    versions = [publish_noisy(store_root, tiny_dirs[0], f"d{i:04d}", noise=0.05 * (1 + i % 3), seed=i) for i in range(1, 11)]
    expected = reference_greedy(tiny_dirs, 24)

    def ask(i: int) -> dict:
        r = running.post("/v1/completions", {"prompt": PROMPTS[i], "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def swaps():
        for p in versions:
            announce(stream_cfg, p)
            time.sleep(0.4)

    with ThreadPoolExecutor(8) as pool:
        announcer = pool.submit(swaps)
        answers = list(pool.map(ask, list(range(24)) * 2))
        announcer.result()
    deadline = time.monotonic() + 60
    while running.service.metrics.events["swap"] < 10:
        assert time.monotonic() < deadline, running.service.metrics.events
        answers += [ask(0)]

    tokenizer = running.service.tokenizer
    seen = set()
    for i, a in zip(list(range(24)) * 2, answers):
        assert a["choices"][0]["text"] == tokenizer.decode(expected[i], skip_special_tokens=True)
        assert a["usage"]["completion_tokens"] == len(expected[i])
        tags = a["dvi"]["drafter_versions"]
        assert tags and set(tags) <= {initial} | {p.version for p in versions}
        seen.update(tags)
    m = running.service.metrics
    assert m.events["swap"] == 10 and not any(k.startswith("refused") for k in m.events), m.events
    assert running.service.engine.drafter.version == "d0010"
    assert len(seen) >= 3, seen  # requests really ran on several drafters
    assert m.errors == {}


@pytest.mark.faults
def test_refused_drafters_leave_the_current_one_serving(running, tiny_dirs, tmp_path, monkeypatch):
    service, store_root = running.service, tmp_path / "store"
    good = publish_noisy(store_root, tiny_dirs[0], "d0001", noise=0.05, seed=1)
    service.on_control(DrafterPublished(good.version, str(good.path), good.sha256))
    assert service.engine.drafter.version == "d0001"

    outside = publish_noisy(tmp_path / "elsewhere", tiny_dirs[0], "d0002", noise=0.05, seed=2)
    bad_sum = publish_noisy(store_root, tiny_dirs[0], "d0003", noise=0.05, seed=3)
    nan = publish_noisy(store_root, tiny_dirs[0], "d0004", noise=0.05, seed=4)
    w = nan.path / store.WEIGHTS  # NaN written after publishing, with SHA256SUMS recomputed: only the NaN check can catch it
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(w))
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(w), metadata={"format": "pt"})
    from dvi.files import sha256_file

    (nan.path / store.SUMS).write_text("".join(f"{sha256_file(f)}  {f.name}\n" for f in sorted(nan.path.iterdir())
                                               if f.is_file() and f.name != store.SUMS))
    pickled = publish_noisy(store_root, tiny_dirs[0], "d0005", noise=0.05, seed=5)
    (pickled.path / "evil.pkl").write_bytes(b"\x80\x04K\x01.")
    cases = {
        "outside_store": DrafterPublished("d0002", str(outside.path), outside.sha256),
        "checksum": DrafterPublished("d0003", str(bad_sum.path), "f" * 64),
        "nonfinite": DrafterPublished("d0004", str(nan.path), sha256_file(nan.path / store.SUMS)),
        "pickle": DrafterPublished("d0005", str(pickled.path), pickled.sha256),
        "bad_message": DrafterPublished("../d0006", str(store_root / "d0006"), "ab"),  # a message without fields: dvi.control.decode
    }
    for reason, msg in cases.items():
        service.on_control(msg)
        assert service.metrics.events[f"refused:{reason}"] == 1, (reason, service.metrics.events)
        assert service.engine.drafter.version == "d0001"
    # a signed announcement of a version published before one this replica has served: a replay, refused
    newer = publish_noisy(store_root, tiny_dirs[0], "d0008", noise=0.05, seed=8)
    service.on_control(DrafterPublished(newer.version, str(newer.path), newer.sha256))
    service.on_control(DrafterPublished(good.version, str(good.path), good.sha256))
    assert service.metrics.events["refused:stale"] == 1 and service.engine.drafter.version == "d0008"
    service._roll_back("back to d0001 for the checks below", announce=False)
    assert service.engine.drafter.version == "d0001"
    # whatever else fails while a version is checked or loaded (here: an injected error) refuses it once, for good
    later = publish_noisy(store_root, tiny_dirs[0], "d0007", noise=0.05, seed=7)

    def failing_load(ann):
        raise RuntimeError("injected")

    with monkeypatch.context() as m:
        m.setattr(service, "_load", failing_load)
        for _ in range(2):
            service.on_control(DrafterPublished(later.version, str(later.path), later.sha256))
    assert service.metrics.events["refused:error"] == 1 and "d0007" in service.rejected
    assert service.engine.drafter.version == "d0001"
    r = running.post("/v1/completions", {"prompt": "def f(x):", "max_tokens": 8})
    assert r.status_code == 200 and r.json()["dvi"]["drafter_versions"] == ["d0001"]
    assert scrape(running.url)[("dvi_drafter_events_total", ("event", "refused:nonfinite"), ("model_name", "target"))] == 1


@pytest.fixture
def signed_replica(stream_cfg, tiny_dirs, tmp_path):
    """(a running replica on dvi's engine with its control channel, its target directory)."""
    running = Running(replica(service_config(stream_cfg, tiny_dirs, tmp_path / "store")))
    yield running, tiny_dirs[0]
    running.close()


@pytest.mark.faults
def test_only_the_trainer_decides_what_a_replica_serves(signed_replica, stream_cfg, tmp_path):
    """Announcements that are unsigned, signed with a replica's key, or a replay of a genuine one are refused (no
    swap); genuine ones swap. Anyone who can write to the broker cannot pick the drafter. The replica's swap thread
    decides, whichever engine it serves (vLLM's own server: tests/dvi/cli/test_vllm_plugin.py)."""
    running, target = signed_replica
    service, root = running.service, tmp_path / "store"
    d1, d2 = (publish_noisy(root, target, f"d000{i}", noise=0.05, seed=i) for i in (1, 2))
    local = keys.load(keys_dir(stream_cfg), sign_as=("trainer", "replica"))
    genuine = encode_control(DrafterPublished(d1.version, str(d1.path), d1.sha256), keys.Keys(signing={"trainer": local.signing["trainer"]}))
    forged = DrafterPublished(d2.version, str(d2.path), d2.sha256)
    raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)

    def send(data: bytes) -> None:
        raw.send(stream_cfg.control_topic, data).get(timeout=10)

    def until(condition, within_s: float = 90) -> bool:  # a 30-layer drafter's checks and smoke decode take seconds
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.2)
        return False

    serving = lambda: service.engine.drafter.version  # noqa: E731
    initial = serving()
    send(encode_control(forged))  # unsigned
    send(encode_control(forged, keys.Keys(signing={"trainer": local.signing["replica"]})))  # a replica's key as the trainer's
    assert until(lambda: service.control.invalid == 2) and serving() == initial
    send(genuine)
    assert until(lambda: serving() == d1.version)
    announce(stream_cfg, d2)  # genuine
    assert until(lambda: serving() == d2.version)
    send(genuine)  # the same signed bytes again: a replay, refused
    assert until(lambda: service.control.invalid == 3)
    time.sleep(1.0)
    assert serving() == d2.version
    raw.close()
    assert service.control.invalid == 3 and service.metrics.events["swap"] == 2


@pytest.mark.faults
def test_a_replayed_announcement_never_downgrades_a_restarted_or_a_new_replica(stream_cfg, tiny_dirs, tmp_path, monkeypatch):
    """Genuine signed announcements of d0001 and then d0002, re-sent within their validity window: a replica restarted
    under the same name refuses both as replays (what it accepted is kept in its seen file across the restart), and a
    replica that never saw them, started with its configured drafter, refuses d0001 as stale (the store's newest good
    version is d0002). Neither serves d0001."""
    monkeypatch.setenv("DVI_CACHE", str(tmp_path / "cache"))  # the seen files of this test's replicas only
    root = tmp_path / "store"
    cfg = service_config(stream_cfg, tiny_dirs, root)
    local = keys.load(keys_dir(stream_cfg), sign_as=("trainer",))
    raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
    sent = []

    def start(name: str) -> Replica:
        return Replica(cfg, resolve_pair(cfg.model), control=ControlChannel(cfg.stream, client_id=name)).start()

    def wait_for(condition, within_s: float = 60) -> None:
        deadline = time.monotonic() + within_s
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.2)

    def send(data: bytes) -> None:
        raw.send(stream_cfg.control_topic, data).get(timeout=10)

    first = start("dvi-serve-host-8000")
    try:
        wait_for(lambda: first.control.connected)
        for i in (1, 2):
            p = publish_noisy(root, tiny_dirs[0], f"d000{i}", noise=0.05, seed=i)
            sent.append(encode_control(DrafterPublished(p.version, str(p.path), p.sha256), local))
            send(sent[-1])
            wait_for(lambda v=p.version: first.engine.drafter.version == v)
    finally:
        first.close()

    restarted = start("dvi-serve-host-8000")
    try:
        configured = restarted.engine.drafter.version
        wait_for(lambda: restarted.control.connected)
        for data in sent:
            send(data)
        wait_for(lambda: restarted.control.invalid == 2)
        assert restarted.engine.drafter.version == configured and restarted.metrics.events["swap"] == 0
    finally:
        restarted.close()

    new = start("dvi-serve-host-8001")
    try:
        assert new.newest == "d0002"  # what the store says is current
        wait_for(lambda: new.control.connected)
        send(sent[0])
        wait_for(lambda: new.metrics.events["refused:stale"] == 1)
        assert new.engine.drafter.version == configured and new.control.invalid == 0
    finally:
        new.close()
        raw.close()


def test_the_api_key_comes_from_the_environment_or_a_file(tiny_dirs, tmp_path, monkeypatch):
    cfg = DviConfig(model=ModelConfig(target=str(tiny_dirs[0]), drafter=str(tiny_dirs[1])),
                    serve=ServeConfig(engine="dvi", swap=SwapConfig(store=str(tmp_path / "store"), initial="none"),
                                      api_key_file=str(tmp_path / "key")),
                    tracking=TrackingConfig(enabled=False))
    pair = resolve_pair(cfg.model)
    (tmp_path / "key").write_text("from-a-file-123\n")
    monkeypatch.delenv("DVI_API_KEY", raising=False)
    assert Replica(cfg, pair).api_key == "from-a-file-123"
    monkeypatch.setenv("DVI_API_KEY", "from-the-env-456")
    assert Replica(cfg, pair).api_key == "from-the-env-456"
    monkeypatch.delenv("DVI_API_KEY")
    (tmp_path / "key").write_text("short")
    with pytest.raises(DviError, match="fewer than 8"):
        Replica(cfg, pair)


def test_a_replica_that_decodes_here_runs_dvis_engine_and_follows_one_handed_to_it(tiny_dirs, tmp_path, monkeypatch):
    """serve.engine=vllm-server, or auto where vLLM is installed, is vLLM's own server: a replica handed no engine to
    follow refuses it with the reason; on dvi (or auto without vLLM) it decodes here with dvi's engine, and under dvi
    up's pause policy its health tells the trainer's turns it waited for."""
    from dvi import hardware

    pair = resolve_pair(ModelConfig(target=str(tiny_dirs[0]), drafter=str(tiny_dirs[1])))

    def on(engine: str) -> Replica:
        return Replica(DviConfig(model=ModelConfig(target=str(tiny_dirs[0]), drafter=str(tiny_dirs[1])),
                                 serve=ServeConfig(engine=engine, swap=SwapConfig(store=str(tmp_path / "store"), initial="none")),
                                 tracking=TrackingConfig(enabled=False)), pair)

    with pytest.raises(DviError, match=r"^serve.engine=vllm-server is vLLM's own server here, .*runs serve.engine=dvi$"):
        on("vllm-server")
    monkeypatch.setattr(hardware, "vllm_version", lambda: hardware.VLLM_RELEASE + ".0")
    with pytest.raises(DviError, match=r"^serve.engine=auto is vLLM's own server here \(auto: vLLM .* is installed"):
        on("auto")
    assert on("dvi").health()["engine"] == "dvi"
    monkeypatch.setattr(hardware, "vllm_version", lambda: None)
    assert on("auto").health()["engine"] == "dvi" and on("auto").health()["trainer_turns"] is None
    monkeypatch.setenv(busy.ENV, str(tmp_path / "busy"))  # under dvi up's pause policy: its rounds' waits are told
    assert on("dvi").health()["trainer_turns"] == {"turns": 0, "waited_s": 0.0}


@pytest.mark.faults
def test_a_restarted_replica_skips_a_store_version_that_fails_its_checks_for_the_next_good_one(tiny_dirs, tmp_path, caplog):
    """serve.swap.initial=latest with the newest version corrupt (its weights changed after publishing): the replica
    says so, counts it, and serves the version before it, not its configured drafter; none passing, it says that."""
    store_root = tmp_path / "store"
    good = publish_noisy(store_root, tiny_dirs[0], "d0001", noise=0.05, seed=1)
    bad = publish_noisy(store_root, tiny_dirs[0], "d0002", noise=0.05, seed=2)
    (bad.path / store.WEIGHTS).write_bytes(b"not the published weights")
    cfg = DviConfig(model=ModelConfig(target=str(tiny_dirs[0]), drafter=str(tiny_dirs[1])),
                    serve=ServeConfig(engine="dvi", swap=SwapConfig(store=str(store_root), initial="latest")),
                    tracking=TrackingConfig(enabled=False))
    with caplog.at_level(logging.WARNING, logger="dvi.decision.serve"):
        service = Replica(cfg, resolve_pair(cfg.model))
    assert service.engine.drafter.version == good.version and service.metrics.events["refused:checksum"] == 1
    assert any("skipping the store's drafter d0002" in r.getMessage() for r in caplog.records)
    (good.path / store.WEIGHTS).write_bytes(b"nor these")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dvi.decision.serve"):
        service = Replica(cfg, resolve_pair(cfg.model))
    assert service.engine.drafter.version == "init-L1-full"
    assert any("passes its checks (d0002, d0001 tried): serving init-L1-full" in r.getMessage() for r in caplog.records)


def test_rejections_from_the_control_topic_are_bounded(tiny_dirs, tmp_path):
    """However many versions are announced as rejected, a replica remembers a bounded number (its health answer
    stays small), and keeps the newest."""
    cfg = DviConfig(model=ModelConfig(target=str(tiny_dirs[0]), drafter=str(tiny_dirs[1])),
                    serve=ServeConfig(engine="dvi", swap=SwapConfig(store=str(tmp_path / "store"), initial="none")),
                    tracking=TrackingConfig(enabled=False))
    service = Replica(cfg, resolve_pair(cfg.model))
    for i in range(3 * REJECTED_KEPT):
        service.on_control(DrafterRejected(f"d{i:05d}", "replica-b", reason="x" * 1000))
    assert len(service.rejected) == REJECTED_KEPT and f"d{3 * REJECTED_KEPT - 1:05d}" in service.rejected
    assert len(json.dumps(service.health())) < 30 * REJECTED_KEPT
    assert service.engine.drafter.version == "init-L1-full"  # none of them was serving: nothing rolled back


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    from dvi.mlflow_server import LocalMlflow

    with LocalMlflow(tmp_path_factory.mktemp("mlflow"), free_port()) as s:
        yield s


@pytest.mark.faults
def test_live_check_promotes_a_better_drafter_and_rolls_back_a_random_one(stream_cfg, tiny_dirs, tmp_path, mlflow_server):
    """d0001 (close to the target) replaces the 1-layer drafter and is promoted (alias production); d0002 (random
    weights) is rolled back, tagged rejected in the registry, announced as rejected and never installed again."""
    from mlflow import MlflowClient

    from dvi.tracking import Tracker

    store_root = tmp_path / "store"
    tracking = TrackingConfig(uri=mlflow_server.uri, experiment=f"serve-{tmp_path.name}", registry_model=f"m-{tmp_path.name}", retry_s=0.2)

    def publish(version: str, noise: float, seed: int) -> store.Published:  # what the trainer does: store, registry
        p = publish_noisy(store_root, tiny_dirs[0], version, noise=noise, seed=seed)
        with Tracker(tracking, "trainer") as trainer_side:
            trainer_side.register_drafter(str(p.path), p.version, {"parent_version": "test"})
        return p

    good = publish("d0001", noise=0.02, seed=1)
    cfg = service_config(stream_cfg, tiny_dirs, store_root,
                         swap=SwapConfig(store=str(store_root), initial="none", window_tokens=60, baseline_tokens=30, rollback_margin=0.1))
    cfg = DviConfig(model=cfg.model, stream=cfg.stream, serve=cfg.serve, tracking=tracking)
    service = replica(cfg, tracker=Tracker(tracking, "serve-test", tags={"dvi.role": "serve"}))
    r = Running(service)
    initial = service.engine.drafter.version

    def traffic_until(done, i0: int) -> None:
        deadline, i = time.monotonic() + 90, i0
        while not done():
            assert time.monotonic() < deadline, service.metrics.events
            assert r.post("/v1/completions", {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "dvi": {"domain": "a"}}).status_code == 200
            i += 1

    try:
        traffic_until(lambda: service.metrics.acceptance_of(initial)[0] >= 30, 0)  # the baseline
        announce(stream_cfg, good)
        traffic_until(lambda: service.metrics.events["promote"] == 1, 4)
        assert service.engine.drafter.version == "d0001"
        bad = publish("d0002", noise=10.0, seed=2)  # unrelated weights, published after d0001 (as a trainer publishes)
        announce(stream_cfg, bad)
        traffic_until(lambda: service.metrics.events["rollback"] == 1, 8)
        assert service.engine.drafter.version == "d0001" and "d0002" in service.rejected
        rates = {v: s.acceptance_rate for v, s in service.metrics.by_version.items()}
        assert rates["d0002"] < rates["d0001"] - 0.1 and rates["d0001"] > rates[initial], rates
        with ControlReader(stream_cfg, from_beginning=True) as reader:
            msgs, deadline = [], time.monotonic() + 10
            while not any(isinstance(m, DrafterRejected) for m in msgs) and time.monotonic() < deadline:
                msgs += reader.poll(0.5)
        rejected = [m for m in msgs if isinstance(m, DrafterRejected)]
        assert rejected and rejected[0].version == "d0002" and rejected[0].previous == "d0001"
        announce(stream_cfg, bad)  # announced again: never re-installed
        time.sleep(1.5)
        assert service.engine.drafter.version == "d0001" and service.metrics.events["swap"] == 2
        service._log_interval()
        plotted = service.plot()
    finally:
        r.close()  # closes the tracker: queued MLflow operations are done first
    assert not plotted.parent.exists()  # logged, then removed with its temporary folder

    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    numbers = {mv.tags["dvi.version"]: mv.version for mv in client.search_model_versions(f"name='{tracking.registry_model}'")}
    assert client.get_model_version_by_alias(tracking.registry_model, "production").version == str(numbers["d0001"])
    tags = client.get_model_version(tracking.registry_model, str(numbers["d0002"])).tags
    assert tags.get("dvi.rejected") == "true" and "live acceptance" in tags.get("dvi.rejected_reason", "")
    run = client.get_run(service.tracker.stats().run_id)
    assert "interval/acceptance_rate" in run.data.metrics and "version/d0001/acceptance_rate" in run.data.metrics
    assert "interval/acceptance.a" in run.data.metrics
    assert [f.path for f in client.list_artifacts(run.info.run_id, "plots")] == ["plots/drift.png"]


def test_http_errors_are_clear_4xx_and_streaming_matches_the_plain_answer(running):
    cases = [
        (b"{not json", 400, "malformed JSON"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "hi", "model": "gpt-7"}, 404, "not found"),
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "n": 99}, 400, "n must be"),
        ({"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
        ({"prompt": [1] * 600}, 400, "context window"),
        ({"prompt": [49152]}, 400, "token ids"),
        ([1, 2], 400, "JSON object"),
    ]
    for body, status, words in cases:
        r = running.post("/v1/completions", body)
        assert r.status_code == status, (body, r.status_code, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)
    r = running.post("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]

    plain = running.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 20}).json()
    with requests.post(running.url + "/v1/chat/completions", stream=True, timeout=60,
                       data=json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 20, "stream": True})) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == plain["choices"][0]["message"]["content"] and len(chunks) > 2
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert chunks[-1]["dvi"]["drafter_versions"] == [running.service.engine.drafter.version] and chunks[-1]["usage"]["completion_tokens"] == 20

    health = requests.get(running.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["drafter_version"] == running.service.engine.drafter.version
    metrics = scrape(running.url)
    names = {key[0] for key in metrics}
    for name in ("dvi_acceptance_rate", "dvi_mean_accepted_length", "dvi_position_acceptance", "dvi_tokens_per_second",
                 "dvi_records_dropped_total", "dvi_spec_decode_num_drafts_total", "dvi_time_to_first_token_seconds_bucket",
                 "dvi_inter_token_latency_seconds_bucket", "dvi_e2e_request_latency_seconds_count", "process_cpu_seconds_total",
                 "dvi_prompt_tokens_total", "dvi_num_requests_running", "dvi_num_requests_waiting"):
        assert name in names, name
    assert metrics[("dvi_errors_total", ("model_name", "target"), ("status", "400"))] >= len(cases)


def test_the_api_key_is_required_on_v1_when_set(stream_cfg, tiny_dirs, tmp_path):
    cfg = service_config(stream_cfg, tiny_dirs, tmp_path / "store", api_key="s3cret-key")
    r = Running(replica(cfg))
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert r.post("/v1/completions", body).status_code == 401
        assert r.post("/v1/completions", body, headers={"Authorization": "Bearer wrong-key!"}).status_code == 401
        assert r.post("/v1/completions", body, headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
        assert requests.get(r.url + "/health", timeout=10).status_code == 200
    finally:
        r.close()


@pytest.mark.faults
def test_hostile_http_requests_get_a_clear_4xx_and_cost_nothing(stream_cfg, tiny_dirs, tmp_path):
    """Bodies json cannot parse (deep nesting) are 400s, not 500s; a non-JSON content type is a 415; a web page
    of another site (its Origin) is a 403, a listed one is served; with a key, only /health answers without it,
    and says nothing about the host; one client gets at most serve.max_inflight_per_client requests in flight."""
    cfg = service_config(stream_cfg, tiny_dirs, tmp_path / "store", api_key="s3cret-key", max_inflight_per_client=1,
                         allowed_origins=("https://app.example.com",))
    r = Running(replica(cfg))
    key = {"Authorization": "Bearer s3cret-key"}
    try:
        nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        assert r.post("/v1/completions", nested, headers=key).status_code == 400
        form = r.post("/v1/completions", b"prompt=hi", headers={**key, "Content-Type": "application/x-www-form-urlencoded"})
        assert form.status_code == 415 and "application/json" in form.json()["error"]["message"]
        plain = r.post("/v1/completions", json.dumps({"prompt": "hi"}), headers={**key, "Content-Type": "text/plain"})
        assert plain.status_code == 415
        body = {"prompt": "hi", "max_tokens": 2}
        evil = r.post("/v1/completions", body, headers={**key, "Origin": "https://evil.example"})
        assert evil.status_code == 403 and "serve.allowed_origins" in evil.json()["error"]["message"]
        assert r.post("/v1/completions", body, headers={**key, "Origin": "https://app.example.com"}).status_code == 200
        assert r.post("/v1/completions", body, headers={**key, "Content-Type": "application/json; charset=utf-8"}).status_code == 200
        for tag in ("bad!", "a/b", "x" * 65, ""):  # a domain tag names metrics: plain names only
            assert r.post("/v1/completions", {**body, "dvi": {"domain": tag}}, headers=key).status_code == 400, tag
        for path in ("/metrics", "/openapi.json", "/v1/models"):
            assert requests.get(r.url + path, timeout=10).status_code == 401, path
            assert requests.get(r.url + path, headers=key, timeout=10).status_code == 200, path
        assert requests.get(r.url + "/health", timeout=10).json() == {"status": "ok"}
        assert "replica_id" in requests.get(r.url + "/health", headers=key, timeout=10).json()

        stream = requests.post(r.url + "/v1/completions", stream=True, timeout=120, headers=key,
                               data=json.dumps({"prompt": PROMPTS[0], "max_tokens": 400, "stream": True}))
        lines = stream.iter_lines(decode_unicode=True)
        next(line for line in lines if line.startswith("data: "))  # decoding: its slot is taken
        second = r.post("/v1/completions", body, headers=key)
        assert second.status_code == 429 and "max_inflight_per_client" in second.json()["error"]["message"]
        assert [line for line in lines if line][-1] == "data: [DONE]"
        stream.close()
        deadline = time.monotonic() + 10
        while (status := r.post("/v1/completions", body, headers=key).status_code) == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 200  # the slot came back when the first one finished
    finally:
        r.close()


@pytest.mark.faults
def test_large_prompts_never_stall_the_server_for_other_clients(stream_cfg, tiny_dirs, tmp_path, monkeypatch):
    """Four 3 MB prompts (under the 4 MiB body bound) at once: each is refused by its length in characters before it is
    tokenized (a 400 naming serve.max_prompt_tokens), and while four large requests' CPU work runs, here made to take 2 s
    each, /health and a small request answer at once: that work runs off the event loop, large bodies on threads of
    their own."""
    cfg = service_config(stream_cfg, tiny_dirs, tmp_path / "store", max_prompt_tokens=64)
    r = Running(replica(cfg))
    try:
        service = r.service
        assert service.max_prompt_tokens == 64 and service.max_prompt_chars < 64 * 100
        huge = {"prompt": "The river bends past the old mill. " * 86_000, "max_tokens": 2}  # 3 MB
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: r.post("/v1/completions", huge), range(4)))
        for a in answers:
            assert a.status_code == 400 and "characters" in a.json()["error"]["message"], a.text[:300]
            assert "serve.max_prompt_tokens" in a.json()["error"]["message"]
        assert time.perf_counter() - t0 < 5, "refusing by length must not tokenize"
        long_tokens = r.post("/v1/completions", {"prompt": list(range(100, 200)), "max_tokens": 2})
        assert long_tokens.status_code == 400 and "serve.max_prompt_tokens=64" in long_tokens.json()["error"]["message"]

        real_request = service.request

        def slow_request(c):  # a large request whose CPU work takes 2 s (it sleeps, so it costs no CPU here)
            if c.prompt == "slow":
                time.sleep(2.0)
            return real_request(c)

        monkeypatch.setattr(service, "request", slow_request)
        large = {"prompt": "slow", "max_tokens": 2, "user": "x" * 100_000}  # a body of 100 kB
        with ThreadPoolExecutor(4) as pool:
            slow = [pool.submit(r.post, "/v1/completions", large) for _ in range(4)]
            time.sleep(0.3)
            for probe in (lambda: requests.get(r.url + "/health", timeout=30),
                          lambda: r.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})):
                t = time.perf_counter()
                assert probe().status_code == 200
                assert time.perf_counter() - t < 1.0, "a request's CPU work held up the event loop"
            assert all(f.result().status_code == 200 for f in slow)
    finally:
        r.close()


def test_raw_prompts_keep_special_tokens_unless_split_special_tokens(running):
    """A raw completion prompt's special-token text is the special token (as vLLM's), unless split_special_tokens."""
    text = "<|im_start|>user hi"
    kept = running.post("/v1/completions", {"prompt": text, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    split = running.post("/v1/completions", {"prompt": text, "max_tokens": 1, "split_special_tokens": True}).json()
    assert split["usage"]["prompt_tokens"] > kept
    tokenizer = running.service.tokenizer
    assert kept == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert running.post("/v1/completions", {"prompt": text, "split_special_tokens": "yes"}).status_code == 400


@pytest.mark.real_model
def test_dvi_serve_answers_logs_decisions_and_stops_on_sigterm(stream_cfg, demo_target_dir, demo_drafter_dir, tmp_path):
    """`dvi serve` on its defaults and the real demo pair (where vLLM is installed, as in CI: vLLM's own server, compiled,
    dvi's loop as its plugin; the first compile takes minutes): the API key in serve.api_key_file guards the API, a chat
    completion over HTTP, its DecisionRecord on the topic with the domain the request named, SIGTERM."""
    from dvi.hardware import pick_engine

    from streams.consumer import DecisionConsumer

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                                                          "DVI_API_KEY", "VLLM_API_KEY")}
    key_file = tmp_path / "api-key"
    key_file.write_text("a-key-only-this-test-knows\n")
    key_file.chmod(0o600)
    cmd = [sys.executable, "-m", "dvi.cli", "serve", f"serve.port={port}", "tracking.enabled=false", f"serve.api_key_file={key_file}",
           f"stream.bootstrap_servers={stream_cfg.bootstrap}", f"stream.topic={stream_cfg.topic}",
           f"stream.dlq_topic={stream_cfg.dlq_topic}", f"stream.control_topic={stream_cfg.control_topic}",
           f"serve.swap.store={tmp_path / 'store'}", "stream.replica_id=replica-a"]
    # its own process group: a failing check kills vLLM's engine processes under it too, not dvi serve alone
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    vllm_server = pick_engine("auto").value == "vllm-server"
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 900
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "dvi serve did not come up"
            time.sleep(0.5)
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 16}
        # the domain tag: vllm_xargs on vLLM's API, the dvi field on dvi's
        body.update({"vllm_xargs": {"dvi_domain": "math"}} if vllm_server else {"dvi": {"domain": "math"}})
        view = requests.get(url + ("/dvi/health" if vllm_server else "/health"), timeout=10).json()
        assert view["engine"] == ("vllm" if vllm_server else "dvi") and view["drafter_version"] == shipped_version()  # the default
        assert requests.post(url + "/v1/chat/completions", json=body, timeout=120).status_code == 401  # no key
        r = requests.post(url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer a-key-only-this-test-knows"})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["choices"][0]["message"]["content"].strip()
        with DecisionConsumer(stream_cfg, group_id=f"check-{tmp_path.name}", from_beginning=True) as consumer:
            got, deadline = [], time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                got += [d.record for d in consumer.poll(timeout_s=1.0)]
        request_id = answer["id"] if vllm_server else answer["dvi"]["request_id"]
        assert got and got[0].request_id.startswith(request_id) and got[0].domain == "math"
        assert got[0].replica_id == "replica-a" and got[0].drafter_version == shipped_version()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stdout.read()[-3000:]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left (nothing, after a clean stop)
        except ProcessLookupError:
            pass
        proc.wait()


def test_a_request_submitted_while_a_long_one_decodes_finishes_first(tiny_dirs, tmp_path):
    """Continuous batching in the real Replica (no broker, no channels): the short request joins the running batch
    at the next round boundary and is answered while the long one is still decoding; both stay exact."""
    from dvi.config import StreamConfig
    from dvi.engine_api import Request

    # fp32: exact against the fp32 reference below (model.dtype auto is bf16 on a CPU with native bf16)
    cfg = DviConfig(model=ModelConfig(target=str(tiny_dirs[0]), drafter=str(tiny_dirs[1]), dtype="float32"), stream=StreamConfig(),
                    serve=ServeConfig(engine="dvi", spec=SpecConfig(k=3, adaptive=False), swap=SwapConfig(enabled=False, initial="none"),
                                      max_batch=4, metrics_every_s=3600, plot_every_s=3600), tracking=TrackingConfig(enabled=False))
    service = Replica(cfg, resolve_pair(cfg.model)).start()
    try:
        started = threading.Event()
        long_job = service.submit(Request(PROMPTS[0], max_new_tokens=400), on_tokens=lambda ids, _: started.set())
        assert started.wait(60), "the long request never started decoding"
        short_job = service.submit(Request(PROMPTS[1], max_new_tokens=8))
        short = short_job.future.result(timeout=60)
        assert not long_job.future.done()  # answered while the long one was still decoding
        long = long_job.future.result(timeout=120)
    finally:
        service.close()
    from dvi.engine import SpeculativeEngine

    plain = SpeculativeEngine(load_causal_lm(tiny_dirs[0], "target"), None, SpecConfig())
    assert short.token_ids == plain.generate([Request(PROMPTS[1], max_new_tokens=8)])[0].token_ids
    assert long.token_ids == plain.generate([Request(PROMPTS[0], max_new_tokens=400)])[0].token_ids
    assert len(long.token_ids) == 400 or long.finish_reason == "stop"
