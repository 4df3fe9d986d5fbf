"""The control topic: `dvi.control` messages over Kafka.

The control topic has one partition, so messages keep their order. `send` signs (`stream.control_auth`, with the
key of the role that may say it, `dvi.keys`) and waits for the broker's acknowledgement (a control message matters
more than latency). `ControlReader` reads the topic without a consumer group, from the end by default; anything
`dvi.control.Verifier` refuses (unsigned, forged, stale, replayed, malformed), and a compressed batch past the
inflation bound (`streams.batches`), is skipped, logged at WARNING with its topic, partition and offset, and
counted, and never raises. `ControlChannel` is what a serving replica is handed: a reader that (re)connects by itself, so a
broker that is down or a reader that broke costs a log line and a retry, never an exception in the caller, plus
`send`. This module knows Kafka; the messages' shapes are `dvi.control`'s, what they make happen is not known here.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError

from dvi import keys as signing
from dvi.config import StreamConfig, default_cache_dir, keys_dir
from dvi.control import SIGNER, ControlError, Message, Verifier, decode, encode
from dvi.errors import DviError
from dvi.keys import Keys
from streams.batches import BatchRefused, guard, skip_past
from streams.client import client_options
from streams.topics import ensure_topics

log = logging.getLogger("dvi.streams.control")


def send(cfg: StreamConfig, msg: Message, timeout_s: float = 10.0, keys: Keys | None = None) -> None:
    """Send one control message and wait for the broker to acknowledge it; DviError when it is not, or when this
    process holds no key of the role that may send it (`stream.control_auth`; default keys: `stream.keys_dir`)."""
    if cfg.control_auth and keys is None:
        keys = signing.load(keys_dir(cfg), sign_as=(SIGNER[msg.kind],))
    data = encode(msg, keys if cfg.control_auth else None)
    try:
        producer = KafkaProducer(**client_options(cfg, KafkaProducer, client_id="dvi-control", bootstrap_timeout_ms=int(timeout_s * 1000)))
    except KafkaError as e:
        raise DviError(f"cannot reach Kafka at {cfg.bootstrap} to send a {msg.kind} message ({type(e).__name__}: {e})") from None
    try:
        producer.send(cfg.control_topic, data).get(timeout=timeout_s)
    except KafkaError as e:
        raise DviError(f"the {msg.kind} message to topic {cfg.control_topic!r} was not acknowledged ({type(e).__name__}: {e})") from None
    finally:
        producer.close(timeout=timeout_s)


def seen_file(reader: str) -> Path:
    """Where the reader named `reader` (a replica's client id, stable across its restarts; the trainer's) keeps the
    signatures of the control messages it accepted: <cache>/control/<reader>.seen."""
    return default_cache_dir() / "control" / (re.sub(r"[^A-Za-z0-9._-]", "_", reader)[:128] + ".seen")


class ControlReader:
    """Read control messages (see the module docstring). A context manager; `poll()` never raises on bad data."""

    def __init__(self, cfg: StreamConfig, from_beginning: bool = False, client_id: str = "dvi-control-reader",
                 keys: Keys | None = None, verifier: Verifier | None = None, seen_file: Path | None = None):
        self.invalid = 0
        self._topic = cfg.control_topic
        # signed messages only (stream.control_auth): verified with `keys`' public keys (default: stream.keys_dir), by
        # `verifier` where the caller keeps one across readers, remembering what it accepted in `seen_file` if given
        if cfg.control_auth:
            self._decode = verifier or Verifier(keys or signing.load(keys_dir(cfg)), seen_file=seen_file)
        else:
            self._decode = decode
        guard(1 << 20)  # control messages are small; the bound is the largest any consumer of the process asks for
        try:
            self._consumer = KafkaConsumer(**client_options(cfg, KafkaConsumer, client_id=client_id, enable_auto_commit=False,
                                                            bootstrap_timeout_ms=5000))
        except KafkaError as e:
            raise DviError(f"cannot reach Kafka at {cfg.bootstrap} ({type(e).__name__}: {e}): start it (dvi broker) or fix stream.bootstrap_servers") from None
        tp = TopicPartition(cfg.control_topic, 0)
        self._consumer.assign([tp])
        (self._consumer.seek_to_beginning if from_beginning else self._consumer.seek_to_end)(tp)
        self._consumer.position(tp)  # resolve "the end" now, so a message sent after this call is seen

    def poll(self, timeout_s: float = 0.0) -> list[Message]:
        out = []
        try:
            polled = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        except BatchRefused as e:  # a compressed batch past the bound (streams.batches): skipped like a bad message
            self.invalid += 1
            log.warning("skipping %s", e)
            if e.topic is not None:
                skip_past(self._consumer, e)
            return out
        for messages in polled.values():
            for m in messages:
                try:
                    out.append(self._decode(m.value))
                except ControlError as e:
                    self.invalid += 1
                    log.warning("skipping control message at %s[%d]@%d: %s", m.topic, m.partition, m.offset, e)
        return out

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> ControlReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ControlChannel:
    """A replica's side of the control topic: `poll` (connecting and reconnecting as needed) and `send`."""

    def __init__(self, cfg: StreamConfig, client_id: str, retry_s: float = 5.0, keys: Keys | None = None):
        self.cfg, self.client_id, self.retry_s = cfg, client_id, retry_s
        # a replica signs its verdicts and trusts the trainer's and the replicas' public keys
        self.keys = (keys or signing.load(keys_dir(cfg), sign_as=("replica",))) if cfg.control_auth else None
        # one verifier for every reader this channel opens: a message seen before a reconnect, or before a restart of
        # this replica (its seen file), is a replay after it too
        self.verifier = Verifier(self.keys, seen_file=seen_file(client_id)) if self.keys is not None else None
        self._reader: ControlReader | None = None
        self._next_try = 0.0
        self._warned = False
        self._invalid_before = 0  # skipped by readers since replaced

    def poll(self, timeout_s: float = 0.5) -> list[Message]:
        """Messages sent since the last poll; [] (after waiting up to `timeout_s`) while the topic cannot be read."""
        if self._reader is None and not self._connect():
            time.sleep(min(timeout_s, max(0.0, self._next_try - time.monotonic())))
            return []
        try:
            return self._reader.poll(timeout_s)
        except Exception:  # a broken client: log, reconnect on the next poll
            log.exception("reading the control topic %s failed; reconnecting", self.cfg.control_topic)
            self._drop_reader()
            self._next_try = time.monotonic() + 1.0
            return []

    def _connect(self) -> bool:
        if time.monotonic() < self._next_try:
            return False
        try:
            # a reader assigned to a topic that does not exist yet starts at its end once it appears, after the
            # messages that created it: create the topics first, as the trainer does
            ensure_topics(self.cfg)
            self._reader = ControlReader(self.cfg, client_id=self.client_id, keys=self.keys, verifier=self.verifier)
        except DviError as e:
            if not self._warned:
                log.warning("hot swap waits for the control topic: %s (retrying every %g s)", e, self.retry_s)
                self._warned = True
            self._next_try = time.monotonic() + self.retry_s
            return False
        self._warned = False
        return True

    @property
    def connected(self) -> bool:
        return self._reader is not None

    @property
    def invalid(self) -> int:
        """Messages skipped because `dvi.control.decode` refused them."""
        return self._invalid_before + (self._reader.invalid if self._reader is not None else 0)

    def send(self, msg: Message) -> None:
        send(self.cfg, msg, keys=self.keys)

    def _drop_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            self._invalid_before += reader.invalid
            try:
                reader.close()
            except Exception:
                pass

    def close(self) -> None:
        self._drop_reader()
