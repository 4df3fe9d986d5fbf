"""The soak's view of the decision topic: `benchmarks.soak.merge_reads` (pure) and `TopicWatch` on the real durable
broker, which keeps every record it read while a retention removes them and while the broker is killed and started
again."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks.soak import TopicWatch, merge_reads, read_to_end
from dvi.procs import free_port
from streams.broker import EmbeddedBroker, records_glob
from streams.producer import DecisionProducer
from streams.topics import ensure_topics


def test_a_watched_record_counts_as_expired_only_below_what_the_final_read_found():
    watched = [(0, 0, "a"), (0, 1, "b"), (0, 2, "c"), (1, 0, "x"), (1, 4, "y"), (2, 0, "z")]
    final = [(0, 2, "c"), (0, 3, "d"), (1, 5, "w")]
    # partition 0 starts at 2 and partition 1 at 5 after the retention: what lay below was expired; partition 2 has
    # no record left (all expired)
    records, vanished = merge_reads(watched, final, retained=True)
    assert records == [(0, 0, "a"), (0, 1, "b"), (0, 2, "c"), (0, 3, "d"), (1, 0, "x"), (1, 4, "y"), (1, 5, "w"), (2, 0, "z")]
    assert vanished == []
    # a watched record at or past the final read's first offset that it lacks is a loss, retention or not
    records, vanished = merge_reads(watched + [(0, 4, "e")], final + [(0, 5, "f")], retained=True)
    assert vanished == [(0, 4, "e")] and (0, 4, "e") not in records
    # with no retention nothing may go: every watched record the final read lacks vanished
    records, vanished = merge_reads(watched, final, retained=False)
    assert records == sorted(final) and vanished == [(0, 0, "a"), (0, 1, "b"), (1, 0, "x"), (1, 4, "y"), (2, 0, "z")]


@pytest.mark.broker
def test_the_watch_keeps_what_the_retention_removed_across_a_broker_kill(stream_config, make_record, tmp_path):
    port = free_port()
    cfg = stream_config(f"127.0.0.1:{port}", partitions=1, linger_ms=0)
    data = tmp_path / "data"
    broker = EmbeddedBroker(port, data_dir=data, retain=(cfg.topic, 120.0)).start()  # an expiry pass every 30 s
    watch = TopicWatch(cfg.bootstrap, cfg.topic, every_s=0.5)
    producer = DecisionProducer(cfg)
    name: dict[str, str] = {}  # record id -> the request it was made for

    def send(*ids: str) -> None:
        for i, rid in enumerate(ids):
            record = make_record(rid, rounds=1, seed=i)
            name[record.record_id] = rid
            producer.submit(record)
            assert producer.flush(15)

    def named(records) -> list[str]:
        return [name[rid] for _, _, rid in records]

    def until(ok, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok() and time.monotonic() < deadline:
            time.sleep(0.5)

    def batches() -> list:
        return sorted(data.glob(records_glob(cfg.topic)))

    try:
        ensure_topics(cfg)
        send("a", "b", "c")
        watch.start()
        until(lambda: len(watch.records()) == 3)
        assert named(watch.records()) == ["a", "b", "c"]
        hour_ago = time.time_ns() - 3600 * 10**9
        for path in batches():
            os.utime(path, ns=(hour_ago, hour_ago))
        until(lambda: len(batches()) == 1)  # the retention took a and b off the broker (c is the partition's last)
        assert [p.name for p in batches()] == [f"{2:020d}.batch"]
        broker.kill()
        time.sleep(2)  # a read meanwhile fails, or finds nothing
        broker.start()
        send("d", "e")
        until(lambda: len(watch.records()) == 5)
        assert named(watch.records()) == ["a", "b", "c", "d", "e"]
        # a read from the beginning starts at the oldest kept and reaches the last record, though this broker's listed
        # end offset lags what it holds (`benchmarks.soak.pending`)
        assert [m.offset for m in read_to_end(cfg.bootstrap, cfg.topic, 60)] == [2, 3, 4]
        watch.stop()
        assert watch.reads >= 2
    finally:
        watch.stop()
        producer.close(timeout_s=0)
        broker.stop()


@pytest.mark.broker
def test_a_read_from_the_beginning_reaches_the_last_record_of_the_durable_broker(tmp_path):
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    with EmbeddedBroker(free_port(), data_dir=tmp_path / "data") as broker:
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        admin.create_topics([NewTopic("t", 2, 1)])
        admin.close()
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
        for i in range(9):  # one batch each: this broker lists the latest offset of such a partition as 1
            producer.send("t", f"m{i}".encode(), partition=i % 2).get(timeout=30)
        producer.close()
        got = read_to_end(broker.bootstrap, "t", 60)
    assert sorted((m.partition, m.offset, m.value) for m in got) == sorted(
        (i % 2, i // 2, f"m{i}".encode()) for i in range(9))
