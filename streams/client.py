"""Options shared by every Kafka client of dvi: where to connect, the pass-through security settings, and how
kafka-python's logs are quieted (outages are expected and counted) and cleaned (a close race, `ReadAfterClose`).

Knows `dvi.config.StreamConfig` and kafka-python's client classes; nothing about records.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from dvi.config import StreamConfig

SASL_PASSWORD_ENV = "DVI_KAFKA_SASL_PASSWORD"  # the SASL password of every Kafka client, when security sets none


def client_options(cfg: StreamConfig, client_cls: type, **overrides: Any) -> dict[str, Any]:
    """kafka-python keyword arguments for `client_cls`: bootstrap servers, the security settings it takes, overrides."""
    accepted = getattr(client_cls, "DEFAULT_CONFIG", {})
    opts: dict[str, Any] = {"bootstrap_servers": cfg.bootstrap.split(",")}
    opts.update({k: v for k, v in cfg.security.items() if k in accepted})
    password = os.environ.get(SASL_PASSWORD_ENV)
    if password and "sasl_plain_password" in accepted and "sasl_plain_password" not in opts:
        opts["sasl_plain_password"] = password  # a secret: from the environment, never the command line
    opts.update(overrides)
    return opts


class ReadAfterClose(logging.Filter):
    """Folds kafka-python's traceback for a read on a transport it has just closed into one line.

    kafka-python 3.0 closes a transport (its socket becomes None) while the transport's read task may still be
    waiting on that socket; the task then calls `None.recv` and the library logs the AttributeError with a
    traceback. It happens when dvi closes a client, and loses nothing. Any other record passes unchanged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        transport = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if isinstance(exc, AttributeError) and getattr(transport, "_sock", True) is None:
            record.msg, record.args = "%s: read on a closed socket ignored", (transport,)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_kafka_logs(verbose: bool = False) -> None:
    """kafka-python logs every refused connection at ERROR level; outages are expected here and counted."""
    logging.getLogger("kafka").setLevel(logging.INFO if verbose else logging.CRITICAL)
    transport = logging.getLogger("kafka.net.transport")
    if not any(isinstance(f, ReadAfterClose) for f in transport.filters):
        transport.addFilter(ReadAfterClose())
