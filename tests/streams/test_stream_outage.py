"""Broker unreachable at start, then killed and restarted while a producer is sending: submit() never blocks,
drops are counted, and sending resumes by itself (recreating the Kafka client the restart left broken)."""

from __future__ import annotations

import time

import pytest

import streams.producer
from dvi.config import SpecConfig
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.procs import free_port
from dvi.records import records_from_result
from streams.broker import EmbeddedBroker
from streams.consumer import DecisionConsumer, lost_logs
from streams.producer import DecisionProducer
from streams.topics import ensure_topics

pytestmark = pytest.mark.broker

SLOW_SUBMIT_S = 0.25  # far below what a blocking call would take (1 s metadata wait, 2 s bootstrap, 3 s delivery)


def wait_until(cond, timeout_s: float, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step_s)
    return cond()


def test_producer_survives_outages(stream_config, tiny_target, tiny_drafter, one_thread):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, SpecConfig(k=4, adaptive=False, topk_logprobs=8))
    port = free_port()
    cfg = stream_config(f"127.0.0.1:{port}", queue_size=8)
    submit_s: list[float] = []
    phase_stats = {}

    producer = DecisionProducer(cfg)

    def serve(seconds: float) -> None:
        """The serving loop: decode, then log every finished request."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            req = Request([1, 2, 3], max_new_tokens=12, temperature=0.9)
            for result in engine.generate([req]):
                for rec in records_from_result(result, replica_id="r", target_name="tiny", vocab_size=97, sampling=req, chunk_rounds=4):
                    t0 = time.perf_counter()
                    producer.submit(rec)
                    submit_s.append(time.perf_counter() - t0)

    try:
        serve(1.5)  # no broker yet
        phase_stats["unreachable"] = producer.stats
        assert phase_stats["unreachable"].sent == 0 and phase_stats["unreachable"].dropped > 0

        broker = EmbeddedBroker(port).start()
        ensure_topics(cfg)
        serve(0.2)
        assert wait_until(lambda: producer.stats.sent > 0, 15), producer.stats
        serve(0.5)
        before_kill = producer.stats

        broker.kill()
        serve(2.0)
        phase_stats["down"] = producer.stats
        assert phase_stats["down"].dropped > before_kill.dropped

        broker = EmbeddedBroker(port).start()  # a memory broker: topics and records are gone
        ensure_topics(cfg)
        sent_at_restart = producer.stats.sent
        deadline = time.monotonic() + 20
        while producer.stats.sent <= sent_at_restart and time.monotonic() < deadline:
            serve(0.2)
        assert producer.stats.sent > sent_at_restart, producer.stats
        serve(0.3)
        final = producer.close(timeout_s=10)
    finally:
        producer.close(timeout_s=0)

    try:
        assert final.pending == 0 and final.sent + final.dropped == final.submitted == len(submit_s)
        assert final.recreated == 0, final  # a restart does not break the client (it is not idempotent)
        assert max(submit_s) < SLOW_SUBMIT_S, f"slowest submit {max(submit_s):.3f} s"
        with DecisionConsumer(cfg, group_id=None) as consumer:  # what was sent after the restart is on the topic
            got = consumer.poll_until(1, timeout_s=10)
        assert got and all(d.record.replica_id == "r" for d in got)
    finally:
        broker.stop()


class _SilentClient:
    """A Kafka client that accepts records and never reports an outcome (a stuck client)."""

    instances = 0

    def __init__(self, **_):
        type(self).instances += 1

    def send(self, *_, **__):
        from kafka.producer.future import FutureProduceResult, FutureRecordMetadata

        return FutureRecordMetadata(FutureProduceResult(None), 0, 0, 0, 0, 0, 0)

    def close(self, timeout=None):
        pass


def test_a_client_that_never_answers_is_recreated_and_its_records_counted(broker, stream_config, make_record, monkeypatch):
    monkeypatch.setattr(streams.producer, "KafkaProducer", _SilentClient)
    cfg = stream_config(broker.bootstrap, delivery_timeout_ms=1000)  # a broker that accepts connections
    producer = DecisionProducer(cfg)
    try:
        for i in range(5):
            producer.submit(make_record(f"r{i}", rounds=1))
        assert wait_until(lambda: producer.stats.recreated >= 1, 10), producer.stats
        stats = producer.stats
        assert (stats.sent, stats.dropped, stats.pending) == (0, 5, 0), stats  # the stuck records are counted, once
        assert stats.errors == 5
    finally:
        producer.close(timeout_s=0)


class _ContendedClient(streams.producer.KafkaProducer):
    """The real client, whose next `failures` sends the broker answers `UnknownError` (as the durable broker answers
    the second of two writers of one partition's next batch, keeping the first's)."""

    failures = 0

    def send(self, *args, **kwargs):
        if type(self).failures <= 0:
            return super().send(*args, **kwargs)
        type(self).failures -= 1
        from kafka.errors import UnknownError
        from kafka.future import Future

        failed = Future()
        failed.failure(UnknownError())
        return failed


@pytest.mark.parametrize("failures, sent, dropped", [(2, 3, 0), (100, 0, 3)])
def test_an_unknown_broker_error_is_sent_again_twice_then_dropped(stream_cfg, make_record, monkeypatch, failures, sent, dropped):
    monkeypatch.setattr(streams.producer, "KafkaProducer", _ContendedClient)
    monkeypatch.setattr(_ContendedClient, "failures", failures)
    records = [make_record(f"u{i}", rounds=1) for i in range(3)]
    with DecisionProducer(stream_cfg) as producer:
        for record in records:
            producer.submit(record)
        assert producer.flush(20)
        stats = producer.stats
    assert (stats.sent, stats.dropped, stats.pending) == (sent, dropped, 0), stats
    assert stats.errors == min(failures, 3 * (1 + streams.producer._RETRIES))  # every failed send is seen
    with DecisionConsumer(stream_cfg, group_id=None) as consumer:
        got = consumer.poll_until(sent, timeout_s=10) if sent else []
    assert sorted(d.record.record_id for d in got) == sorted(r.record_id for r in records[:sent])  # each once


def test_close_with_no_broker_drops_and_returns(stream_config, make_record):
    cfg = stream_config(f"127.0.0.1:{free_port()}")
    producer = DecisionProducer(cfg)
    for i in range(5):
        assert producer.submit(make_record(f"r{i}", rounds=1))
    t0 = time.monotonic()
    stats = producer.close(timeout_s=0.5)
    assert time.monotonic() - t0 < 8
    assert (stats.submitted, stats.sent, stats.dropped, stats.pending) == (5, 0, 5, 0)
    assert not producer.submit(make_record("late", rounds=1)) and producer.stats.dropped == 6


def test_queue_overflow_drops_and_counts(stream_cfg, make_record):
    import dataclasses

    cfg = dataclasses.replace(stream_cfg, queue_size=3)
    record = make_record("same", rounds=1)
    producer = DecisionProducer(cfg)
    accepted = [producer.submit(record) for _ in range(200)]
    stats = producer.close(timeout_s=10)
    assert not all(accepted) and stats.dropped >= accepted.count(False)
    assert stats.sent + stats.dropped == 200 and stats.sent >= accepted.count(True) - stats.errors


def test_invalid_and_oversized_records_are_dropped_not_sent(stream_cfg, make_record):
    import dataclasses

    cfg = dataclasses.replace(stream_cfg, max_record_bytes=4096)
    bad = make_record("bad", rounds=2)
    bad.rounds[0].accepted = 99
    with DecisionProducer(cfg) as producer:
        producer.submit(bad)
        producer.submit(make_record("big", rounds=100))
        producer.submit(make_record("ok", rounds=1))
        assert producer.flush(10)
        stats = producer.stats
    assert (stats.sent, stats.dropped, stats.errors) == (1, 2, 2)


def test_a_log_is_lost_where_it_ends_before_what_was_read():
    ends = {"a": 0, "b": 40, "c": None, "d": 5, "e": 0}
    read = {"a": 11, "b": 12, "d": 5, "e": 0}  # c: no fetch answered yet; e: nothing read
    assert lost_logs(ends, read) == ["a"]
    assert lost_logs({"a": 3}, {}) == [] and lost_logs({}, {"a": 3}) == []


@pytest.mark.parametrize("wait_s", [0, 3], ids=["position", "rejoined"])
def test_a_group_consumer_reads_the_new_log_after_a_memory_broker_restart(stream_config, make_record, wait_s):
    """A memory broker forgets its logs: offsets start again at 0. Without noticing, the consumer would wait at its
    old position and skip every new record below it. Polled at once, the consumer still holds its old position; polled
    a few heartbeats later, the new broker has refused its membership and the rejoin started it at the new log's start
    (the group's commits are gone too), where only the records it delivered show the loss."""
    port = free_port()
    broker = EmbeddedBroker(port).start()
    cfg = stream_config(broker.bootstrap)
    ensure_topics(cfg)
    try:
        with DecisionProducer(cfg) as producer, DecisionConsumer(cfg, group_id="g") as consumer:
            for i in range(30):
                producer.submit(make_record(f"old{i}", rounds=1, seed=i))
            assert producer.flush(10)
            assert len(consumer.poll_until(30, timeout_s=30)) == 30
            consumer.commit()

            broker.kill()
            consumer.poll(timeout_s=1.0)  # the broker is down: nothing, no exception
            broker = EmbeddedBroker(port).start()
            ensure_topics(cfg)
            time.sleep(wait_s)
            deadline = time.monotonic() + 30
            while consumer.stats.log_resets < cfg.partitions and time.monotonic() < deadline:
                assert consumer.poll(timeout_s=0.5) == []
            assert sorted(p for _, p in consumer.take_resets()) == list(range(cfg.partitions)), consumer.stats
            new = {f"new{i}" for i in range(12)}
            while producer.stats.sent < 30 + len(new) and time.monotonic() < deadline + 30:
                for rid in sorted(new):  # the first ones may go down with the client the restart broke
                    producer.submit(make_record(rid, rounds=1))
                producer.flush(5)
            got, deadline = set(), time.monotonic() + 30
            while got != new and time.monotonic() < deadline:
                got |= {d.record.request_id for d in consumer.poll(timeout_s=0.5)}
            assert got == new, (got, producer.stats)
            assert consumer.take_resets() == []
    finally:
        broker.stop()
