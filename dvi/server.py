"""A serving replica (`dvi serve`): the engine behind a request queue, its decision log, hot swaps and metrics.

`Service` owns four threads around one `SpeculativeEngine`:

- **decode**: takes up to `serve.max_batch` waiting requests, decodes them together (static batches: a request
  arriving mid-batch waits for the next one), fulfils their futures, feeds `ServingMetrics`, and hands each
  request's DecisionRecords to the non-blocking producer;
- **swap**: follows `stream.control_topic`; a `drafter_published` drafter is checked and loaded off the decode
  thread (`dvi.swap.load_announced`) and swapped in between rounds; after `serve.swap.window_tokens` drafted
  tokens the live check (`dvi.swap.judge`) either promotes it (MLflow alias `production`) or swaps the previous
  drafter back, tags the version rejected in the registry and announces `drafter_rejected` to trainers and the
  other replicas (which then roll back too); refusals are logged and counted, the current drafter keeps serving;
- **tracking**: every `serve.metrics_every_s` the interval's metrics go to this replica's MLflow run, and every
  `serve.plot_every_s` a drift plot (acceptance and tokens/s over time, swap markers) as an artifact;
- the HTTP server itself (uvicorn, `dvi.api`).

A broker or MLflow that is down never stops serving: the producer drops and counts, the swap thread keeps
trying to reach the control topic, the tracker buffers. This module wires the parts; it does not know the
maths (dvi.speculative), the HTTP shapes (dvi.api) or Kafka's and MLflow's clients (streams/, trainers/).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import signal
import queue
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dvi.config import DviConfig
from dvi.engine import Request, Result, SpeculativeEngine
from dvi.errors import DviError
from dvi.metrics import ServingMetrics, drift_plot
from dvi.models import Drafter, Pair
from dvi.swap import Announcement, Refused, judge, load_announced
from streams.control import PROMOTED, PUBLISHED, REJECTED

log = logging.getLogger("dvi.server")


@dataclass
class Job:
    request: Request
    domain: str | None
    on_tokens: Callable[[list[int]], None] | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class Rollout:
    """A swapped-in drafter on trial: counts of its own and of the drafter it replaced."""

    drafter: Drafter
    previous: Drafter | None
    previous_counts: tuple[int, int] | None  # (drafted, accepted) of the previous drafter
    start_counts: tuple[int, int]  # the new drafter's counts at the swap (non-zero if it served before)


class Service:
    """One serving replica (see the module docstring). `start()`, then `submit` from any thread; `close()`."""

    def __init__(self, cfg: DviConfig, pair: Pair, *, producer=None, tracker=None, control: bool = True):
        from streams.producer import default_replica_id

        self.cfg = cfg  # no reference to `pair` is kept: its drafter is freed once newer ones have replaced it
        self.tokenizer = pair.tokenizer
        self.defaults = cfg.serve.sampling
        self.model_name = pair.target_dir.name
        self.replica_id = cfg.stream.replica_id or default_replica_id()
        self.api_key = cfg.serve.api_key or os.environ.get("DVI_API_KEY") or None
        self.store_root = _store_root(cfg)
        self.metrics = ServingMetrics()
        self.producer, self.tracker, self.control = producer, tracker, control
        stop_ids = {pair.tokenizer.eos_token_id} if pair.tokenizer.eos_token_id is not None else set()
        self.engine = SpeculativeEngine(pair.target, pair.drafter, cfg.serve.spec, stop_ids=stop_ids, max_batch=cfg.serve.max_batch)
        self.rejected: set[str] = set()
        self.rollout: Rollout | None = None
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=cfg.serve.max_queue)
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._decoding: list[Job] = []  # the batch the decode thread is on
        self._threads: list[threading.Thread] = []
        self._swap_lock = threading.Lock()
        self._initial_drafter(configured=pair.drafter is not None)
        self.metrics.serving(self._version())

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Service:
        loops = [("dvi-decode", self._decode_loop), ("dvi-tracking", self._tracking_loop)]
        if self.control and self.cfg.serve.swap.enabled:
            loops.append(("dvi-swap", self._swap_loop))
        for name, target in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def drain(self, grace_s: float) -> int:
        """Take no new requests; give the queued and decoding ones `grace_s` seconds to finish; fail the rest with a
        clear error, so that a streamed answer ends with an error event and a plain one with a 503, never cut short
        as if complete. Returns how many were failed."""
        self._draining.set()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self._queue.qsize() or self._decoding):
            time.sleep(0.05)
        error = DviError(f"the server is shutting down: the request did not finish within serve.drain_s={grace_s:g} s")
        unfinished = [j for j in list(self._decoding) + self._take_queued() if not j.future.done()]
        for job in unfinished:
            job.future.set_exception(error)
        if unfinished:
            self.engine.abort()  # the decode thread leaves the model at the next round, before the process exits
        return len(unfinished)

    def _take_queued(self) -> list[Job]:
        jobs = []
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                return jobs

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        for job in self._take_queued():  # requests still queued get an answer, not silence
            if not job.future.done():
                job.future.set_exception(DviError("the server is shutting down"))
        if self.tracker is not None:
            self._log_interval()
            self.tracker.close(timeout_s)
        if self.producer is not None:
            self.producer.close(timeout_s)

    # -- requests --------------------------------------------------------------------------------

    def request(self, c) -> Request:
        """An engine request from a parsed completion (`dvi.api.Completion`); DviError when the engine refuses it."""
        from dvi.cli import encode_prompt

        if c.messages is not None:
            enc = self.tokenizer.apply_chat_template(c.messages, add_generation_prompt=True, tokenize=True)
            ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        elif isinstance(c.prompt, list):
            ids = list(c.prompt)
        else:
            ids = encode_prompt(self.tokenizer, c.prompt, raw=True)
        req = Request(ids, max_new_tokens=c.max_tokens, temperature=c.temperature, top_p=c.top_p, seed=c.seed)
        self.engine.check_request(req)
        return req

    def submit(self, req: Request, domain: str | None = None, on_tokens: Callable[[list[int]], None] | None = None) -> Job:
        """Queue a request; its `future` resolves to the engine's Result. ApiError 503 when the queue is full."""
        from dvi.api import ApiError

        if self._stop.is_set() or self._draining.is_set():
            raise ApiError(503, "the server is shutting down", kind="server_error")
        job = Job(req, domain, on_tokens)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise ApiError(503, f"{self._queue.maxsize} requests are already waiting; retry later", kind="server_error") from None
        return job

    def extension(self, result: Result) -> dict:
        """The `dvi` field of a response: which drafters drafted for it, and how well."""
        return {"request_id": result.request_id, "drafter_version": result.drafter_versions[-1] if result.drafter_versions else None,
                "drafter_versions": result.drafter_versions, "replica_id": self.replica_id, "stats": result.stats.to_dict(),
                "seconds": round(result.seconds, 4)}

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "replica_id": self.replica_id, "pid": os.getpid(), "queue_depth": self._queue.qsize(),
                "rollout": self.rollout.drafter.version if self.rollout else None, "rejected": sorted(self.rejected),
                "records": self.producer.stats.to_dict() if self.producer is not None else None, **self.metrics.snapshot()}

    def prometheus(self) -> str:
        producer = self.producer.stats.to_dict() if self.producer is not None else None
        return self.metrics.prometheus(producer, self._queue.qsize())

    # -- decode thread ---------------------------------------------------------------------------

    def _decode_loop(self) -> None:
        while not self._stop.is_set():
            try:
                jobs = [self._queue.get(timeout=0.2)]
            except queue.Empty:
                continue
            while len(jobs) < self.cfg.serve.max_batch:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._decode(jobs)

    def _decode(self, jobs: list[Job]) -> None:
        def emit(i: int, ids: list[int]) -> None:
            if jobs[i].on_tokens is not None and ids:
                try:
                    jobs[i].on_tokens(ids)
                except Exception:  # a client gone away must not stop the batch
                    log.debug("streaming callback failed", exc_info=True)

        self._decoding = jobs
        try:
            results = self.engine.generate([j.request for j in jobs], on_tokens=emit)
        except Exception as e:
            if self._draining.is_set():
                log.info("decoding stopped for shutdown: %s", e)
            else:
                log.exception("decoding a batch of %d requests failed", len(jobs))
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(e)
            return
        finally:
            self._decoding = []
        for job, result in zip(jobs, results):
            self.metrics.observe(result, job.domain)
            self._log_decisions(job, result)
            if not job.future.done():  # a drain may have failed it already
                job.future.set_result(result)

    def _log_decisions(self, job: Job, result: Result) -> None:
        if self.producer is None:
            return
        from dvi.events import records_from_result

        s = self.cfg.stream
        try:
            records = records_from_result(result, replica_id=self.replica_id, target_name=self.model_name,
                                          vocab_size=self.engine.vocab_size, sampling=job.request, domain=job.domain,
                                          chunk_rounds=s.chunk_rounds, topk=s.topk)
        except DviError as e:
            log.warning("request %s: no decision record: %s", result.request_id, e)
            return
        for record in records:
            self.producer.submit(record)

    # -- drafters --------------------------------------------------------------------------------

    def _version(self) -> str | None:
        d = self.engine.drafter
        return d.version if d is not None else None

    def _initial_drafter(self, configured: bool) -> None:
        """serve.swap.initial: the store's production version (production: the newest kept by live traffic, else the
        newest never rejected), the newest never rejected (latest), a named one, or the configured drafter (none)."""
        from dvi import store
        from dvi.files import sha256_file

        choice = self.cfg.serve.swap.initial
        if choice == "none" or not configured:
            return
        automatic = choice in ("production", "latest")
        version = store.serving_version(self.store_root, prefer_production=choice == "production") if automatic else choice
        if version is None:
            return
        self.rejected |= {v for v, verdict in store.verdicts(self.store_root).items() if verdict == store.REJECTED}
        path = self.store_root / version
        if not (path / store.SUMS).is_file():
            raise DviError(f"serve.swap.initial={choice}: no published drafter {version} in the store {self.store_root}")
        ann = Announcement(version, str(path), sha256_file(path / store.SUMS))
        try:
            drafter = load_announced(ann, self.store_root, self.engine.target, self.cfg.serve.swap.smoke_tokens, self.engine.target.dtype)
        except Refused as e:
            if not automatic:
                raise
            log.warning("not serving the store's drafter %s: %s; serving %s", version, e, self._version())
            self.metrics.event(f"refused:{e.reason}", version)
            return
        self.engine.swap_drafter(drafter)
        log.info("serving drafter %s from the store %s", version, self.store_root)

    def on_control(self, msg: dict) -> None:
        """Act on one control message (the swap thread calls it; tests may too)."""
        kind = msg.get("type")
        if kind == PUBLISHED:
            try:
                self.install(Announcement.of(msg))
            except Refused as e:
                self.metrics.event(f"refused:{e.reason}", msg.get("version") if isinstance(msg.get("version"), str) else None)
                log.warning("refused a published drafter (%s): %s; still serving %s", e.reason, e, self._version())
        elif kind == REJECTED and isinstance(msg.get("version"), str):
            version = msg["version"]
            self.rejected.add(version)
            if msg.get("replica_id") != self.replica_id and self._version() == version:
                self._roll_back(f"rejected by replica {msg.get('replica_id')}", announce=False)

    def install(self, ann: Announcement) -> bool:
        """Check, load and swap in an announced drafter; False when it is already serving or was rejected."""
        if ann.version in self.rejected or ann.version == self._version():
            log.info("ignoring drafter %s: %s", ann.version, "rejected before" if ann.version in self.rejected else "already serving")
            return False
        t0 = time.perf_counter()
        drafter = load_announced(ann, self.store_root, self.engine.target, self.cfg.serve.swap.smoke_tokens, self.engine.target.dtype)
        with self._swap_lock:
            previous = self.engine.drafter
            # the baseline is the previous drafter on the latest traffic, as much of it as the new one is judged on:
            # its lifetime figure would hold it to traffic that has since drifted away
            window = self.cfg.serve.swap.window_tokens
            prev_counts = self.metrics.recent_acceptance_of(previous.version, window) if previous is not None else None
            self.engine.swap_drafter(drafter)  # takes effect at the next round boundary
            self.rollout = Rollout(drafter, previous, prev_counts, self.metrics.acceptance_of(drafter.version))
        self.metrics.serving(drafter.version)
        self.metrics.event("swap", drafter.version)
        log.info("swapped in drafter %s (was %s), checked and loaded in %.2f s", drafter.version,
                 previous.version if previous else None, time.perf_counter() - t0)
        return True

    def check_rollout(self) -> str | None:
        """Judge the drafter on trial (see dvi.swap.judge); returns the decision once there is one."""
        with self._swap_lock:
            r = self.rollout
            if r is None:
                return None
            drafted, accepted = self.metrics.acceptance_of(r.drafter.version)
            current = (drafted - r.start_counts[0], accepted - r.start_counts[1])
            sw = self.cfg.serve.swap
            decision = judge(r.previous_counts, current, sw.window_tokens, sw.baseline_tokens, sw.rollback_margin)
        if decision == "keep":
            self.rollout = None
            self.metrics.event("promote", r.drafter.version)
            log.info("drafter %s kept: acceptance %.3f over %d drafted tokens", r.drafter.version, current[1] / current[0], current[0])
            if self.tracker is not None:
                self.tracker.set_alias(r.drafter.version, "production")
            self._announce(PROMOTED, version=r.drafter.version, acceptance=current[1] / current[0])
        elif decision == "rollback":
            prev = r.previous_counts
            why = (f"live acceptance {current[1] / current[0]:.3f} over {current[0]} drafted tokens is more than "
                   f"{self.cfg.serve.swap.rollback_margin} below {r.previous.version if r.previous else None}'s {prev[1] / prev[0]:.3f}")
            self._roll_back(why, announce=True)
        return decision

    def _roll_back(self, why: str, announce: bool) -> None:
        with self._swap_lock:
            r, self.rollout = self.rollout, None
            current = self.engine.drafter
            if current is None or r is None or r.drafter is not current:
                return
            self.engine.swap_drafter(r.previous)
        version = current.version
        self.rejected.add(version)
        self.metrics.serving(r.previous.version if r.previous else None)
        self.metrics.event("rollback", version)
        log.warning("rolled back drafter %s to %s: %s", version, r.previous.version if r.previous else None, why)
        if self.tracker is not None:
            self.tracker.tag_version(version, {"dvi.rejected": "true", "dvi.rejected_reason": why[:500], "dvi.rejected_by": self.replica_id})
        if announce:
            self._announce(REJECTED, version=version, previous=r.previous.version if r.previous else None, reason=why)

    def _announce(self, kind: str, **fields) -> None:
        """Tell trainers and the other replicas what this replica decided (a broker that is down: logged)."""
        if not self.control:
            return
        from streams.control import send

        try:
            send(self.cfg.stream, kind, replica_id=self.replica_id, **fields)
        except DviError as e:
            log.warning("could not announce %s of %s: %s", kind, fields.get("version"), e)

    # -- swap thread -----------------------------------------------------------------------------

    def _swap_loop(self) -> None:
        from streams.control import ControlReader
        from streams.topics import ensure_topics

        reader, warned = None, False
        while not self._stop.is_set():
            if reader is None:
                try:
                    # a reader assigned to a topic that does not exist yet starts at its end once it appears,
                    # after the messages that created it: create the topics first, as the trainer does
                    ensure_topics(self.cfg.stream)
                    reader = ControlReader(self.cfg.stream, client_id=f"dvi-serve-{self.replica_id}")
                    warned = False
                except DviError as e:
                    if not warned:
                        log.warning("hot swap waits for the control topic: %s (retrying every 5 s)", e)
                        warned = True
                    self._stop.wait(5.0)
                    continue
            try:
                for msg in reader.poll(timeout_s=0.5):
                    self.on_control(msg)
                self.check_rollout()
            except Exception:  # a bug or a broken client: log, reconnect, keep serving
                log.exception("the swap loop failed; reconnecting to the control topic")
                try:
                    reader.close()
                except Exception:
                    pass
                reader = None
                self._stop.wait(1.0)
        if reader is not None:
            reader.close()

    # -- tracking thread -------------------------------------------------------------------------

    def _tracking_loop(self) -> None:
        s = self.cfg.serve
        next_plot = time.monotonic() + s.plot_every_s
        while not self._stop.wait(s.metrics_every_s):
            self._log_interval()
            if time.monotonic() >= next_plot:
                next_plot = time.monotonic() + s.plot_every_s
                self.plot()

    def _log_interval(self) -> None:
        metrics = self.metrics.interval()
        if self.tracker is not None:
            if self.producer is not None:
                st = self.producer.stats
                metrics.update({"records/sent": st.sent, "records/dropped": st.dropped})
            self.tracker.log_metrics(metrics, step=int(time.time() - self.metrics.started))

    def plot(self) -> Path | None:
        """Render the drift plot to a fresh `drift.png`; when tracking, queue it as the run's artifact `plots/drift.png`."""
        path = Path(tempfile.mkdtemp(prefix="dvi-drift-")) / "drift.png"
        try:
            drift_plot(list(self.metrics.series), list(self.metrics.markers), str(path), f"dvi serving: replica {self.replica_id}")
        except Exception:
            log.exception("drift plot failed")
            return None
        if self.tracker is not None:
            self.tracker.log_artifact(str(path), "plots", remove=True)
        return path


def draining_server(config, service: Service, grace_s: float):
    """A uvicorn server that, on the first SIGINT / SIGTERM, drains the service (`Service.drain`) before it shuts
    down: requests in flight finish or end with an error, never cut off as if complete. A second signal stops at once."""
    import uvicorn

    class _Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                return super().handle_exit(sig, frame)
            self.draining = True

            def drain() -> None:
                failed = service.drain(grace_s)
                if failed:
                    log.warning("shutting down: %d request(s) still unfinished after %g s ended with an error", failed, grace_s)
                uvicorn.Server.handle_exit(self, sig, frame)

            threading.Thread(target=drain, name="dvi-drain", daemon=True).start()

    return _Server(config)


def _store_root(cfg: DviConfig) -> Path:
    """The only directory this replica loads drafters from: `serve.swap.store`, or the trainer's store."""
    from dvi import store

    return (Path(cfg.serve.swap.store).expanduser() if cfg.serve.swap.store else store.default_root(cfg)).resolve()


# ----------------------------------------------------------------------------------------------
# dvi serve


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from dvi.api import create_app
    from dvi.cli import overrides_of
    from dvi.config import load_config
    from dvi.models import resolve_pair

    cfg = load_config(overrides_of(args))
    if cfg.stream.topk > cfg.serve.spec.topk_logprobs:
        raise DviError(f"stream.topk={cfg.stream.topk} needs serve.spec.topk_logprobs >= {cfg.stream.topk}")
    producer = tracker = None
    if cfg.serve.log_decisions:
        from streams.client import quiet_kafka_logs
        from streams.producer import DecisionProducer

        quiet_kafka_logs(args.verbose)
        producer = DecisionProducer(cfg.stream)
    # no reference to the pair here: once a newer drafter is swapped in, the configured one can be freed
    service = Service(cfg, resolve_pair(cfg.model, with_drafter=not args.no_draft), producer=producer)
    if cfg.tracking.enabled:
        from dvi.config import flat_params
        from trainers.tracking import Tracker

        service.tracker = Tracker(cfg.tracking, run_name=f"serve-{service.replica_id}", params=flat_params(cfg),
                                  tags={"dvi.role": "serve", "dvi.replica": service.replica_id})
    service.start()
    app = create_app(service)
    server = draining_server(uvicorn.Config(app, host=cfg.serve.host, port=cfg.serve.port, log_level="warning",
                                           timeout_graceful_shutdown=5, access_log=False,
                                           limit_concurrency=cfg.serve.max_connections), service, cfg.serve.drain_s)
    print(f"dvi serve: http://{cfg.serve.host}:{cfg.serve.port}/v1 (model {service.model_name}, drafter "
          f"{service.metrics.version}, replica {service.replica_id}{', API key required' if service.api_key else ''}); "
          "Ctrl-C stops it", flush=True)
    # uvicorn handles SIGINT / SIGTERM (it returns once in-flight requests finish), then raises the signal again
    # for the handler it found: a no-op here, so that being stopped is a clean exit (status 0)
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        service.close()
    print("dvi serve: stopped", flush=True)
    return 0 if server.started else 1
