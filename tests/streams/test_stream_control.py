"""The control topic over the real broker: typed messages in order, bad bytes skipped and counted, and a replica's
channel that waits for a broker that is not there yet without raising."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaProducer

from dvi.control import DrafterPublished, RetrainRequested
from dvi.procs import free_port
from streams.broker import EmbeddedBroker
from streams.control import ControlChannel, ControlReader, send
from streams.topics import ensure_topics

pytestmark = pytest.mark.broker


def test_messages_arrive_typed_and_in_order_and_bad_bytes_are_skipped(stream_cfg):
    ensure_topics(stream_cfg)
    with ControlReader(stream_cfg) as reader:
        send(stream_cfg, RetrainRequested("first"))
        raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
        raw.send(stream_cfg.control_topic, b"[" * 5000).get(timeout=10)
        raw.close()
        send(stream_cfg, DrafterPublished("d0001", "/store/d0001", "ab" * 32))
        got, deadline = [], time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            got += reader.poll(0.5)
        assert [type(m) for m in got] == [RetrainRequested, DrafterPublished]
        assert got[0].reason == "first" and got[1].version == "d0001"
        assert reader.invalid == 1


def test_a_replica_channel_waits_for_the_broker_then_reads(stream_config):
    port = free_port()
    cfg = stream_config(f"127.0.0.1:{port}")
    channel = ControlChannel(cfg, client_id="test-channel", retry_s=0.5)
    try:
        t0 = time.monotonic()
        assert channel.poll(0.2) == [] and channel.poll(0.2) == []  # no broker: nothing, no exception
        assert time.monotonic() - t0 < 30
        with EmbeddedBroker(port):
            deadline = time.monotonic() + 30
            while not channel.connected:  # connects on a later poll
                assert time.monotonic() < deadline, "the channel never connected"
                channel.poll(0.2)
            channel.send(RetrainRequested("after the outage"))
            got = []
            while not got and time.monotonic() < deadline:
                got = channel.poll(0.5)
            assert got == [RetrainRequested("after the outage", time=got[0].time)]
    finally:
        channel.close()
