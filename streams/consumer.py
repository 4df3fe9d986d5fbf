"""Reading DecisionRecords: a consumer-group helper with manual commits and a dead-letter path.

`DecisionConsumer.poll()` returns decoded, validated records (`Delivered`: the record and where it came from).
A message that fails to decode or validate never reaches the caller and never stops the consumer: it goes to
the dead-letter topic (`stream.dlq_topic`) unchanged (key and value), with headers naming its origin and the
error (`dvi.origin.topic`, `dvi.origin.partition`, `dvi.origin.offset`, `dvi.error.class`,
`dvi.error.message`), and is counted.

Offsets are committed only when the caller says so (`commit()`), e.g. once the records are inside a durable
checkpoint; the dead-letter producer is flushed first, so a committed bad record is in the dead-letter topic. That
producer is opened with the consumer, not at the first bad record: a long-running reader holds the same descriptors
from its start.
Without a group id the consumer reads all partitions of the topic directly (no group, no commits).

A partition whose log now ends before what the consumer has read has been lost and begun again (a broker that keeps
its log in memory restarted; Tansu answers such fetches with nothing rather than OFFSET_OUT_OF_RANGE). What the
consumer has read is the larger of its position and the offset after the last record poll() returned: a group
member the new broker does not know loses its generation, rejoins, and starts again at the new log's start (the
reset policy: the group's commits went with the log), so only the records it delivered show the loss. Left alone,
the consumer would skip every new record below its old position, and a reader committing its own offsets would
commit past records it never saw; it reads the new log from its start instead, logs it, counts it
(`ConsumerStats.log_resets`) and names the partition in `take_resets()` (`lost_logs`).

Compressed batches are inflated no further than a bound (`streams.batches`: 4 x the larger of stream.batch_bytes and
stream.max_record_bytes, at least 16 MiB); a batch past it, in a codec other than gzip, corrupt, or failing its CRC
is skipped: a note of it (no value; headers naming its partition, offsets and the reason) goes to the dead-letter
topic, the consumer seeks past it and counts it (`ConsumerStats.batches_refused`).
This module knows the wire format and Kafka, not what the records are used for.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from dvi.config import StreamConfig
from dvi.errors import DviError
from dvi.record_codec import Limits, check_headers, decode
from dvi.records import Delivered
from streams.batches import BatchRefused, guard, skip_past
from streams.client import client_options

log = logging.getLogger("dvi.streams.consumer")

DLQ_HEADERS = ("dvi.origin.topic", "dvi.origin.partition", "dvi.origin.offset", "dvi.error.class", "dvi.error.message")
_MAX_ERROR_CHARS = 1000


def lost_logs(ends: dict, read: dict) -> list:
    """Partitions whose log ends before what was read from it: `ends` maps a partition to its high watermark (None:
    not known yet), `read` to the offset after the last record read from it (position or delivered, the larger)."""
    return [p for p, end in ends.items() if end is not None and read.get(p, 0) > end]


@dataclass(frozen=True)
class ConsumerStats:
    received: int  # messages read from the topic
    delivered: int  # valid records returned by poll()
    invalid: int  # messages that failed to decode or validate
    dead_lettered: int  # invalid messages handed to the dead-letter topic
    dlq_errors: int  # dead-letter sends that failed (the message is logged and skipped)
    log_resets: int = 0  # partitions found to have lost their log (read again from the new log's start)
    batches_refused: int = 0  # batches skipped unread (streams.batches): past the inflation bound, another codec, corrupt

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class DecisionConsumer:
    """Consume DecisionRecords from `stream.topic` (see the module docstring). A context manager.

    `group_id`: a consumer group (partitions assigned by the group, resumes after its last commit); None reads
    every partition directly. `from_beginning`: where to start without a committed offset. `vocab_size`: the
    vocabulary the records must use (None: the one each record declares). `limits`: the teacher width and sizes a
    record may have (`dvi.record_codec.Limits`; None: any valid record); beyond them it is dead-lettered like an invalid
    one, having cost at most the largest valid record to read. `dead_letter=False` (read-only viewers such as
    `dvi stream tail`): invalid messages are logged and counted but not dead-lettered.
    """

    def __init__(
        self,
        cfg: StreamConfig,
        *,
        group_id: str | None,
        topic: str | None = None,
        dlq_topic: str | None = None,
        from_beginning: bool = True,
        vocab_size: int | None = None,
        limits: Limits | None = None,
        dead_letter: bool = True,
        client_id: str = "dvi-consumer",
    ):
        self.cfg = cfg
        self.topic = topic or cfg.topic
        self.dlq_topic = dlq_topic or cfg.dlq_topic
        self.group_id = group_id
        self.vocab_size = vocab_size
        self.limits = limits
        self.dead_letter = dead_letter
        self._received = self._delivered = self._invalid = self._dead = self._dlq_errors = 0
        self._unreachable = False  # the broker was down at the last poll
        self._resets: list = []  # partitions whose log was lost, not yet taken by take_resets()
        self._log_resets = self._refused = 0
        self._next: dict = {}  # TopicPartition -> offset after the last message returned (the commit point)
        self._dlq = None
        self._dlq_futures: list = []
        guard(max(16 << 20, 4 * max(cfg.batch_bytes, cfg.max_record_bytes)))
        try:
            self._consumer = KafkaConsumer(
                **client_options(
                    cfg,
                    KafkaConsumer,
                    group_id=group_id,
                    client_id=client_id,
                    enable_auto_commit=False,
                    auto_offset_reset="earliest" if from_beginning else "latest",
                    session_timeout_ms=cfg.session_timeout_ms,
                    heartbeat_interval_ms=max(100, cfg.session_timeout_ms // 6),
                    max_poll_interval_ms=cfg.max_poll_interval_ms,
                    max_partition_fetch_bytes=max(1 << 20, 2 * cfg.max_record_bytes),
                    fetch_max_bytes=max(50 << 20, 4 * cfg.max_record_bytes),
                    bootstrap_timeout_ms=5000,
                )
            )
        except KafkaError as e:
            raise DviError(f"cannot reach Kafka at {cfg.bootstrap} ({type(e).__name__}: {e}): start it (dvi broker) or fix stream.bootstrap_servers") from None
        if group_id is not None:
            self._consumer.subscribe([self.topic])
        else:
            partitions = self._consumer.partitions_for_topic(self.topic)
            if not partitions:
                self._consumer.close()
                raise DviError(f"topic {self.topic!r} does not exist on {cfg.bootstrap} (start the broker with `dvi broker`, which creates it)")
            tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
            self._consumer.assign(tps)
            if from_beginning:
                self._consumer.seek_to_beginning(*tps)
            else:
                self._consumer.seek_to_end(*tps)
        if dead_letter:
            try:
                self._open_dead_letters()
            except Exception as e:  # the consumer reads on; the first record to dead-letter tries again
                log.warning("cannot open the dead-letter producer for %s yet (%s: %s); will try again at the first "
                            "invalid record", self.dlq_topic, type(e).__name__, e)

    # -- reading --------------------------------------------------------------------------------

    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[Delivered]:
        """Valid records that arrived within `timeout_s` (possibly none); invalid ones are dead-lettered."""

        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except BatchRefused as e:
            self._skip(e)
            return []
        except KafkaError as e:  # the broker is down (the client raises from its coordinator lookup): nothing arrived
            if not self._unreachable:
                log.warning("the broker at %s is unreachable (%s: %s): no records until it is back; retrying",
                            self.cfg.bootstrap, type(e).__name__, e)
            self._unreachable = True
            time.sleep(min(timeout_s, 1.0))
            return []
        if self._unreachable:
            log.warning("the broker at %s is reachable again", self.cfg.bootstrap)
            self._unreachable = False
        self._check_logs(batches)
        out = []
        for tp, messages in batches.items():
            for m in messages:
                self._received += 1
                try:
                    check_headers(m.headers)
                    record = decode(m.value, self.vocab_size, max_bytes=self.cfg.max_record_bytes, limits=self.limits)
                except Exception as e:  # RecordError, or anything else a hostile payload provokes
                    self._invalid += 1
                    if self.dead_letter:
                        self._dead_letter(m, e)
                    else:
                        log.warning("invalid record at %s[%d]@%d: %s: %s", m.topic, m.partition, m.offset, type(e).__name__, e)
                else:
                    self._delivered += 1
                    out.append(Delivered(record, m.topic, m.partition, m.offset, m.key))
                self._next[TopicPartition(m.topic, m.partition)] = m.offset + 1
        return out

    def _check_logs(self, batches: dict) -> None:
        """Read a partition again from its start when its log ends before what we have read (the module docstring)."""
        ends = {tp: self._consumer.highwater(tp) for tp in self._consumer.assignment()}
        # a known end means a fetch answered, so the position is known too (asking for an unknown one would block)
        read = {tp: max(self._consumer.position(tp) or 0, self._next.get(tp, 0)) for tp, end in ends.items() if end is not None}
        for tp in lost_logs(ends, read):
            log.warning("%s[%d] ends at offset %d, before this consumer's offset %d: the broker lost the log "
                        "(a memory broker restarted?); reading the new log from its start", tp.topic, tp.partition,
                        ends[tp], read[tp])
            if tp not in batches:  # records in hand came from the new log already (a rejoin started it over)
                self._consumer.seek_to_beginning(tp)
            self._next.pop(tp, None)
            self._resets.append((tp.topic, tp.partition))
            self._log_resets += 1

    def take_resets(self) -> list[tuple[str, int]]:
        """(topic, partition) of each log found lost since the last call (their offsets start again)."""
        out, self._resets = self._resets, []
        return out

    def poll_until(self, n: int, timeout_s: float) -> list[Delivered]:
        """Poll until `n` valid records arrived or `timeout_s` passed; whatever arrived is returned."""
        deadline = time.monotonic() + timeout_s
        out: list[Delivered] = []
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            out += self.poll(min(left, 0.5), max_records=n - len(out))
        return out

    def lag(self) -> int | None:
        """Messages on the assigned partitions not yet returned by poll(), from the high-water marks of the last
        fetches (None before any fetch answered). Tansu's ListOffsets is unreliable for batches; fetches are not."""
        total, known = 0, False
        for tp in self._consumer.assignment():
            high = self._consumer.highwater(tp)
            if high is None:
                continue
            known = True
            total += max(0, high - self._consumer.position(tp))
        return total if known else None

    @property
    def assigned(self) -> bool:
        """Whether the consumer has partitions to read (a group member only after it joined)."""
        return bool(self._consumer.assignment())

    @property
    def stats(self) -> ConsumerStats:
        return ConsumerStats(self._received, self._delivered, self._invalid, self._dead, self._dlq_errors, self._log_resets,
                             self._refused)

    # -- committing -----------------------------------------------------------------------------

    def positions(self) -> dict:
        """TopicPartition -> the offset after the last message poll() has returned: what `commit()` commits."""
        return dict(self._next)

    def commit(self, offsets: dict | None = None, timeout_s: float = 10.0) -> None:
        """Commit `offsets` ((topic, partition) -> next offset; default `positions()`) for the group, synchronously;
        a KafkaError (KafkaTimeoutError after `timeout_s`) when the broker does not confirm it.

        The dead-letter producer is flushed first, so every bad record before a committed offset is in the DLQ.
        """
        if self.group_id is None:
            raise DviError("commit() needs a consumer group: pass group_id")
        self.flush_dead_letters()
        offsets = self.positions() if offsets is None else offsets
        if offsets:
            self._consumer.commit({TopicPartition(*tp): OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()},
                                  timeout_ms=int(timeout_s * 1000))

    def rewind(self) -> None:
        """Read again from the group's committed offsets (the beginning where it never committed)."""
        for tp in self._consumer.assignment():
            off = self._consumer.committed(tp)
            if off is None:
                self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, off)
            self._next.pop(tp, None)

    def committed(self) -> dict:
        """TopicPartition -> the group's committed offset (None where it never committed)."""
        return {tp: self._consumer.committed(tp) for tp in self._consumer.assignment()}

    def _skip(self, e: BatchRefused) -> None:
        """Seek past a refused batch and dead-letter a note of it."""
        if e.topic is None:
            log.error("a record batch was refused but its partition is not known (%s); retrying", e)
            return
        tp, first, after = skip_past(self._consumer, e)
        self._refused += 1
        self._next[tp] = after
        note = SimpleNamespace(topic=e.topic, partition=e.partition, offset=first, key=None, value=b"",
                               headers=[("dvi.origin.next_offset", str(after).encode())])
        if self.dead_letter:
            self._dead_letter(note, e)
        else:
            log.warning("skipping %s", e)

    # -- the dead-letter path -------------------------------------------------------------------

    def _dead_letter(self, m, error: BaseException) -> None:

        self._dead += 1
        message = str(error)[:_MAX_ERROR_CHARS]
        log.warning("dead-lettering %s[%d]@%d: %s: %s", m.topic, m.partition, m.offset, type(error).__name__, message)
        headers = list(m.headers or []) + list(
            zip(DLQ_HEADERS, (m.topic, str(m.partition), str(m.offset), type(error).__name__, message))
        )
        headers = [(k, v.encode() if isinstance(v, str) else v) for k, v in headers]
        try:
            self._open_dead_letters()
            value, cap = m.value, 2 * self.cfg.max_record_bytes
            if value is not None and len(value) > cap:  # keep the evidence, within what a producer may send
                headers.append(("dvi.value.truncated", str(len(value)).encode()))
                value = value[:cap]
            self._dlq_futures.append(self._dlq.send(self.dlq_topic, key=m.key, value=value, headers=headers))
        except Exception as e:
            self._dlq_errors += 1
            log.error("cannot dead-letter %s[%d]@%d to %s (%s); skipping it", m.topic, m.partition, m.offset, self.dlq_topic, e)

    def _open_dead_letters(self) -> None:
        """The dead-letter producer, made once. The consumer makes it as it starts, so that its selector, wake-up pipe
        and bootstrap connection are held from then on, as long as the consumer's (the first bad record opens only the
        connection to its partition's leader), and a broker that refuses it is seen then; if it could not be made, the
        first record to dead-letter tries again."""
        if self._dlq is None:
            self._dlq = KafkaProducer(
                **client_options(
                    self.cfg,
                    KafkaProducer,
                    client_id="dvi-dlq",
                    acks="all",
                    enable_idempotence=False,  # low volume; survives a memory broker restart
                    max_request_size=max(1 << 20, 2 * self.cfg.max_record_bytes + 65536),
                    bootstrap_timeout_ms=10000,
                )
            )

    def flush_dead_letters(self, timeout_s: float = 10.0) -> None:
        if self._dlq is None:
            return

        try:
            self._dlq.flush(timeout=timeout_s)
        except KafkaError as e:
            log.error("flushing the dead-letter producer: %s", e)
        for f in self._dlq_futures:
            if not f.is_done or f.failed():
                self._dlq_errors += 1
                log.error("a dead-letter record was not acknowledged: %s", f.exception)
        self._dlq_futures = []

    def close(self) -> None:
        try:
            self.flush_dead_letters()
        finally:
            if self._dlq is not None:
                self._dlq.close(timeout=5)
            self._consumer.close(autocommit=False)

    def __enter__(self) -> DecisionConsumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
