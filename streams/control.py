"""The control topic: small JSON messages between the trainer, the servers and the operator.

Messages are JSON objects with a `type`:
- `drafter_published` (trainer -> servers): version, uri (a directory in the model store), sha256 (of its
  SHA256SUMS), parent, gate metrics, mlflow version, time;
- `drafter_rejected` (a server -> trainers and the other servers): version, previous, reason, replica_id, time:
  the live check rolled the version back; the others roll back too and trainers gate against the previous one;
- `drafter_promoted` (a server -> trainers): version, acceptance, replica_id, time: the live check kept it;
  trainers record both verdicts in the model store, where a restarting server reads them;
- `retrain` (`dvi retrain` -> trainer): reason, time.
The control topic has one partition, so messages keep their order. `send` waits for the broker's
acknowledgement (a control message matters more than latency); `ControlReader` reads the topic without a
consumer group, from the end by default, and skips (and counts) anything that is not a JSON object with a
type. This module knows Kafka and JSON, not what the trainer or the servers do with the messages.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from dvi.config import StreamConfig
from dvi.errors import DviError
from streams.client import client_options

log = logging.getLogger("dvi.streams.control")

PUBLISHED, REJECTED, PROMOTED, RETRAIN = "drafter_published", "drafter_rejected", "drafter_promoted", "retrain"


def encode_message(kind: str, **fields: Any) -> bytes:
    return json.dumps({"type": kind, "time": time.time(), **fields}, sort_keys=True).encode()


def decode_message(data: bytes) -> dict:
    """The message in `data`; ValueError when it is not a JSON object with a string `type`."""
    msg = json.loads(data.decode("utf-8"))
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ValueError("not a JSON object with a string 'type'")
    return msg


def send(cfg: StreamConfig, kind: str, timeout_s: float = 10.0, **fields: Any) -> dict:
    """Send one control message and wait for the broker to acknowledge it. Returns the message."""
    from kafka import KafkaProducer
    from kafka.errors import KafkaError

    data = encode_message(kind, **fields)
    try:
        producer = KafkaProducer(**client_options(cfg, KafkaProducer, client_id="dvi-control", bootstrap_timeout_ms=int(timeout_s * 1000)))
    except KafkaError as e:
        raise DviError(f"cannot reach Kafka at {cfg.bootstrap} to send a {kind} message ({type(e).__name__}: {e})") from None
    try:
        producer.send(cfg.control_topic, data).get(timeout=timeout_s)
    except KafkaError as e:
        raise DviError(f"the {kind} message to topic {cfg.control_topic!r} was not acknowledged ({type(e).__name__}: {e})") from None
    finally:
        producer.close(timeout=timeout_s)
    return json.loads(data)


class ControlReader:
    """Read control messages (see the module docstring). A context manager; `poll()` never raises on bad data."""

    def __init__(self, cfg: StreamConfig, from_beginning: bool = False, client_id: str = "dvi-control-reader"):
        from kafka import KafkaConsumer, TopicPartition
        from kafka.errors import KafkaError

        self.invalid = 0
        try:
            self._consumer = KafkaConsumer(**client_options(cfg, KafkaConsumer, client_id=client_id, enable_auto_commit=False,
                                                            bootstrap_timeout_ms=5000))
        except KafkaError as e:
            raise DviError(f"cannot reach Kafka at {cfg.bootstrap} ({type(e).__name__}: {e}): start it (dvi broker) or fix stream.bootstrap_servers") from None
        tp = TopicPartition(cfg.control_topic, 0)
        self._consumer.assign([tp])
        (self._consumer.seek_to_beginning if from_beginning else self._consumer.seek_to_end)(tp)
        self._consumer.position(tp)  # resolve "the end" now, so a message sent after this call is seen

    def poll(self, timeout_s: float = 0.0) -> list[dict]:
        out = []
        for messages in self._consumer.poll(timeout_ms=int(timeout_s * 1000)).values():
            for m in messages:
                try:
                    out.append(decode_message(m.value))
                except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                    self.invalid += 1
                    log.warning("skipping control message at offset %d: %s", m.offset, e)
        return out

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> ControlReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
