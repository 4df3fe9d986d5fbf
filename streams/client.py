"""Options shared by every Kafka client of dvi: where to connect and the pass-through security settings.

Knows `dvi.config.StreamConfig` and kafka-python's client classes; nothing about records.
"""

from __future__ import annotations

import logging
from typing import Any

from dvi.config import StreamConfig


def client_options(cfg: StreamConfig, client_cls: type, **overrides: Any) -> dict[str, Any]:
    """kafka-python keyword arguments for `client_cls`: bootstrap servers, the security settings it takes, overrides."""
    accepted = getattr(client_cls, "DEFAULT_CONFIG", {})
    opts: dict[str, Any] = {"bootstrap_servers": cfg.bootstrap.split(",")}
    opts.update({k: v for k, v in cfg.security.items() if k in accepted})
    opts.update(overrides)
    return opts


def quiet_kafka_logs(verbose: bool = False) -> None:
    """kafka-python logs every refused connection at ERROR level; outages are expected here and counted."""
    logging.getLogger("kafka").setLevel(logging.INFO if verbose else logging.CRITICAL)
