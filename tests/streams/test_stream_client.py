"""kafka-python's read-after-close race: the library's own transport, closed, then read as its pending read task does."""

from __future__ import annotations

import logging
import socket

from kafka.net.transport import KafkaTCPTransport

from streams.client import ReadAfterClose, quiet_kafka_logs


class _Net:
    """The two calls a transport makes on its selector when it closes."""

    def unregister_event(self, sock, events):
        pass

    def cancel(self, task):
        pass


def _transport() -> tuple[KafkaTCPTransport, socket.socket]:
    ours, peer = socket.socketpair()
    return KafkaTCPTransport(_Net(), ours, host="127.0.0.1"), peer


def test_a_read_on_a_closed_transport_is_one_line(caplog):
    level = logging.getLogger("kafka").level
    quiet_kafka_logs(verbose=True)
    transport, peer = _transport()
    transport.close()
    try:
        with caplog.at_level(logging.INFO, logger="kafka.net.transport"):
            data, err = transport._sock_recv()  # what the read task does when it wakes after the close
    finally:
        peer.close()
        logging.getLogger("kafka").setLevel(level)
    assert data == b"" and err is not None  # the library still reports the read as failed
    [record] = [r for r in caplog.records if "read on a closed socket" in r.getMessage()]
    assert record.exc_info is None and record.levelno == logging.INFO
    assert "Traceback" not in caplog.text and "Error receiving" not in caplog.text


def test_other_errors_keep_their_traceback():
    transport, peer = _transport()
    try:
        record = logging.LogRecord("kafka.net.transport", logging.ERROR, __file__, 1, "%s: Error receiving network data",
                                   (transport,), None)
        try:
            raise AttributeError("open socket, some other bug")
        except AttributeError as e:
            record.exc_info = (type(e), e, e.__traceback__)
        assert ReadAfterClose().filter(record)
        assert record.levelno == logging.ERROR and record.exc_info is not None
    finally:
        transport.close()
        peer.close()
