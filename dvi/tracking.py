"""The MLflow client: metrics, params and drafter registrations that never block or crash their caller.

`Tracker.log_metrics(metrics, step)` stamps the wall-clock time, puts the points in a bounded in-memory queue
(`tracking.queue_size` points plus the one batch being sent; when it is full the oldest points are dropped and
counted) and returns. Non-finite values are skipped and counted. `register_drafter(...)` queues a registration
in a separate queue that overflow never touches. One background thread does all the talking to MLflow:

- it creates (or finds) the experiment and the run once, with the params and tags; a reconnect keeps the run;
- it sends the points in `MlflowClient.log_batch` calls of at most 1000, with their original steps and times,
  so a backlog that arrives after an outage still lands where it belongs on the time axis;
- it registers drafters: registered model `tracking.registry_model`, a version tagged `dvi.version` with the
  given lineage tags, and an alias (candidate by default); later it moves aliases (`set_alias`), tags versions
  (`tag_version`) and logs artifact files (`log_artifact`), in the order asked. The MLflow server only accepts a local path as a
  version's source if it lies inside the run's artifacts, so a local source (file or folder) is first logged
  as the run's artifacts `drafters/<version>/` and the version points at `runs:/<run>/drafters/<version>`
  (tag `dvi.source` keeps the original); a remote URI (s3://, https://, runs:/, ...) is registered as it is.
  A logged folder gets an `MLmodel` file (`mlmodel`) naming `dvi.registry_model` as its pyfunc loader, so
  `mlflow.pyfunc.load_model("models:/<registry_model>@production")` loads the drafter.

MLflow unreachable, at start or mid-run: nothing fails; the thread retries every `tracking.retry_s` while the
queue fills. An error MLflow answers with a 4xx (a bad key, a param changed) drops what caused it, counted as
a failure, rather than retrying it forever. The client's HTTP retries and timeout are kept short (unless the
user set MLFLOW_HTTP_REQUEST_* variables) so a dead server costs the thread seconds, not minutes.
`close(timeout_s)` flushes for at most that long, ends the run and says how many points were lost.

`loop_view` answers `dvi status` (the newest trainer run, the registered versions and their aliases) over MLflow's
REST API with plain urllib (`rest`), so that `dvi status` answers in well under 2 s. The mlflow package is imported
where it is first used, not at the top: it takes seconds to import, and a process with tracking off never needs it.
MLflow's usage telemetry is off (MLFLOW_DISABLE_TELEMETRY, unless the environment sets it): it would report out and
write under the home directory.

This module is dvi's one MLflow client; the login it presents is `dvi.mlflow_login`'s. It knows MLflow, not training
or serving: what the metrics mean, when to log and what a drafter version holds are its callers' business.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import re
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dvi import mlflow_view
from dvi.config import TrackingConfig
from dvi.mlflow_login import PASSWORD_VAR, TOKEN_VAR, USER_VAR, auth_headers, local_login

log = logging.getLogger("dvi.tracking")

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
MAX_PARAMS_PER_BATCH = 100
VERSION_TAG = "dvi.version"
METRIC_KEY = re.compile(r"[\w./\- :]{1,250}")  # the names MLflow accepts
SOURCE_TAG = "dvi.source"
PRODUCTION_ALIAS, CANDIDATE_ALIAS = "production", "candidate"
# experiment tags: MLflow 3 opens an experiment of this kind on its runs table (not the GenAI overview), and shows the note
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development",
                   "mlflow.note.content": "dvi: online drafter adaptation. Open the saved view `dvi: the loop at a glance` "
                                          "(runs with their key figures as columns; its chart view plots acceptance by domain "
                                          "and by drafter version, swaps, promotions, gates and publishes against wall-clock "
                                          "time). Runs: `trainer` (`gate/*`, `count/*`, `loss`); `serve-<host>-<port>` "
                                          "(`interval/acceptance.<domain>`, `version/<v>/acceptance_rate`, `events/*`, and the "
                                          "artifact `plots/drift.png`). Models: `dvi-drafter` (aliases `production`, `candidate`)."}
# MLflow 3.17 opens experiments in its GenAI view unless the page asks for the classic one (the experiment kind above
# is not enough while its workflow switch is shown): links dvi prints carry this
CLASSIC_VIEW = "?workflowType=machine_learning"
# the MLflow client's defaults (7 retries with backoff, 120 s timeout) would stall the thread for minutes
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
_IDLE_S = 0.5  # how often the thread looks for new points when all is sent
# importing mlflow starts its usage telemetry (reports sent out, an id written to ~/.config/mlflow) unless this is set:
# off in every process that imports this module, before any import of mlflow here (a user's own setting stands)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def bounded_http() -> None:
    """Give the MLflow client HTTP_DEFAULTS unless the environment sets them (before any client is made)."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


@dataclass(frozen=True)
class TrackerStats:
    sent: int  # metric points MLflow acknowledged
    queued: int  # waiting to be sent (including the batch in flight)
    dropped: int  # lost: oldest dropped when the queue was full, rejected by MLflow, or unsent at close
    skipped_nonfinite: int  # NaN, inf, not a number, or a name MLflow refuses: never queued
    failures: int  # failed attempts to reach MLflow, and operations it rejected
    connected: bool  # the last attempt reached MLflow
    run_id: str | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _Registration:
    source: str
    version: str
    tags: dict[str, str]
    alias: str


@dataclass(frozen=True)
class _Op:
    """One queued MLflow operation other than metric points: done in order, retried while MLflow is away."""

    what: str  # for the log: "registering drafter d0001"
    run: Callable[[Any], None]  # called with the MlflowClient


class _Fatal(Exception):
    """The run cannot be created (MLflow said no): the tracker stops and drops what it gets."""


class _Unusable(Exception):
    """An operation that can never succeed as it is (a missing source): dropped like a 4xx answer."""


class Tracker:
    """Non-blocking MLflow sink for one training run (see the module docstring). A context manager."""

    def __init__(self, cfg: TrackingConfig, run_name: str, params: dict | None = None, tags: dict | None = None):
        self.cfg = cfg
        self.run_name = run_name
        self.enabled = cfg.enabled
        local_login(cfg)
        self._params = flatten(params or {})
        self._tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._lock = threading.Lock()
        self._points: deque[tuple[str, float, int, int]] = deque()  # (key, value, timestamp ms, step)
        self._in_flight: list[tuple[str, float, int, int]] = []
        self._ops: deque[_Op] = deque()
        self._registered: dict[str, int] = {}
        self._sent = self._dropped = self._skipped = self._failures = 0
        self._connected = False
        self._run_id: str | None = None
        self._params_logged = False
        self._experiment: str | None = None
        # the metric keys the experiment's saved view plots, as sent by this run, and as last written (None: not yet)
        self._view_keys: frozenset[str] = frozenset()
        self._view_written: frozenset[str] | None = None
        self._outage_reported = False
        self._outage: tuple[float, int, int] | None = None  # (started, points sent, points dropped) when contact was lost
        self._last_rejection: dict[str, float] = {}
        self._closing = False
        self._deadline = math.inf  # set by close(): the thread gives up after it
        self._abandoned = False  # close() returned: the thread's late results no longer count
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if self.enabled:
            bounded_http()
            self._thread = threading.Thread(target=self._run, name="dvi-tracker", daemon=True)
            self._thread.start()

    # -- the training thread's side ------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue one point per metric, stamped now; never blocks, never raises on a bad value."""
        if not self.enabled:
            return
        stamp = int(time.time() * 1000)
        with self._lock:
            if self._closing:
                self._dropped += len(metrics)
                return
            for key, value in metrics.items():
                value = _finite(value)
                if value is None or not METRIC_KEY.fullmatch(str(key)) or ".." in str(key):
                    self._skipped += 1  # MLflow would refuse the whole batch over one bad value or name
                    continue
                if len(self._points) >= self.cfg.queue_size:
                    self._points.popleft()
                    self._dropped += 1
                self._points.append((str(key), value, stamp, int(step)))

    def register_drafter(self, source: str, version: str, tags: dict[str, str], alias: str = "candidate") -> None:
        """Queue the registration of drafter `version` (at `source`) under `tracking.registry_model`."""
        if not self.enabled:
            return
        reg = _Registration(str(source), str(version), {str(k): str(v) for k, v in tags.items()}, alias)
        self._queue(_Op(f"registering drafter {reg.version}", lambda client: self._register(client, reg)))

    def set_alias(self, version: str, alias: str) -> None:
        """Queue: point alias `alias` of `tracking.registry_model` at the registered drafter `version`."""
        self._queue(_Op(f"setting alias {alias} to drafter {version}",
                        lambda client: client.set_registered_model_alias(self.cfg.registry_model, alias, self._number(client, version))))

    def promote(self, version: str) -> None:
        """Queue: alias `production` to the registered drafter `version`, and alias `candidate` off it (a candidate
        is a version not yet judged live)."""
        def op(client) -> None:
            name, number = self.cfg.registry_model, self._number(client, version)
            client.set_registered_model_alias(name, PRODUCTION_ALIAS, number)
            try:
                if str(client.get_model_version_by_alias(name, CANDIDATE_ALIAS).version) == str(number):
                    client.delete_registered_model_alias(name, CANDIDATE_ALIAS)
            except Exception as e:  # no candidate alias: nothing to move
                if _error_code(e) not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                    raise
        self._queue(_Op(f"promoting drafter {version}", op))

    def tag_version(self, version: str, tags: dict[str, str]) -> None:
        """Queue: set tags on the registered drafter `version` (e.g. dvi.rejected)."""
        def op(client) -> None:
            number = self._number(client, version)
            for key, value in tags.items():
                client.set_model_version_tag(self.cfg.registry_model, number, str(key), str(value))
        self._queue(_Op(f"tagging drafter {version}", op))

    def log_artifact(self, path: str, artifact_path: str | None = None, remove: bool = False) -> None:
        """Queue: log the local file `path` as an artifact of the run (deleted afterwards when `remove`, with its folder
        once that is empty: the temporary folder made for it)."""
        def op(client) -> None:
            client.log_artifact(self._run_id, path, artifact_path)
            if remove:
                Path(path).unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # not empty: someone else's files are there too
                    Path(path).parent.rmdir()
        self._queue(_Op(f"logging artifact {Path(path).name}", op))

    def _queue(self, op: _Op) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._closing:
                log.warning("tracker closed: not done in MLflow: %s", op.what)
                return
            self._ops.append(op)
        self._wake.set()

    def stats(self) -> TrackerStats:
        with self._lock:
            queued = len(self._points) + len(self._in_flight)
            return TrackerStats(
                self._sent, queued, self._dropped, self._skipped, self._failures, self._connected, self._run_id
            )

    def close(self, timeout_s: float = 10.0) -> TrackerStats:
        """Send what can be sent within `timeout_s`, end the run (FINISHED), and count the rest as dropped."""
        if not self.enabled or self._thread is None:
            return self.stats()
        with self._lock:
            first = not self._closing
            self._closing = True
            self._deadline = min(self._deadline, time.monotonic() + timeout_s)
        self._wake.set()
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if first:
            self._give_up()
        return self.stats()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _give_up(self) -> None:
        with self._lock:
            self._abandoned = True
            unsent = len(self._points) + len(self._in_flight)
            self._points.clear()
            self._in_flight = []
            self._dropped += unsent
            lost = [op.what for op in self._ops]
            self._ops.clear()
            dropped = self._dropped
        if dropped:
            log.warning(
                "MLflow tracking at %s: %d metric points lost (%d unsent at close, %d dropped earlier: queue full or rejected)",
                redact(self.cfg.tracking_uri), dropped, unsent, dropped - unsent,
            )  # fmt: skip
        if lost:
            log.warning("MLflow tracking at %s: not done: %s", redact(self.cfg.tracking_uri), "; ".join(lost))

    # -- the background thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            from mlflow import MlflowClient  # heavy: see the module docstring

            client = MlflowClient(tracking_uri=self.cfg.tracking_uri, registry_uri=self.cfg.tracking_uri)
            while not self._done():
                if self._sync(client):
                    self._pause(_IDLE_S)
                else:
                    self._pause(self.cfg.retry_s)
            if self._connected and self._run_id and not self._abandoned and time.monotonic() < self._deadline:
                client.set_terminated(self._run_id, "FINISHED")
        except _Fatal as e:
            log.error("MLflow tracking stopped: %s; metrics of this run are dropped", e)
        except Exception:  # a bug here must not take training down with it
            log.exception("the MLflow tracking thread failed; metrics of this run are dropped")
        finally:
            with self._lock:
                self._closing = True  # from here on log_metrics counts what it gets as dropped

    def _done(self) -> bool:
        with self._lock:
            if self._abandoned or time.monotonic() >= self._deadline:
                return True
            return self._closing and not (self._points or self._in_flight or self._ops)

    def _pause(self, seconds: float) -> None:
        self._wake.wait(max(0.0, min(seconds, self._deadline - time.monotonic())))
        self._wake.clear()

    def _sync(self, client) -> bool:
        """One pass: the run, pending registrations, then the queued points. False: MLflow is unreachable."""
        try:
            self._ensure_run(client)
            while (op := self._next_op()) is not None:
                self._attempt(lambda: op.run(client), op.what)
                self._op_done(op)
            while not self._done() and self._take_batch():
                if not self._attempt(lambda: self._send_batch(client), "logging metrics"):
                    self._drop_in_flight()
            if self._view_keys != self._view_written:
                self._attempt(lambda: self._write_view(client), "the experiment's saved view")
                self._view_written = self._view_keys
        except _Fatal:
            raise
        except Exception as e:
            self._lost_contact(e)
            return False
        if self._outage_reported:
            started, sent, dropped = self._outage
            with self._lock:
                sent, dropped = self._sent - sent, self._dropped - dropped
            log.warning("MLflow at %s is reachable again after %.0f s: %d metric points logged during the outage sent "
                        "to run %s with their original times, %d lost (queue full)", redact(self.cfg.tracking_uri),
                        time.monotonic() - started, sent, self._run_id, dropped)
            self._outage_reported = False
        with self._lock:
            self._connected = True
        return True

    def _attempt(self, op, what: str) -> bool:
        """Run one MLflow operation. False: MLflow rejected it (4xx), so it is dropped, not retried forever."""
        try:
            op()
            return True
        except Exception as e:
            if not _rejected(e):
                raise
            with self._lock:
                self._failures += 1
            now = time.monotonic()
            if now - self._last_rejection.get(what, -math.inf) >= 60.0:  # a deleted run rejects every batch
                self._last_rejection[what] = now
                log.warning("MLflow rejected %s: %s", what, _short(e))
            return False

    def _lost_contact(self, e: Exception) -> None:
        with self._lock:
            self._failures += 1
            self._connected = False
        if not self._outage_reported:  # once per outage: a long one must not flood the log
            self._outage_reported = True
            with self._lock:
                self._outage = (time.monotonic(), self._sent, self._dropped)
            log.warning(
                "MLflow at %s unreachable (%s): keeping up to %d metric points, retrying every %g s",
                redact(self.cfg.tracking_uri), _short(e), self.cfg.queue_size, self.cfg.retry_s,
            )  # fmt: skip

    def _ensure_run(self, client) -> None:
        """The experiment, the run and its params, each created once (a reconnect keeps the same run)."""
        if self._run_id is None:
            experiment_id = self._experiment = self._experiment_id(client)
            try:
                run = client.create_run(experiment_id, run_name=self.run_name, tags=self._tags)
            except Exception as e:
                if _rejected(e):
                    raise _Fatal(f"cannot create a run in experiment {self.cfg.experiment!r} ({_short(e)})") from e
                raise
            with self._lock:
                self._run_id = run.info.run_id
            log.info("MLflow tracking at %s: experiment %s, run %s (%s)", redact(self.cfg.tracking_uri), self.cfg.experiment,
                     self._run_id, self.run_name)
        if not self._params_logged:
            self._attempt(lambda: self._log_params(client), "the run's params")
            self._params_logged = True

    def _experiment_id(self, client) -> str:
        name = self.cfg.experiment
        experiment = client.get_experiment_by_name(name)
        if experiment is not None and experiment.lifecycle_stage != "active":
            raise _Fatal(f"experiment {name!r} is deleted: restore it in MLflow or set tracking.experiment=<another name>")
        if experiment is not None:
            missing = {k: v for k, v in EXPERIMENT_TAGS.items() if k not in (experiment.tags or {})}
            for key, value in missing.items():  # an experiment made before dvi set them (or by hand)
                self._attempt(lambda: client.set_experiment_tag(experiment.experiment_id, key, value), f"experiment tag {key}")
            return experiment.experiment_id
        try:
            return client.create_experiment(name, tags=EXPERIMENT_TAGS)
        except Exception as e:
            if _error_code(e) != "RESOURCE_ALREADY_EXISTS":  # another process created it just now
                raise
            return client.get_experiment_by_name(name).experiment_id

    def _log_params(self, client) -> None:
        from mlflow.entities import Param  # heavy: see the module docstring

        params = [Param(k, v) for k, v in self._params.items()]
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            client.log_batch(self._run_id, params=params[i : i + MAX_PARAMS_PER_BATCH], synchronous=True)

    def _take_batch(self) -> bool:
        """Move up to 1000 points into the in-flight batch (a failed batch stays there and goes first)."""
        with self._lock:
            while self._points and len(self._in_flight) < MAX_METRICS_PER_BATCH:
                self._in_flight.append(self._points.popleft())
            return bool(self._in_flight)

    def _send_batch(self, client) -> None:
        from mlflow.entities import Metric  # heavy: see the module docstring

        with self._lock:
            batch = list(self._in_flight)
        client.log_batch(self._run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in batch], synchronous=True)
        self._view_keys = mlflow_view.plotted_keys(self._view_keys | {k for k, *_ in batch})
        with self._lock:
            if not self._abandoned:
                self._sent += len(batch)
                self._in_flight = []

    def _write_view(self, client) -> None:
        """The experiment's saved view (`dvi.mlflow_view`), its charts naming the keys this run has sent and those
        the stored view already named (another run's domains and versions)."""
        stored = (client.get_experiment(self._experiment).tags or {}).get(mlflow_view.TAG_KEY)
        keys = mlflow_view.merged_keys(stored, self._view_keys)
        client.set_experiment_tag(self._experiment, mlflow_view.TAG_KEY, mlflow_view.tag_value(keys, time.time() * 1000))

    def _drop_in_flight(self) -> None:
        with self._lock:
            self._dropped += len(self._in_flight)
            self._in_flight = []

    def _next_op(self) -> _Op | None:
        with self._lock:
            return self._ops[0] if self._ops and not self._abandoned else None

    def _op_done(self, op: _Op) -> None:
        with self._lock:
            if self._ops and self._ops[0] is op:  # close() may have cleared the queue
                self._ops.popleft()

    def _number(self, client, version: str) -> str:
        """The MLflow model version number of the registered drafter `version`."""
        with self._lock:
            known = self._registered.get(version)
        if known is not None:
            return str(known)
        found = self._existing_version(client, self.cfg.registry_model, version)
        if found is None:
            raise _Unusable(f"drafter {version} is not registered in {self.cfg.registry_model!r}")
        return str(found)

    def _register(self, client, reg: _Registration) -> None:
        name = self.cfg.registry_model
        try:
            client.create_registered_model(name)
        except Exception as e:
            if _error_code(e) != "RESOURCE_ALREADY_EXISTS":
                raise
        version = self._existing_version(client, name, reg.version)  # a retry after a lost answer
        if version is None:
            source, tags = self._source_of(client, reg)
            # an OSS server creates versions READY at once: no need to poll for PENDING_REGISTRATION
            mv = client.create_model_version(name, source=source, run_id=self._run_id, tags=tags, await_creation_for=0)
            version = int(mv.version)
        client.set_registered_model_alias(name, reg.alias, str(version))
        with self._lock:
            self._registered[reg.version] = version
        log.info("MLflow registry: %s version %d = drafter %s (alias %s)", name, version, reg.version, reg.alias)

    def _existing_version(self, client, name: str, dvi_version: str) -> int | None:
        if "'" in dvi_version or "'" in name:
            return None  # cannot be quoted in a filter string; such versions are never looked up
        found = client.search_model_versions(f"name='{name}' and tags.`{VERSION_TAG}`='{dvi_version}'")
        return int(found[0].version) if found else None

    def _source_of(self, client, reg: _Registration) -> tuple[str, dict[str, str]]:
        """The version's source and tags; a local source is logged as run artifacts first (see the docstring)."""
        tags = {**reg.tags, VERSION_TAG: reg.version}
        path = local_path(reg.source)
        if path is None:
            return reg.source, tags
        if not path.exists():
            raise _Unusable(f"drafter source {path} does not exist")
        artifact_path = f"drafters/{reg.version}"
        if path.is_dir():
            client.log_artifacts(self._run_id, str(path), artifact_path)
            with tempfile.TemporaryDirectory() as tmp:  # the registry's tooling loads it as a pyfunc model
                (Path(tmp) / "MLmodel").write_text(mlmodel(artifact_path, reg.version))
                client.log_artifact(self._run_id, str(Path(tmp) / "MLmodel"), artifact_path)
        else:
            client.log_artifact(self._run_id, str(path), artifact_path)
        return f"runs:/{self._run_id}/{artifact_path}", {**tags, SOURCE_TAG: reg.source}


def mlmodel(artifact_path: str, version: str) -> str:
    """The MLmodel file of a logged drafter directory: a pyfunc model whose loader is `dvi.registry_model`, so
    `mlflow.pyfunc.load_model("models:/<registry_model>@production")` loads the drafter. JSON, which is YAML."""
    from mlflow import __version__ as mlflow_version  # heavy: see the module docstring

    return json.dumps({
        "artifact_path": artifact_path,
        "flavors": {"python_function": {"loader_module": "dvi.registry_model", "python_version": platform.python_version()}},
        # params only: inputs are prompts of any shape (text or token ids), checked by the loader
        "signature": {"inputs": None, "outputs": None,
                      "params": json.dumps([{"name": "max_new_tokens", "default": 8, "shape": None, "type": "long"}])},
        "metadata": {"dvi_version": version},
        "mlflow_version": mlflow_version,
        "model_uuid": uuid.uuid4().hex,
        "utc_time_created": time.strftime("%Y-%m-%d %H:%M:%S.000000", time.gmtime()),
    }, indent=2) + "\n"


def _error_code(e: Exception) -> str | None:
    return getattr(e, "error_code", None)


def _rejected(e: Exception) -> bool:
    """Whether MLflow answered and said no (4xx except 429): retrying the same request cannot help."""
    if isinstance(e, _Unusable):
        return True
    from mlflow.exceptions import RestException  # heavy: see the module docstring

    if not isinstance(e, RestException):
        return False  # connection errors, timeouts, 5xx: transient
    status = e.get_http_status_code()
    return 400 <= status < 500 and status != 429


def _short(e: Exception) -> str:
    """One line of an MLflow error: its start and its end (where a connection error names the cause), with the
    credentials of any URI in it redacted."""
    text = redact(" ".join(str(e).split())) or type(e).__name__
    return text if len(text) <= 240 else f"{text[:100]} ... {text[-120:]}"


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def redact(text: str) -> str:
    """`text` with the credentials of any URI in it (scheme://user:password@host) replaced by ***: for logs."""
    return _CREDENTIALS.sub(r"\1***@", text)


_CREDENTIALS = re.compile(r"([a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)


def local_path(source: str) -> Path | None:
    """The local file behind `source` (a path or a file: URI), or None for a remote URI."""
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a plain path (or a Windows drive letter)
        return Path(source)
    return None


def flatten(params: dict, prefix: str = "") -> dict[str, str]:
    """Nested dicts (a config as a dict) as MLflow params: {"trainer": {"lr": 1e-3}} -> {"trainer.lr": "0.001"}."""
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)
    return out


def rest(uri: str, endpoint: str, query: dict | None = None, body: dict | None = None, timeout_s: float = 1.5) -> dict:
    """One call of MLflow's REST API (`/api/2.0/mlflow/<endpoint>`) with plain urllib: a GET with `query`, or a
    POST of `body` as JSON. For quick looks (`loop_view`) where importing the mlflow package would cost seconds."""
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/{endpoint}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **auth_headers()}
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"{}")


def experiment_link(uri: str, experiment_id: str | None) -> str:
    """The page that opens the experiment on dvi's saved view (`dvi.mlflow_view`: its runs, their key figures as
    columns, the charts beside them); the experiments list while there is no experiment yet."""
    if experiment_id is None:
        return f"{redact(uri)}/#/experiments{CLASSIC_VIEW}"
    return f"{redact(uri)}/#{mlflow_view.view_path(experiment_id)}"


def find_experiment_link(cfg: TrackingConfig, timeout_s: float = 1.5) -> str:
    """`experiment_link` for experiment `tracking.experiment`, looked up over the REST API (the list when MLflow does not
    answer or has no such experiment yet)."""
    local_login(cfg)
    try:
        found = rest(cfg.tracking_uri, "experiments/get-by-name", {"experiment_name": cfg.experiment}, timeout_s=timeout_s)
        experiment_id = found["experiment"]["experiment_id"]
    except (OSError, ValueError, KeyError):
        experiment_id = None
    return experiment_link(cfg.tracking_uri, experiment_id)


def loop_view(cfg: TrackingConfig, timeout_s: float = 1.5) -> dict:
    """What MLflow says of the loop (for `dvi status`), read over its REST API: the newest trainer run (name, status,
    last value, step and time of each metric) and the registered drafter versions (dvi version, parent, records,
    gate figures, creation time, aliases), newest first; or why MLflow could not be asked."""
    local_login(cfg)
    uri = cfg.tracking_uri
    out: dict = {"uri": redact(uri)}
    try:
        exp = rest(uri, "experiments/get-by-name", {"experiment_name": cfg.experiment}, timeout_s=timeout_s)["experiment"]
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            return {"uri": redact(uri), "error": f"HTTP {e.code} from MLflow: it wants a login ({USER_VAR} and {PASSWORD_VAR}, "
                                                 f"or {TOKEN_VAR}), and this one was refused or missing"}
        if e.code != 404:
            return {"uri": redact(uri), "error": f"HTTP {e.code} from MLflow"}
        exp = None
    except (OSError, ValueError) as e:
        return {"uri": redact(uri), "error": f"unreachable ({type(e).__name__}: {redact(str(e))[:160]})"}
    out["link"] = experiment_link(uri, exp["experiment_id"] if exp else None)
    try:
        if exp is not None:
            runs = rest(uri, "runs/search", body={"experiment_ids": [exp["experiment_id"]], "max_results": 1,
                                                  "filter": "tags.`dvi.role` = 'trainer'", "order_by": ["attributes.start_time DESC"]},
                        timeout_s=timeout_s).get("runs") or []
            if runs:
                info, data = runs[0]["info"], runs[0].get("data", {})
                out["trainer"] = {"run_id": info["run_id"], "run_name": info.get("run_name"), "status": info.get("status"),
                                  "metrics": {m["key"]: {"value": m.get("value"), "step": m.get("step", 0), "time": m.get("timestamp", 0) / 1000}
                                              for m in data.get("metrics", [])}}
        found = rest(uri, "model-versions/search", {"filter": f"name='{cfg.registry_model}'", "max_results": 200},
                     timeout_s=timeout_s).get("model_versions") or []
        versions = []
        for mv in sorted(found, key=lambda v: int(v["version"]), reverse=True):
            tags = {t["key"]: t["value"] for t in mv.get("tags", [])}
            versions.append({"version": tags.get(VERSION_TAG, f"v{mv['version']}"), "number": int(mv["version"]),
                             "created": int(mv.get("creation_timestamp", 0)) / 1000, "tags": tags})
        names = {str(v["number"]): v["version"] for v in versions}
        model = rest(uri, "registered-models/get", {"name": cfg.registry_model}, timeout_s=timeout_s)["registered_model"] if versions else {}
        out["versions"] = versions
        out["aliases"] = {a["alias"]: names.get(str(a["version"]), f"v{a['version']}") for a in model.get("aliases", [])}
    except (OSError, ValueError, KeyError) as e:
        out["error"] = f"incomplete answer ({type(e).__name__}: {redact(str(e))[:160]})"
    return out
