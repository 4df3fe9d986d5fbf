"""The control topic over the real broker: typed messages in order, bad bytes skipped and counted, and a replica's
channel that waits for a broker that is not there yet without raising."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from kafka import KafkaProducer

from dvi import keys
from dvi.control import DrafterPromoted, DrafterPublished, RetrainRequested, encode
from dvi.errors import DviError
from dvi.procs import free_port
from streams.broker import EmbeddedBroker
from streams.control import ControlChannel, ControlReader, send
from streams.topics import ensure_topics

pytestmark = pytest.mark.broker


def test_messages_arrive_typed_and_in_order_and_bad_bytes_are_skipped(stream_cfg):
    """A hostile message (5,000 nested brackets) and a gzip bomb batch (128 MiB of zeros, past the bound of any consumer
    of this process) between two real messages: both are skipped and counted, the messages after them are read, and
    the bomb costs about its bound, not its 128 MiB."""
    ensure_topics(stream_cfg)
    with ControlReader(stream_cfg) as reader:
        send(stream_cfg, RetrainRequested("first"))
        raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
        raw.send(stream_cfg.control_topic, b"[" * 5000).get(timeout=10)
        raw.close()
        bomb = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap, compression_type="gzip", max_request_size=1 << 28,
                             batch_size=1 << 20)
        bomb.send(stream_cfg.control_topic, b"\0" * (128 << 20)).get(timeout=60)
        bomb.close()
        tracemalloc.start()
        send(stream_cfg, DrafterPublished("d0001", "/store/d0001", "ab" * 32))
        got, deadline = [], time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            got += reader.poll(0.5)
        assert [type(m) for m in got] == [RetrainRequested, DrafterPublished]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert got[0].reason == "first" and got[1].version == "d0001"
        assert reader.invalid == 2
        assert peak < 64 << 20, peak


def test_only_messages_signed_by_the_role_that_may_say_them_are_read(stream_cfg, tmp_path, caplog):
    """Unsigned, signed by the wrong role, signed by another deployment's key, or sent again later: each is
    skipped with a WARNING naming topic, partition and offset, and counted; the genuine messages around them
    are read."""
    ensure_topics(stream_cfg)
    ours = keys.load(tmp_path / "ours", sign_as=("trainer", "replica"))
    theirs = keys.load(tmp_path / "theirs", sign_as=("trainer",))
    published = DrafterPublished("d0007", "/store/d0007", "ab" * 32)
    genuine = encode(published, ours)
    forged = [
        encode(published),  # unsigned
        encode(published, keys.Keys(signing={"trainer": ours.signing["replica"]})),  # a replica's key, as a trainer
        encode(published, theirs),  # another deployment's trainer key
        genuine,  # the genuine message again: a replay
    ]
    raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
    with ControlReader(stream_cfg, keys=keys.Keys(trusted=ours.trusted)) as reader:
        for data in [genuine, *forged, encode(RetrainRequested("last"), ours)]:
            raw.send(stream_cfg.control_topic, data).get(timeout=10)
        got, deadline = [], time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            got += reader.poll(0.5)
    raw.close()
    assert [type(m) for m in got] == [DrafterPublished, RetrainRequested] and got[0].version == "d0007"
    assert reader.invalid == len(forged)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "skipping control message" in r.getMessage()]
    assert len(warned) == len(forged) and all(stream_cfg.control_topic + "[0]@" in w for w in warned), warned
    assert sum("replay" in w for w in warned) == 1 and sum("does not verify" in w for w in warned) == 2


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
            channel.send(DrafterPromoted("d0001", "replica-a", acceptance=0.5))  # a replica signs its verdicts
            got = []
            while not got and time.monotonic() < deadline:
                got = channel.poll(0.5)
            assert got == [DrafterPromoted("d0001", "replica-a", acceptance=0.5, time=got[0].time)]
            with pytest.raises(DviError, match="holds no trainer key"):  # but cannot publish a drafter
                channel.send(RetrainRequested("a replica pretending to be the trainer"))
    finally:
        channel.close()
