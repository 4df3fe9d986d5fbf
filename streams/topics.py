"""Topic creation for the decision stream: the decisions topic (configured partitions), its dead-letter topic
and the control topic (one partition each, so control messages stay in order). Idempotent: existing topics
are left as they are. Knows topic names and partition counts, not what the records mean.
"""

from __future__ import annotations

import logging

from kafka import KafkaAdminClient
from kafka.errors import KafkaError, TopicAlreadyExistsError

from dvi.config import StreamConfig
from dvi.errors import DviError
from streams.client import client_options

log = logging.getLogger("dvi.streams.topics")


def stream_topics(cfg: StreamConfig) -> dict[str, int]:
    """Topic name -> partitions of everything the stream uses."""
    return {cfg.topic: cfg.partitions, cfg.dlq_topic: 1, cfg.control_topic: 1}


def ensure_topics(cfg: StreamConfig, topics: dict[str, int] | None = None, timeout_s: float = 10.0) -> list[str]:
    """Create the topics (default: `stream_topics(cfg)`) that do not exist yet; return the names created."""

    topics = stream_topics(cfg) if topics is None else topics
    try:
        ms = int(timeout_s * 1000)
        admin = KafkaAdminClient(**client_options(cfg, KafkaAdminClient, request_timeout_ms=ms, bootstrap_timeout_ms=ms, client_id="dvi-topics"))
    except KafkaError as e:
        raise DviError(f"cannot reach the Kafka broker at {cfg.bootstrap} ({type(e).__name__}: {e}): start it (dvi broker) or fix stream.bootstrap_servers") from None
    created = []
    try:
        existing = set(admin.list_topics())
        for name, partitions in topics.items():
            if name in existing:
                continue
            spec = {name: {"num_partitions": partitions, "replication_factor": cfg.replication_factor}}
            try:
                admin.create_topics(spec, timeout_ms=int(timeout_s * 1000))
                created.append(name)
            except TopicAlreadyExistsError:  # created meanwhile by someone else
                pass
            except KafkaError as e:
                raise DviError(f"cannot create topic {name!r} on {cfg.bootstrap} ({type(e).__name__}: {e})") from None
    finally:
        admin.close()
    if created:
        log.info("created topics %s on %s", created, cfg.bootstrap)
    return created
