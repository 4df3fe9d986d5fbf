"""Bad records on the topic: each lands in the dead-letter topic with its origin and error, and is counted;
the consumer keeps going and delivers the good records around them."""

from __future__ import annotations

import dataclasses

import pytest
from broker_fixtures import dead_letters, newer_writer, poison
from kafka import KafkaProducer, TopicPartition

from dvi.record_codec import encode
from streams.consumer import DecisionConsumer

pytestmark = pytest.mark.broker


@pytest.mark.faults
def test_bad_records_go_to_the_dead_letter_topic(broker, stream_config, make_record):
    from streams.topics import ensure_topics

    cfg = stream_config(broker.bootstrap, partitions=1, max_record_bytes=16384)
    ensure_topics(cfg)
    good = [make_record(f"good-{i}", rounds=2, seed=i) for i in range(4)]
    bad = poison(cfg.max_record_bytes)

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

    letters = dead_letters(cfg, bad, {k: (0, off) for k, off in offsets.items()})
    for m in letters:
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


def test_records_carry_schema_headers_and_a_foreign_schema_or_content_type_is_refused(stream_cfg, make_record):
    from kafka import KafkaConsumer

    from dvi import records_v1
    from dvi.record_codec import SCHEMA_MINOR
    from dvi.records import CONTENT_TYPE, READS, SCHEMA_VERSION
    from streams.producer import DecisionProducer

    with DecisionProducer(dataclasses.replace(stream_cfg, schema_id=77)) as producer:  # a registry's id for the schema
        for i in range(2):
            producer.submit(make_record(f"ok-{i}", rounds=1))
        assert producer.flush(20)
    raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
    value = encode(make_record("foreign", rounds=1))
    raw.send(stream_cfg.topic, key=b"json", value=value, partition=0, headers=[("content-type", b"application/json")])
    raw.send(stream_cfg.topic, key=b"v3", value=value, partition=0, headers=[("dvi-schema", b"3.0")])
    later = newer_writer(encode(make_record("later", rounds=1)), minor=7, novelty="x", future_arrays=b"\x00" * 16)
    raw.send(stream_cfg.topic, key=b"v2.7", value=later, partition=0, headers=[("dvi-schema", b"2.7")])
    older = records_v1.encode(make_record("older", rounds=1))
    raw.send(stream_cfg.topic, key=b"v1.0", value=older, partition=0,
             headers=[("content-type", READS[1].encode()), ("dvi-schema", b"1.0")]).get(timeout=10)
    raw.close()

    plain = KafkaConsumer(stream_cfg.topic, bootstrap_servers=stream_cfg.bootstrap, auto_offset_reset="earliest",
                          consumer_timeout_ms=5000)
    messages = {m.key: m for m in plain}
    plain.close()
    for key in (b"ok-0", b"ok-1"):
        m = messages[key]
        assert dict(m.headers) == {"content-type": CONTENT_TYPE.encode(), "dvi-schema": f"{SCHEMA_VERSION}.{SCHEMA_MINOR}".encode()}
        assert m.value[:6] == b"\x00" + (77).to_bytes(4, "big") + b"\x00"  # the registry framing, with the configured id
    with DecisionConsumer(dataclasses.replace(stream_cfg), group_id=None, dead_letter=False) as c:
        got = c.poll_until(4, timeout_s=15)
    assert sorted(d.key for d in got) == [b"ok-0", b"ok-1", b"v1.0", b"v2.7"]  # a newer minor version and schema 1 are read
    assert c.stats.invalid == 2


def test_the_dead_letter_producer_is_opened_with_the_consumer_not_at_the_first_bad_record(stream_cfg, make_record):
    import psutil

    raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
    raw.send(stream_cfg.topic, key=b"a", value=encode(make_record("a", rounds=1)), partition=0).get(timeout=10)
    with DecisionConsumer(dataclasses.replace(stream_cfg), group_id="dlq-at-start") as c:
        assert [d.key for d in c.poll_until(1, timeout_s=20)] == [b"a"]  # joined, fetching: its connections are made
        before = psutil.Process().num_fds()
        raw.send(stream_cfg.topic, key=b"junk", value=b"junk", partition=0)
        raw.send(stream_cfg.topic, key=b"b", value=encode(make_record("b", rounds=1)), partition=0).get(timeout=10)
        assert [d.key for d in c.poll_until(1, timeout_s=20)] == [b"b"]
        c.flush_dead_letters()
        after = psutil.Process().num_fds()
        assert (c.stats.invalid, c.stats.dead_lettered, c.stats.dlq_errors) == (1, 1, 0)
    raw.close()
    # a long-running consumer's descriptors do not step up at its first bad record: the producer's selector, wake-up
    # pipe and bootstrap connection were made with the consumer (4 more here when made then); one connection to the
    # partition's leader is opened by the first send
    assert after - before <= 1
