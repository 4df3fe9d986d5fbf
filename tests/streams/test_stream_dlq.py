"""Bad records on the topic: each lands in the dead-letter topic with its origin and error, and is counted;
the consumer keeps going and delivers the good records around them."""

from __future__ import annotations

import dataclasses
import struct
from unittest import mock

import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from dvi.events import encode
from streams.consumer import DLQ_HEADERS, DecisionConsumer

pytestmark = pytest.mark.broker


def unchecked(record) -> bytes:
    """Encode without the producer-side validation (what a buggy or foreign producer could send)."""
    with mock.patch("dvi.events.validate"):
        return encode(record)


@pytest.mark.faults
def test_bad_records_go_to_the_dead_letter_topic(broker, stream_config, make_record):
    from streams.topics import ensure_topics

    cfg = stream_config(broker.bootstrap, partitions=1, max_record_bytes=16384)
    ensure_topics(cfg)
    good = [make_record(f"good-{i}", rounds=2, seed=i) for i in range(4)]
    valid = encode(good[0])
    out_of_range = make_record("x", rounds=2)
    out_of_range.rounds[1].drafted[0] = 49152 + 7
    nan = make_record("x", rounds=2)
    nan.rounds[0].topk_logprobs[2, 3] = np.nan
    bad = {
        b"garbage": (b"\x00\xffhello, not a record" * 3, "magic"),
        b"truncated": (valid[: len(valid) // 2], "truncated"),
        b"schema": (valid[:4] + struct.pack("<H", 9) + valid[6:], "unknown schema version 9"),
        b"oversized": (encode(make_record("big", rounds=200, prompt_len=4000)), "exceeds the bound of 16384"),
        b"out-of-range": (unchecked(out_of_range), "outside the vocabulary"),
        b"nan": (unchecked(nan), "non-finite"),
    }
    assert len(bad[b"oversized"][0]) > cfg.max_record_bytes

    raw = KafkaProducer(bootstrap_servers=broker.bootstrap)
    offsets = {}
    sequence = [("good-0", good[0])] + [(k, v) for k, (v, _) in bad.items()] + [(r.request_id, r) for r in good[1:]]
    for key, value in sequence:
        key = key.encode() if isinstance(key, str) else key
        value = encode(value) if not isinstance(value, bytes) else value
        offsets[key] = raw.send(cfg.topic, key=key, value=value).get(timeout=10).offset
    raw.close()

    with DecisionConsumer(cfg, group_id="dlq-test") as consumer:
        got = consumer.poll_until(len(good), timeout_s=20)
        consumer.commit()
        stats = consumer.stats
        assert consumer.positions() == {TopicPartition(cfg.topic, 0): len(sequence)}
    assert [d.record.request_id for d in got] == [r.request_id for r in good]  # the consumer kept going
    assert (stats.received, stats.delivered, stats.invalid, stats.dead_lettered, stats.dlq_errors) == (10, 4, 6, 6, 0)

    dlq = KafkaConsumer(bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest", enable_auto_commit=False)
    dlq.assign([TopicPartition(cfg.dlq_topic, 0)])
    letters = []
    for _ in range(40):
        for msgs in dlq.poll(timeout_ms=500).values():
            letters += msgs
        if len(letters) >= len(bad):
            break
    dlq.close()
    assert sorted(m.key for m in letters) == sorted(bad)
    for m in letters:
        headers = {k: v.decode() for k, v in m.headers}
        assert set(DLQ_HEADERS) <= set(headers)
        assert headers["dvi.origin.topic"] == cfg.topic
        assert headers["dvi.origin.partition"] == "0"
        assert headers["dvi.origin.offset"] == str(offsets[m.key])
        assert headers["dvi.error.class"] == "RecordError"
        assert bad[m.key][1] in headers["dvi.error.message"], headers
        if m.key != b"oversized":
            assert m.value == bad[m.key][0]  # the original bytes, for inspection and replay


def test_read_only_consumer_counts_but_does_not_dead_letter(stream_cfg, make_record):
    raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
    raw.send(stream_cfg.topic, key=b"a", value=b"junk", partition=0)
    raw.send(stream_cfg.topic, key=b"b", value=encode(make_record("b", rounds=1)), partition=0).get(timeout=10)
    raw.close()
    with DecisionConsumer(dataclasses.replace(stream_cfg), group_id=None, dead_letter=False) as c:
        got = c.poll_until(1, timeout_s=10)
    assert [d.key for d in got] == [b"b"]
    assert (c.stats.invalid, c.stats.dead_lettered) == (1, 0)
