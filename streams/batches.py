"""Compressed Kafka record batches: bounded reading, and writing at gzip's fastest level.

Records are compressed by Kafka, a batch at a time (`stream.compression`), and kafka-python inflates a fetched batch
whole before handing out any of its records: one small hostile batch (400 KiB of gzip holding 400 MiB of zeros)
costs a consumer about 1.2 GB and several seconds before `dvi.record_codec.decode` refuses the record it holds, and a
batch in a codec this host lacks (zstd, lz4, snappy) makes every later poll of its partition fail the same way,
so the consumer would never get past it.

`guard(limit)` makes kafka-python refuse such batches instead: gzip is inflated no further than `limit` bytes, and
a batch over it, in another codec (dvi's writers use gzip or none, `stream.compression`), corrupt, or failing its
CRC raises `BatchRefused` naming its partition and offsets, so the consumer can skip it (`streams.consumer`
dead-letters a note of it and seeks past) and go on. The limit is process-wide: the largest any consumer of the
process asked for.

`use_gzip_fast()` has kafka-python gzip the batches this process writes at `GZIP_LEVEL` instead of its fixed 9: records
carrying the target's features (int8) take 2.7x as long to compress at 9 as at 1, for 4% fewer bytes (0.627 of them
against 0.652), and a producer's sender thread shares serving's cores. A consumer inflates any level.

This module knows kafka-python 3.0's record-batch and fetcher internals (the version is pinned in constraints.txt;
tests/streams/test_batches.py checks the patch against it); it knows nothing about records.
"""

from __future__ import annotations

import functools
import gzip
import threading
import zlib

from kafka import TopicPartition
from kafka.consumer.fetcher import Fetcher
from kafka.errors import CorruptRecordError
from kafka.record import default_records, legacy_records

_lock = threading.Lock()
_limit = 0  # bytes a compressed batch may inflate to (the largest any guard() asked for)
_patched = False
_READ = (default_records.DefaultRecordBatch.CODEC_NONE, default_records.DefaultRecordBatch.CODEC_GZIP)
GZIP_LEVEL = 1  # what dvi's producers gzip a batch at (use_gzip_fast)


class BatchRefused(Exception):
    """A record batch the consumer will not read: `reason`, where it is (`topic`, `partition`) and the offsets its
    header claims, `first` to `next` - 1 (`next` None: not known, as for an old-format (magic 0/1) batch, whose
    `first` is its wrapper's offset, or a batch that failed its CRC; `skip_past` then moves one offset at a time)."""

    def __init__(self, reason: str, first: int | None = None, next_offset: int | None = None):
        super().__init__(reason)
        self.reason, self.first, self.next = reason, first, next_offset
        self.topic: str | None = None
        self.partition: int | None = None

    def __str__(self) -> str:
        where = f"{self.topic}[{self.partition}]" if self.topic is not None else "a partition"
        span = f" offsets {self.first}..{self.next - 1}" if self.first is not None and self.next is not None else ""
        return f"record batch of {where}{span}: {self.reason}"


def inflate_gzip(data, limit: int) -> bytes:
    """The gzip stream `data` inflated (every member), or `BatchRefused` once it passes `limit` bytes."""
    out, rest = [], bytes(data)
    size = 0
    while rest:
        z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            chunk = z.decompress(rest, limit - size + 1)
        except zlib.error as e:
            raise BatchRefused(f"corrupt gzip data ({e})") from None
        size += len(chunk)
        if size > limit:
            raise BatchRefused(f"its gzip data inflates past {limit} bytes (a decompression bomb, or batches larger "
                               "than stream.max_record_bytes and stream.batch_bytes allow)")
        if not z.eof:
            raise BatchRefused("its gzip data ends early")
        out.append(chunk)
        rest = z.unused_data
    return b"".join(out)


def _bounded_gzip_decode(payload) -> bytes:
    return inflate_gzip(payload, _limit)


def _with_offsets(uncompress):
    @functools.wraps(uncompress)
    def guarded(batch, *args):
        codec = getattr(batch, "compression_type", None)
        try:
            if codec is not None and codec not in _READ:  # stream.compression writes gzip or nothing
                raise BatchRefused(f"compression codec {codec}: only gzip and uncompressed batches are read")
            return uncompress(batch, *args)
        except BatchRefused as e:
            reason = e.reason
        except Exception as e:  # corrupt data in any codec, or a codec the batch names but this host lacks
            reason = f"it cannot be decompressed ({type(e).__name__}: {str(e)[:200]})"
        first = getattr(batch, "base_offset", None)
        nxt = getattr(batch, "next_offset", None) if isinstance(batch, default_records.DefaultRecordBatch) else None
        raise BatchRefused(reason, first, nxt) from None
    return guarded


def _with_partition(unpack):
    @functools.wraps(unpack)
    def guarded(self, tp, *args):
        try:
            yield from unpack(self, tp, *args)
        except BatchRefused as e:
            e.topic, e.partition = tp.topic, tp.partition
            raise
        except CorruptRecordError as e:  # a CRC check failed: read past it rather than fail every poll
            refused = BatchRefused(str(e)[:200])
            refused.topic, refused.partition = tp.topic, tp.partition
            raise refused from None
    return guarded


def skip_past(consumer, e: BatchRefused) -> tuple[TopicPartition, int, int]:
    """Seek a KafkaConsumer past a refused batch: returns its partition, the first offset skipped and the offset the
    consumer reads next. The batch's own claim of its end is trusted only to move forward and not past the partition's
    end (a hostile header could say anything); without one it moves a single offset."""
    tp = TopicPartition(e.topic, e.partition)
    position = consumer.position(tp)  # the first offset not yet returned: inside the refused batch
    first = e.first if e.first is not None and e.first <= position else position
    after = max(e.next if e.next is not None else 0, position + 1)
    end = consumer.highwater(tp)
    if end is not None and after > end:
        after = max(end, position + 1)
    consumer.seek(tp, after)
    return tp, first, after


def guard(limit: int) -> None:
    """Bound what kafka-python inflates per compressed batch to `limit` bytes (or more, if another consumer of this
    process asked for more); refused batches raise `BatchRefused` from `KafkaConsumer.poll`."""
    global _limit, _patched
    if limit <= 0:
        raise ValueError(f"the bound must be a positive number of bytes, got {limit}")
    with _lock:
        if not _patched:
            _require((default_records, "gzip_decode"), (legacy_records, "gzip_decode"),
                     (default_records.DefaultRecordBatch, "_maybe_uncompress"),
                     (legacy_records.LegacyRecordBatch, "_decompress"), (Fetcher.PartitionRecords, "_unpack_records"))
            default_records.gzip_decode = _bounded_gzip_decode
            legacy_records.gzip_decode = _bounded_gzip_decode
            default_records.DefaultRecordBatch._maybe_uncompress = _with_offsets(default_records.DefaultRecordBatch._maybe_uncompress)
            legacy_records.LegacyRecordBatch._decompress = _with_offsets(legacy_records.LegacyRecordBatch._decompress)
            Fetcher.PartitionRecords._unpack_records = _with_partition(Fetcher.PartitionRecords._unpack_records)
            _patched = True
        _limit = max(_limit, int(limit))


def gzip_fast(data) -> bytes:
    """`data` gzipped at `GZIP_LEVEL`: what kafka-python compresses record batches with once `use_gzip_fast` ran."""
    return gzip.compress(bytes(data), compresslevel=GZIP_LEVEL, mtime=0)


def use_gzip_fast() -> None:
    """kafka-python's gzip batch compression at `GZIP_LEVEL` in this process (it has no setting for the level)."""
    _require((default_records, "gzip_encode"), (legacy_records, "gzip_encode"))
    default_records.gzip_encode = gzip_fast
    legacy_records.gzip_encode = gzip_fast


def _require(*attributes) -> None:
    """RuntimeError unless kafka-python has every (owner, name) in `attributes`: what this module patches."""
    for owner, name in attributes:
        if not hasattr(owner, name):
            raise RuntimeError(f"kafka-python has no {owner.__name__}.{name}: streams.batches knows kafka-python 3.0 "
                               "(constraints.txt), install that version")
