"""The decision producer: DecisionRecords to Kafka without ever making decoding wait.

`submit(record)` only puts the record in a bounded in-memory queue (a few microseconds) and returns; if the
queue is full the record is dropped and counted. A background thread encodes records (`dvi.record_codec.encode`,
size-bounded), hands them to a kafka-python `KafkaProducer` (batching with linger; gzip batch compression,
the records' one compression layer, at gzip's fastest level: `streams.batches.use_gzip_fast`; key = request id so a
request's chunks stay in order on one partition; headers with the content type and schema version) and counts the
outcome of each:

- sent: acknowledged by the broker;
- dropped: will never be delivered (queue full, invalid or oversized, not acknowledged within
  `stream.delivery_timeout_ms`, still queued at close); every submitted record ends up sent or dropped;
- errors: failures seen by the sender, for alerting: records that failed to encode, send or be delivered,
  and failed connection attempts.

A delivery the broker answers with an unclassified error (`UnknownError`, which kafka-python does not retry) is sent
again, at most `_RETRIES` times: the durable embedded broker answers so when two replicas write one partition's next
batch at once, and keeps only the other one's (60 of the 10,400 records of a two-replica, two-hour soak were
dropped that way). A record sent twice is harmless: the trainer's ledger drops repeated record ids.

With every bootstrap server unreachable (a TCP probe once a second), at start or mid-run, the thread holds no
Kafka client at all (a disconnected kafka-python client keeps about 5% of a core busy reconnecting, which a decode
thread sharing the GIL feels): records in flight count as dropped, new ones wait in the queue (beyond
`stream.queue_size` they are dropped), and once a probe connects a new client sends the queue. A KafkaProducer
left in a fatal state, or one that has reported no outcome for records in flight for twice the delivery timeout
(a stuck client), is closed and recreated; its unresolved records count as dropped. Records handed to the client
but not yet resolved are bounded by `stream.queue_size` too, so memory stays bounded.
This module knows records and Kafka, not the engine.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kafka import KafkaProducer
from kafka import errors as ke
from kafka.errors import KafkaError, KafkaTimeoutError

from dvi.config import StreamConfig
from dvi.procs import default_replica_id
from dvi.record_codec import encode, kafka_headers
from dvi.records import DecisionRecord, RecordError
from streams.batches import use_gzip_fast
from streams.client import client_options

log = logging.getLogger("dvi.streams.producer")

_MAX_BATCH = 512  # records taken from the queue per send pass
_RETRIES = 2  # more sends of a record whose delivery failed with a `_RETRIED` error
_RETRIED = (ke.UnknownError,)
_PROBE_S = 1.0  # between TCP probes of the bootstrap servers while a client is open
HEADERS = kafka_headers()  # on every record: its content type and schema version


@dataclass(frozen=True)
class ProducerStats:
    submitted: int  # submit() calls
    sent: int
    dropped: int
    errors: int
    pending: int  # queued or in flight: neither sent nor dropped yet
    recreated: int  # KafkaProducers rebuilt after a fatal state

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class DecisionProducer:
    """Bounded, non-blocking producer of DecisionRecords (see the module docstring). A context manager."""

    def __init__(self, cfg: StreamConfig, *, topic: str | None = None, client_id: str | None = None,
                 on_sent: Callable[[DecisionRecord], None] | None = None):
        """on_sent: called with each record the broker acknowledged (acks=all), from the Kafka client's thread."""
        self.cfg = cfg
        self.on_sent = on_sent
        self.topic = topic or cfg.topic
        self.client_id = client_id or f"dvi-producer-{cfg.replica_id or default_replica_id()}"
        if cfg.compression == "gzip":
            use_gzip_fast()
        self._queue: queue.SimpleQueue[DecisionRecord] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # notified when pending drops to 0
        self._submitted = self._sent = self._dropped = self._errors = self._recreated = 0
        self._queued = 0  # in self._queue
        self._in_flight = 0  # handed to the KafkaProducer, outcome unknown
        self._closing = False
        self._finished = False  # the thread has exited: late client callbacks are ignored
        self._stop = threading.Event()
        self._producer = None
        self._fatal = False
        self._last_warn: dict[str, float] = {}
        self._last_outcome = time.monotonic()  # of a record in flight (or when the client got its first one)
        self._next_probe = 0.0
        self._generation = 0  # of the KafkaProducer: outcomes a closed client reports late are ignored
        self._tries: dict[str, int] = {}  # record id -> how often it was sent again
        self._thread = threading.Thread(target=self._run, name="dvi-producer", daemon=True)
        self._thread.start()

    # -- the decode thread's side --------------------------------------------------------------

    def submit(self, record: DecisionRecord) -> bool:
        """Queue a record for sending; never blocks. False: dropped (queue full or producer closed)."""
        with self._lock:
            self._submitted += 1
            if self._closing or self._queued >= self.cfg.queue_size:
                self._dropped += 1
                return False
            self._queued += 1
            self._queue.put(record)  # SimpleQueue.put never blocks; under the lock the counts stay exact
        return True

    @property
    def stats(self) -> ProducerStats:
        with self._lock:
            return ProducerStats(
                self._submitted, self._sent, self._dropped, self._errors, self._queued + self._in_flight, self._recreated
            )

    def client_metrics(self) -> dict:
        """The Kafka client's own producer metrics (kafka-python's `producer-metrics` group: bytes sent, batch sizes,
        compression rate, ...); empty while no client is connected."""
        client = self._producer
        return dict(client.metrics().get("producer-metrics", {})) if client is not None else {}

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted record is sent or dropped; False if some are still pending at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._settled:
            while self._queued + self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settled.wait(min(left, 0.1))
        return True

    def close(self, timeout_s: float = 10.0) -> ProducerStats:
        """Stop accepting records, send what is pending for up to `timeout_s`, drop (and count) the rest."""
        with self._lock:
            self._closing = True
        self.flush(timeout_s)
        self._stop.set()
        self._thread.join(timeout=5.0)
        return self.stats

    def __enter__(self) -> DecisionProducer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the background thread -----------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.1
        try:
            while not self._stop.is_set():
                if self._producer is not None and not self._fatal and time.monotonic() >= self._next_probe:
                    self._next_probe = time.monotonic() + _PROBE_S
                    if not self._reachable():
                        self._warn("down", "no Kafka broker answers at %s: the client is closed until one does; records "
                                   "wait in the queue (up to stream.queue_size)", self.cfg.bootstrap)
                        self._close_client()
                if self._producer is None or self._fatal:
                    if not self._connect():
                        self._stop.wait(backoff)
                        backoff = min(2 * backoff, 2.0)
                        continue
                    backoff = 0.1
                with self._lock:
                    room = self.cfg.queue_size - self._in_flight
                    stuck_s = time.monotonic() - self._last_outcome if self._in_flight else 0.0
                if stuck_s > 2 * self.cfg.delivery_timeout_ms / 1000:
                    self._warn("stuck", "no outcome for %d records in flight in %.0f s: recreating the Kafka client",
                               self._in_flight, stuck_s)
                    self._fatal = True
                    continue
                if room <= 0:  # the client holds as many unresolved records as the queue: let it drain
                    self._stop.wait(0.01)
                    continue
                for record in self._take(min(room, _MAX_BATCH)):
                    self._send(record)
        except Exception:  # a bug here must not take the process down with it: stop logging, keep serving
            log.exception("the producer thread failed; further records are dropped")
        finally:
            self._shutdown()

    def _take(self, n: int) -> list[DecisionRecord]:
        try:
            batch = [self._queue.get(timeout=0.05)]
        except queue.Empty:
            return []
        while len(batch) < n:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            if not self._in_flight:
                self._last_outcome = time.monotonic()
            self._queued -= len(batch)
            self._in_flight += len(batch)
        return batch

    def _connect(self) -> bool:

        if self._producer is not None:  # fatal state: this client will never send again
            self._warn("fatal", "Kafka producer in a fatal state (%s): recreating it", "broker restarted?")
            self._close_client()
            with self._lock:
                self._recreated += 1
        self._fatal = False
        cfg = self.cfg
        if not self._reachable():
            with self._lock:
                self._errors += 1
            self._warn("connect", "cannot reach Kafka at %s: records wait in the queue until it is back", cfg.bootstrap)
            return False
        request_timeout = max(1000, min(5000, cfg.delivery_timeout_ms - cfg.linger_ms))
        try:
            self._producer = KafkaProducer(
                **client_options(
                    cfg,
                    KafkaProducer,
                    client_id=self.client_id,
                    acks="all",
                    # Not idempotent: after a broker restart, kafka-python's idempotent producer either stays broken
                    # (UnknownProducerId: a memory broker lost its state) or holds its batches for good (a durable one);
                    # a retry that duplicates a record is harmless, since the trainer's ledger drops repeated record ids.
                    enable_idempotence=False,
                    compression_type=None if cfg.compression == "none" else cfg.compression,
                    linger_ms=cfg.linger_ms,
                    batch_size=cfg.batch_bytes,
                    max_request_size=max(1 << 20, cfg.max_record_bytes + 65536),
                    max_block_ms=1000,  # metadata waits in send() (this thread only)
                    request_timeout_ms=request_timeout,
                    delivery_timeout_ms=max(cfg.delivery_timeout_ms, request_timeout + cfg.linger_ms),
                    bootstrap_timeout_ms=2000,
                    reconnect_backoff_max_ms=1000,
                )
            )
        except KafkaError as e:
            with self._lock:
                self._errors += 1
            self._warn("connect", "cannot reach Kafka at %s (%s): dropping records until it is back", cfg.bootstrap, e)
            return False
        log.info("producer connected to %s, topic %s", cfg.bootstrap, self.topic)
        return True

    def _send(self, record: DecisionRecord) -> None:

        try:
            value = encode(record, logprob_dtype=self.cfg.logprob_dtype, max_bytes=self.cfg.max_record_bytes,
                           schema_id=self.cfg.schema_id)
        except RecordError as e:
            self._warn("invalid", "dropping a DecisionRecord that cannot be sent: %s", e)
            self._resolve(False, self._generation)
            return
        try:
            future = self._producer.send(self.topic, key=record.request_id.encode(), value=value, headers=HEADERS)
        except Exception as e:  # KafkaError: metadata unavailable within max_block_ms, or a client in a fatal state
            self._warn("send", "send to %s failed (%s): dropping", self.topic, e)
            self._fatal = self._fatal or not isinstance(e, KafkaTimeoutError) or _is_fatal(self._producer, e)
            self._resolve(False, self._generation)
            return
        future.add_callback(self._delivered, record, self._generation)
        future.add_errback(self._failed, record, self._generation)

    def _delivered(self, record: DecisionRecord, generation: int, _metadata) -> None:
        with self._lock:
            self._tries.pop(record.record_id, None)
        if self._resolve(True, generation) and self.on_sent is not None:
            try:
                self.on_sent(record)
            except Exception as e:
                self._warn("on_sent", "the on_sent callback failed: %s", e)

    def _failed(self, record: DecisionRecord, generation: int, exc: BaseException) -> None:
        if _is_fatal(self._producer, exc):
            self._fatal = True
        if isinstance(exc, _RETRIED) and self._again(record, generation):
            self._warn("retry", "delivery to %s failed (%s): sending it again", self.topic, exc)
            return
        with self._lock:
            self._tries.pop(record.record_id, None)
        self._warn("delivery", "delivery to %s failed (%s): dropping", self.topic, exc)
        self._resolve(False, generation)

    def _again(self, record: DecisionRecord, generation: int) -> bool:
        """Queue a record whose delivery failed for another send (counted as an error, not an outcome); False when
        it had its `_RETRIES`, or the outcome came too late (see `_resolve`)."""
        with self._lock:
            tries = self._tries.get(record.record_id, 0)
            if self._finished or generation != self._generation or tries >= _RETRIES:
                return False
            self._tries[record.record_id] = tries + 1
            self._in_flight -= 1
            self._queued += 1
            self._errors += 1
            self._queue.put(record)
        return True

    def _resolve(self, ok: bool, generation: int) -> bool:
        """Count one outcome; False when it came too late (the producer has finished, or the client is closed)."""
        with self._lock:
            if self._finished or generation != self._generation:
                return False
            self._in_flight -= 1
            self._last_outcome = time.monotonic()
            if ok:
                self._sent += 1
            else:
                self._dropped += 1
                self._errors += 1
            if not self._queued and not self._in_flight:
                self._settled.notify_all()
        return True

    def _reachable(self) -> bool:
        """Whether any bootstrap server accepts a TCP connection (cheap; says nothing about Kafka itself)."""
        for server in self.cfg.bootstrap.split(","):
            host, _, port = server.strip().rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
                    return True
            except (OSError, ValueError):
                continue
        return False

    def _close_client(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                # kafka-python 3.0's close() flushes first and, with batches pending, raises before it stops its
                # sender thread, which then lives on, reconnecting; stop the sender first (its pending batches fail)
                sender = getattr(producer, "_sender", None)
                if sender is not None:
                    sender.force_close()
                    sender.join(2.0)
                producer.close(timeout=0)
            except Exception as e:  # closing a broken client must not stop the thread
                log.debug("closing the Kafka producer: %s", e)
            with self._lock:  # what it did not report is dropped; its late reports are ignored
                self._generation += 1
                self._tries.clear()
                self._dropped += self._in_flight
                self._errors += self._in_flight
                self._in_flight = 0
                if not self._queued:
                    self._settled.notify_all()

    def _shutdown(self) -> None:
        with self._lock:
            self._closing = True  # from here on submit() drops
        self._close_client()  # unresolved batches fail now: their errbacks count them
        with self._lock:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
                self._queued -= 1
                self._dropped += 1
            self._finished = True
            self._settled.notify_all()

    def _warn(self, key: str, msg: str, *args) -> None:
        """Log a warning at most every 30 s per kind: an outage must not flood the log."""
        now = time.monotonic()
        if now - self._last_warn.get(key, -1e9) >= 30.0:
            self._last_warn[key] = now
            log.warning(msg, *args)


def _is_fatal(producer, exc: BaseException | None) -> bool:
    """Whether a KafkaProducer can never send again and must be recreated."""
    fatal = tuple(
        getattr(ke, name)
        for name in ("UnknownProducerIdError", "OutOfOrderSequenceNumberError", "InvalidProducerEpochError", "ProducerFencedError")
        if hasattr(ke, name)
    )
    if isinstance(exc, fatal):
        return True
    manager = getattr(producer, "_transaction_manager", None)  # kafka-python keeps the idempotence state here
    has_fatal = getattr(manager, "has_fatal_error", None)
    return bool(has_fatal and has_fatal())
