"""dvi's loop in vLLM's processes, once `dvi.cli.vllm.plugin` found it enabled (see that module): the hooks on vLLM's
executor, engine-core busy loop and shutdown, the replica that follows the engine core, the loop's HTTP view, and
what vLLM's API-server process adds (dvi's counters in its `/metrics`, the `/dvi/*` relay). It knows how vLLM 0.32
starts its engine core; the policies (what to log, what to serve) are the replica's.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import multiprocessing
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace

from dvi import busy
from dvi.cli import setup_logging
from dvi.cli.replicas import replica_channels
from dvi.cli.vllm.middleware import DviRequests, relayed_fields
from dvi.cli.vllm.plugin import NAME, OVERRIDES, PORT
from dvi.config import load_config
from dvi.errors import DviError
from dvi.pairs import resolve_pair
from dvi.procs import default_replica_id
from dvi.serving.replica import Replica, sends_features
from dvi.cli.vllm.engine import AOT_COMPILE, EXTENSION, VllmEngine, aot_compile_off, import_vllm
from dvi.cli.vllm.worker import SELECTED, V2_RUNNER, runner_problem, select_v1_runner
from streams.client import quiet_kafka_logs

log = logging.getLogger("dvi.cli.vllm.plugin")


def install() -> None:
    """In every vLLM process: the engine core's executor, busy loop and shutdown get dvi's hooks (they act only in the
    process that runs the engine core), and the API server's metrics registry dvi's collector. vLLM's V1 model runner
    is selected where nothing names one (`dvi.cli.vllm.worker.select_v1_runner`), and on vLLM's CPU build its
    ahead-of-time compiled artifact turned off where nothing sets it (`aot_compile_off`), before vLLM reads either."""
    select_v1_runner(os.environ)
    import_vllm()  # another release is one clear error here, before vLLM loads a model
    if aot_compile_off(os.environ):  # in the first vLLM process: its children inherit it
        log.warning("dvi's loop sets %s=0: vLLM's CPU build cannot load the ahead-of-time compiled artifact it saves, and "
                    "would compile again at every start (set the variable to choose otherwise)", AOT_COMPILE)
    from vllm.v1.engine.core import EngineCore, EngineCoreProc
    from vllm.v1.executor.abstract import Executor

    executor_init = Executor.__init__

    def __init__(self, vllm_config, *args, **kwargs):
        prepare(vllm_config)
        executor_init(self, vllm_config, *args, **kwargs)

    Executor.__init__ = __init__
    busy_loop = EngineCoreProc.run_busy_loop

    def run_busy_loop(self):
        try:
            follow(self)
        except BaseException as e:
            stop_server(e)
            raise
        return busy_loop(self)

    EngineCoreProc.run_busy_loop = run_busy_loop
    shutdown = EngineCore.shutdown

    def engine_shutdown(self):
        loop = getattr(self, "_dvi_loop", None)
        if loop is not None:
            loop.close()
        return shutdown(self)

    EngineCore.shutdown = engine_shutdown
    if os.environ.get(busy.ENV):  # dvi up's trainer takes turns on these cores
        park_idle_readers(os.environ[busy.ENV])
    if PORT in os.environ:
        try:
            from prometheus_client import REGISTRY

            REGISTRY.register(DviCollector(int(os.environ[PORT])))
        except Exception:  # vLLM's metrics go on without dvi's
            log.exception("dvi's metrics could not join vLLM's /metrics")


# how long one of vLLM's shared-memory queue readers spins after its last read before it sleeps until the next write
# wakes it, where a trainer takes turns on the same cores and serving is not stepping: longer than the gap between two
# steps of a CPU server (a few milliseconds), far shorter than vLLM's own second
READER_SPIN_S = 0.02


def park_idle_readers(directory: str, spin_s: float = READER_SPIN_S) -> None:
    """vLLM's readers of its shared-memory queues (the worker waiting for the engine core's next step, the engine core
    for the worker's output) spin on the queue, yielding the core between looks, for a second after their last read
    (`shm_broadcast.SpinCondition.busy_loop_s`) before they sleep until a write wakes them. While the trainer runs (its
    turn, when serving waits between two steps, or between requests) that spinning takes its cores: through a turn on
    two cores the trainer ran on 0.8 of a core beside a worker on 1.0. But a reader that sleeps within a step (the
    engine core waits for the worker's output through each forward, longer than `spin_s`) pays a wake-up through vLLM's
    notify socket at every step. So in each vLLM process (the queues are built after the plugins load) a reader spins
    as vLLM has it while serving is stepping (`dvi.busy.Serving` on `directory`: a request in flight and no trainer's
    turn), and `spin_s` at most otherwise (`benchmarks.readers` compares such a server with vLLM's own readers). A vLLM
    without that class keeps its own (said once)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError as e:
        log.warning("vLLM's shared-memory queue readers keep spinning for a second after each read (%s)", e)
        return
    init, wait = SpinCondition.__init__, SpinCondition.wait
    serving = busy.Serving(directory)

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, "is_reader", False):
            self.dvi_spin_s = (self.busy_loop_s, min(self.busy_loop_s, spin_s))  # (stepping, otherwise)

    def wait_(self, *args, **kwargs):
        spins = getattr(self, "dvi_spin_s", None)
        if spins is not None:
            self.busy_loop_s = spins[0] if serving(time.monotonic()) else spins[1]
        return wait(self, *args, **kwargs)

    SpinCondition.__init__, SpinCondition.wait = __init__, wait_


def stop_server(error: BaseException) -> None:
    """dvi's loop could not start in this engine core: say why, and stop the vLLM process that started it (SIGTERM,
    which vLLM's server takes while it starts up). The engine core is past its handshake by then, and vLLM 0.32's API
    server goes on waiting for an answer a dead engine never gives, neither listening nor exiting, so that a
    supervisor would wait out its start-up limit instead of restarting it at once."""
    parent = multiprocessing.parent_process()  # None, or not our parent any more: no vLLM process to stop
    if parent is None or parent.pid != os.getppid():
        log.error("dvi's loop could not start: %s", error)
        return
    log.error("dvi's loop could not start: %s; stopping vLLM's server (pid %d)", error, parent.pid)
    os.kill(parent.pid, signal.SIGTERM)


def prepare(vllm_config) -> None:
    """Before vLLM builds its workers: the V1 model runner checked (a setting or feature that asks for V2 is one clear
    error), dvi's worker extension, and with adaptive K a batch-size schedule (K up to the `num_speculative_tokens`
    vLLM was given) for the planner to rewrite."""
    problem = runner_problem(os.environ, vllm_config)
    if problem:
        raise DviError(problem)
    parallel = vllm_config.parallel_config
    if parallel.worker_extension_cls and parallel.worker_extension_cls != EXTENSION:
        raise DviError(f"dvi's vLLM plugin needs --worker-extension-cls {EXTENSION}; this server names "
                       f"{parallel.worker_extension_cls} (vLLM takes one)")
    parallel.worker_extension_cls = EXTENSION
    spec = vllm_config.speculative_config
    if spec is not None and spec.num_speculative_tokens_per_batch_size is None and _config().serve.spec.adaptive:
        spec.num_speculative_tokens_per_batch_size = [(1, vllm_config.scheduler_config.max_num_seqs, spec.num_speculative_tokens)]


def _config(core_config=None):
    """dvi's config from `DVI_LOOP_OVERRIDES`; given vLLM's config, its target, drafter and batch size replace dvi's."""
    raw = os.environ.get(OVERRIDES, "[]")
    try:
        overrides = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DviError(f"{OVERRIDES} must be a JSON list of overrides, e.g. '[\"stream.bootstrap_servers=host:9092\"]' ({e})") from None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise DviError(f"{OVERRIDES} must be a JSON list of strings, got {raw[:200]!r}")
    cfg = load_config(overrides)
    if core_config is None:
        return cfg
    spec = core_config.speculative_config
    drafter = getattr(getattr(spec, "draft_model_config", None), "model", None) if spec is not None else None
    model = replace(cfg.model, target=str(core_config.model_config.model), drafter=str(drafter) if drafter else cfg.model.drafter,
                    dtype=str(core_config.model_config.dtype).removeprefix("torch."))
    k = spec.num_speculative_tokens if spec is not None else cfg.serve.spec.k
    named = core_config.model_config.served_model_name  # vLLM's --served-model-name (the first), else its --model
    named = named[0] if isinstance(named, (list, tuple)) else named
    serve = replace(cfg.serve, engine="vllm-server", max_batch=core_config.scheduler_config.max_num_seqs,
                    served_model_name=named if named and named != core_config.model_config.model else cfg.serve.served_model_name,
                    spec=replace(cfg.serve.spec, k=min(cfg.serve.spec.k, k), k_max=k, k_min=min(cfg.serve.spec.k_min, k)))
    return replace(cfg, model=model, serve=serve)


def follow(core) -> None:
    """Before the engine core's busy loop: dvi's loop around it (see the module docstring). A configuration dvi cannot
    serve with is one clear error, and vLLM does not start."""
    setup_logging(verbose=False)  # dvi's decisions and waits at INFO, timestamped, on the engine core's stderr
    cfg = _config(core.vllm_config)
    replica_id = cfg.stream.replica_id or default_replica_id()  # dvi serve names it <host>-<port>
    cfg = replace(cfg, stream=replace(cfg.stream, replica_id=replica_id))
    quiet_kafka_logs(False)
    drafting = core.vllm_config.speculative_config is not None
    pair = resolve_pair(replace(cfg.model, device="cpu"), with_drafter=drafting, target_weights=False)
    engine = VllmEngine.attach(core, pair.target, pair.drafter, cfg.serve.spec, trial_tokens=cfg.serve.swap.window_tokens,
                               features=sends_features(cfg))
    channels = replica_channels(cfg, swaps=drafting, tags={"dvi.engine": "vllm-server"})
    replica = Replica(cfg, pair, **channels, engine=engine).start(decode=False)
    loop = _Loop(replica)
    core._dvi_loop = loop
    log.warning("dvi's loop follows this vLLM server: replica %s, drafter %s, records to %s at %s%s; vLLM's V1 model runner%s",
                replica_id, replica.metrics.version, cfg.stream.topic, cfg.stream.bootstrap,
                f", its view on 127.0.0.1:{loop.port}" if loop.port else "",
                f" ({V2_RUNNER}=0 set by dvi: its worker extension hooks that runner)" if os.environ.get(SELECTED) == "1" else "")


class _Loop:
    """The replica that follows the engine core, and the HTTP view of it on 127.0.0.1:$DVI_LOOP_PORT."""

    def __init__(self, replica):
        self.replica = replica
        self.server = None
        self.port = int(os.environ.get(PORT, 0)) or None
        if self.port:
            try:
                self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), _handler(replica))
            except OSError as e:
                replica.close()
                raise DviError(f"dvi's loop cannot serve its view on 127.0.0.1:{self.port} ({PORT}): {e.strerror or e}; "
                               f"another process holds that port: set {PORT} to a free one (`dvi serve` chooses one)") from e
            self.server.daemon_threads = True
            threading.Thread(target=self.server.serve_forever, name="dvi-view", daemon=True).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        self.replica.close()


def answer_fields(answered: list[tuple[str, dict]], answer_id: str) -> list[dict]:
    """The `dvi` fields of the requests behind vLLM's answer `answer_id`, in the answer's choice order. vLLM 0.32 names
    the engine's request `<answer id>-<8 hex>`; a completion of several prompts gives prompt i `<answer id>-<i>-<8 hex>`,
    and n > 1 makes choice j of each `<j>_<that id>`."""
    own = re.compile(rf"(?:(\d+)_)?{re.escape(answer_id)}(?:-(\d+))?-[0-9a-f]{{8}}")
    found = []
    for request_id, fields in answered:
        m = own.fullmatch(request_id)
        if m:
            found.append(((int(m.group(2) or 0), int(m.group(1) or 0)), fields))
    return [fields for _, fields in sorted(found, key=lambda x: x[0])]


def _handler(replica):
    class View(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.startswith("/requests/"):  # an answer's dvi field (dvi.cli.vllm.middleware)
                fields = answer_fields(replica.answered(), urllib.parse.unquote(self.path.removeprefix("/requests/")))
                if not fields:
                    self.send_error(404)
                    return
                body, kind = json.dumps({"fields": fields}).encode(), "application/json"
            elif self.path == "/health":  # the replica's view, and the pid of vLLM's API server (which started this process)
                body, kind = json.dumps({**replica.health(), "server_pid": os.getppid()}, default=str).encode(), "application/json"
            elif self.path == "/metrics":
                body, kind = replica.prometheus().encode(), "text/plain; version=0.0.4"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # no access log
            pass

    return View


def view(port: int, path: str, timeout_s: float = 2.0) -> bytes:
    """The engine-core process's answer at `path` (the API server's relay)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
        return r.read()


class DviCollector:
    """A prometheus_client collector for vLLM's API-server process: dvi's counters, read from the engine-core process
    at each scrape of vLLM's `/metrics` (nothing when the loop does not answer)."""

    def __init__(self, port: int):
        self.port = port

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = view(self.port, "/metrics").decode()
        except (OSError, urllib.error.URLError):
            return
        # vLLM's own process metrics are already in its registry; dvi's copies of them would clash
        yield from (f for f in text_string_to_metric_families(text) if not f.name.startswith(("process_", "python_")))


class DviEndpoints:
    """vLLM's `vllm.endpoint_plugins` entry point: `/dvi/health` and `/dvi/metrics` on vLLM's own port, relayed from
    the engine-core process (enabled when `VLLM_PLUGINS` names `dvi` and DVI_LOOP_PORT is set)."""

    name = NAME
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        """The `/dvi/*` relay, and dvi's request middleware (dvi.cli.vllm.middleware.DviRequests) around vLLM's completions:
        the domain tag, the per-client cap, and, where the loop's view answers, each JSON answer's `dvi` field."""
        from fastapi import Response

        port = int(os.environ.get(PORT, 0))
        args = getattr(app.state, "args", None)  # vLLM's command line: its API key, where it has one
        app.add_middleware(DviRequests, fields=relayed_fields(view, port) if port else None,
                           cap=_config().serve.max_inflight_per_client,
                           keyed=bool(getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY")))

        def relay(path: str, kind: str):
            async def route() -> Response:
                if not port:
                    return Response(json.dumps({"error": f"{PORT} is not set: dvi's loop has no view here"}), 503,
                                    media_type="application/json")
                try:
                    body = await asyncio.get_running_loop().run_in_executor(None, view, port, path)
                except OSError as e:
                    return Response(json.dumps({"error": f"dvi's loop does not answer: {e}"}), 503, media_type="application/json")
                return Response(body, 200, media_type=kind)

            return route

        app.add_api_route("/dvi/health", relay("/health", "application/json"), methods=["GET"])
        app.add_api_route("/dvi/metrics", relay("/metrics", "text/plain; version=0.0.4"), methods=["GET"])

    async def init_state(self, engine_client, state, args) -> None:
        return None
