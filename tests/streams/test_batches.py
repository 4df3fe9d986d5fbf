"""Compressed record batches are read within a bound: a decompression bomb or an unreadable codec is skipped,
noted in the dead-letter topic and never stops the consumer (streams.batches, streams.consumer)."""

from __future__ import annotations

import gzip
import struct
import tracemalloc

import kafka.codec
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from kafka.record.memory_records import MemoryRecords
from kafka.record.util import calc_crc32c

from dvi.record_codec import encode
from streams.batches import BatchRefused, guard, inflate_gzip, skip_past, use_gzip_fast
from streams.consumer import DLQ_HEADERS, DecisionConsumer


def test_gzip_inflates_within_its_bound_and_no_further():
    data = b"decision records " * 1000
    assert inflate_gzip(gzip.compress(data), len(data)) == data
    assert inflate_gzip(gzip.compress(data[:100]) + gzip.compress(data[100:]), len(data)) == data  # two members
    bomb = gzip.compress(b"\0" * (256 << 20), 9)
    assert len(bomb) < 300 << 10
    tracemalloc.start()
    with pytest.raises(BatchRefused, match="inflates past 1048576 bytes"):
        inflate_gzip(bomb, 1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak  # about the bound, not the 256 MiB the data holds
    for bad, words in ((gzip.compress(data)[:-20], "ends early"), (b"\x1f\x8b" + bytes(30), "corrupt")):
        with pytest.raises(BatchRefused, match=words):
            inflate_gzip(bad, 1 << 20)


def batch_bytes(codec: int, base_offset: int = 40, n: int = 3) -> bytes:
    """A real kafka-python v2 record batch of `n` records at `base_offset`, compressed with gzip, then marked as `codec`
    (the attributes' codec bits, CRC recomputed) if that is not gzip."""
    b = DefaultRecordBatchBuilder(magic=2, compression_type=DefaultRecordBatch.CODEC_GZIP, is_transactional=False,
                                  producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for i in range(n):
        b.append(i, timestamp=0, key=b"k", value=b"v" * 200, headers=[])
    buf = b.build()
    struct.pack_into(">q", buf, 0, base_offset)
    if codec != DefaultRecordBatch.CODEC_GZIP:
        at = DefaultRecordBatch.ATTRIBUTES_OFFSET
        (attributes,) = struct.unpack_from(">h", buf, at)
        struct.pack_into(">h", buf, at, (attributes & ~DefaultRecordBatch.CODEC_MASK) | codec)
        struct.pack_into(">I", buf, DefaultRecordBatch.CRC_OFFSET, calc_crc32c(memoryview(buf)[at:]))
    return bytes(buf)


def test_a_batch_over_the_bound_or_in_a_codec_this_host_lacks_is_refused_with_its_offsets():
    guard(16 << 20)
    ok = MemoryRecords(batch_bytes(DefaultRecordBatch.CODEC_GZIP)).next_batch()
    assert [r.offset for r in ok] == [40, 41, 42]
    lacking = [c for c, has in ((DefaultRecordBatch.CODEC_SNAPPY, kafka.codec.has_snappy),
                                (DefaultRecordBatch.CODEC_LZ4, kafka.codec.has_lz4),
                                (DefaultRecordBatch.CODEC_ZSTD, kafka.codec.has_zstd)) if not has()]
    unreadable = MemoryRecords(batch_bytes((lacking or [5])[0])).next_batch()  # 5: no codec has that id
    with pytest.raises(BatchRefused, match="only gzip and uncompressed batches are read") as e:
        list(unreadable)
    assert (e.value.first, e.value.next) == (40, 43)


def test_a_producers_batches_are_gzipped_at_the_fastest_level_and_read_back_within_the_bound():
    """dvi's producers have kafka-python gzip a batch at gzip's fastest level (`streams.batches.GZIP_LEVEL`; its own
    is 9, 2.7x as slow on records with features), which the bounded reader inflates like any other."""
    use_gzip_fast()
    guard(16 << 20)
    buf = batch_bytes(DefaultRecordBatch.CODEC_GZIP)
    payload = buf[DefaultRecordBatchBuilder.HEADER_STRUCT.size:]
    assert payload[:2] == b"\x1f\x8b" and payload[8] == 4  # gzip's header: XFL 4 says the fastest level (9 writes 2)
    assert [r.value for r in MemoryRecords(buf).next_batch()] == [b"v" * 200] * 3


class Position:
    """The three calls `skip_past` makes of a KafkaConsumer, over one partition (a stand-in for pure logic)."""

    def __init__(self, position: int, highwater: int | None):
        self.at, self.end = position, highwater

    def position(self, tp):
        return self.at

    def highwater(self, tp):
        return self.end

    def seek(self, tp, offset):
        self.at = offset


def test_skipping_trusts_a_batch_header_only_to_move_forward_and_not_past_the_end():
    """A hostile header can claim any end (its CRC is the writer's own): the consumer always moves forward, and never
    past the partition's end; without a claim it moves one offset."""
    cases = [  # (position, highwater, claimed first, claimed next) -> (first skipped, next read)
        ((40, 100, 40, 43), (40, 43)),  # an honest header
        ((41, 100, 40, 43), (40, 43)),  # records before the position were already returned
        ((40, 100, 40, 40), (40, 41)),  # last_offset_delta = -1: would seek to the same batch forever
        ((40, 100, 40, 12), (40, 41)),  # a negative delta: would re-deliver records
        ((40, 100, 40, 10**12), (40, 100)),  # far past the end: would look like a lost log
        ((40, None, 40, 43), (40, 43)),  # no high-water mark known yet
        ((40, 100, None, None), (40, 41)),  # an old-format batch or a failed CRC: one offset
        ((40, 100, 90, 95), (40, 95)),  # a first offset past the position is not believed
    ]
    for (position, end, first, nxt), expected in cases:
        e = BatchRefused("test", first, nxt)
        e.topic, e.partition = "t", 0
        consumer = Position(position, end)
        _, skipped, after = skip_past(consumer, e)
        assert (skipped, after) == expected == (skipped, consumer.at), (position, end, first, nxt)


@pytest.mark.broker
@pytest.mark.faults
def test_a_decompression_bomb_on_the_topic_is_skipped_noted_and_costs_about_its_bound(broker, stream_config, make_record):
    """A 64 MiB value of zeros gzip-batched into about 64 KiB, between two valid records: the group consumer reads
    both records, skips the batch (seeks past it, counts it, commits past it), dead-letters a note naming where it
    was, and inflates at most about its 16 MiB bound doing so (kafka-python alone would inflate all 64 MiB)."""
    cfg = stream_config(broker.bootstrap, partitions=1)
    from streams.topics import ensure_topics

    ensure_topics(cfg)
    raw = KafkaProducer(bootstrap_servers=broker.bootstrap, compression_type="gzip", max_request_size=1 << 28,
                        batch_size=1 << 20, linger_ms=0)
    raw.send(cfg.topic, key=b"before", value=encode(make_record("before", rounds=1)), partition=0).get(timeout=10)
    raw.send(cfg.topic, key=b"bomb", value=b"\0" * (64 << 20), partition=0).get(timeout=60)
    raw.send(cfg.topic, key=b"after", value=encode(make_record("after", rounds=1)), partition=0).get(timeout=10)
    raw.close()

    tracemalloc.start()
    with DecisionConsumer(cfg, group_id="bomb-test") as c:
        got = c.poll_until(2, timeout_s=20)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert [d.record.request_id for d in got] == ["before", "after"]
        assert (c.stats.batches_refused, c.stats.invalid) == (1, 0)
        c.commit()
        assert c.committed() == {TopicPartition(cfg.topic, 0): 3}
    print(f"\nbomb batch skipped; peak traced memory {peak / 2**20:.1f} MiB")
    assert peak < 48 << 20, peak

    dlq = KafkaConsumer(bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=5000)
    dlq.assign([TopicPartition(cfg.dlq_topic, 0)])
    letters = list(dlq)
    dlq.close()
    assert len(letters) == 1 and letters[0].value == b""
    headers = {k: v.decode() for k, v in letters[0].headers}
    assert set(DLQ_HEADERS) <= set(headers)
    assert (headers["dvi.origin.topic"], headers["dvi.origin.partition"], headers["dvi.origin.offset"]) == (cfg.topic, "0", "1")
    assert headers["dvi.origin.next_offset"] == "2" and headers["dvi.error.class"] == "BatchRefused"
    assert "inflates past" in headers["dvi.error.message"]
