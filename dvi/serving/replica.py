"""A serving replica: the engine behind a request queue, its decision log, hot swaps and metrics.

`Replica` owns three threads around one engine (a `dvi.engine_api.Engine`), `dvi.engine.SpeculativeEngine`
(serve.engine=dvi):

- **decode** (after `start()` has measured the engine's cost table, `serve.spec.warmup_reps`): one continuously
  refilled batch (the engine's `Batch`): a waiting request joins at the next round boundary while fewer than
  `serve.max_batch` are decoding, and a finished one leaves in the round it finishes: its future is fulfilled,
  `ServingMetrics` fed and its DecisionRecords handed to the producer;
- **swap** (when handed a control channel): a `DrafterPublished` drafter is checked and loaded off the decode
  thread (`dvi.swap.load_announced`, for the configured drafter's kind: a replica serves versions of that kind only)
  and swapped in
  between rounds; after `serve.swap.window_tokens` drafted tokens the live check (`dvi.swap.judge`) either promotes
  it (MLflow alias `production`, `DrafterPromoted` on the control channel) or swaps the previous drafter back, tags
  the version rejected in the registry and announces `DrafterRejected` to trainers and the other replicas (which
  then roll back too); refusals are logged and counted, the current drafter keeps serving; each of these decisions
  is one line on `dvi.decision.serve`;
- **tracking**: every `serve.metrics_every_s` the interval's metrics go to the tracker, and every
  `serve.plot_every_s` a drift plot (acceptance and tokens/s over time, swap markers) as an artifact.

Handed an engine that another loop steps (`dvi.engine_api.FollowedEngine`; serve.engine=vllm-server: `VllmEngine.attach`
inside vLLM's own server, `dvi.cli.vllm`), the replica has no decode thread and no queue: the engine hands it each request vLLM starts (`adopt`) and each
Result (`finish`), which are measured and logged exactly as the decode thread's; swaps and tracking are the same.

The replica is handed its channels, each optional: `producer` (takes DecisionRecords without blocking, e.g.
`streams.producer.DecisionProducer`), `control` (`poll(timeout_s)` of `dvi.control` messages and `send(msg)`,
e.g. `streams.control.ControlChannel`) and `tracker` (`dvi.tracking.Tracker`). A channel that is down never
stops serving. This module wires the engine, the swap policy and the metrics; it does not know the maths
(dvi.speculative), HTTP (dvi.serving.api), or how the channels reach Kafka and MLflow.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from dvi import store
from dvi.busy import TurnWait
from dvi.config import DviConfig, api_key
from dvi.control import DrafterPromoted, DrafterPublished, DrafterRejected, Message
from dvi.eagle3 import Eagle3Drafter
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Engine, FollowedEngine, LogProb, Request, Result, TokenHook
from dvi.errors import DviError
from dvi.files import sha256_file
from dvi.hardware import Pick, pick_engine
from dvi.metrics import ServingMetrics, drift_plot
from dvi.models import LAYERS, Drafter, Pair, encode_chat, encode_prompt, end_ids, longest_token_chars
from dvi.procs import default_replica_id
from dvi.records import records_from_result
from dvi.swap import Refused, compare, judge, load_announced

log = logging.getLogger("dvi.serving.replica")
decisions = logging.getLogger("dvi.decision.serve")  # swaps, promotions, rollbacks, refusals: one line each


REJECTED_KEPT = 1024  # rejected version names a replica remembers
ANSWERED_KEPT = 4096  # followed requests whose `dvi` field the server that decoded them may still ask for (answered)


def sends_features(cfg) -> bool:
    """Whether the replica's records carry the target's features (an engine that computes them keeps them): its
    records go to the stream and a share of requests carries them (stream.features.share)."""
    return cfg.serve.log_decisions and cfg.stream.features.share > 0


class Unavailable(DviError):
    """The replica cannot take a request now (shutting down, or its queue is full): retry later."""


@dataclass
class Job:
    request: Request
    domain: str | None
    on_tokens: TokenHook | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: str = ""  # set by Replica.cancel: the decoding thread ends the request at the next round boundary
    # when it arrived, joined the batch, got its first and its latest tokens (time.perf_counter), and the gaps
    # between token emissions (seconds, tokens): its latencies as a client sees them (dvi_*_seconds histograms)
    arrived: float = field(default_factory=time.perf_counter)
    joined: float | None = None
    first: float | None = None
    last: float | None = None
    gaps: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class Rollout:
    """A swapped-in drafter on trial: counts of its own and of the drafter it replaced."""

    drafter: Drafter
    previous: Drafter | None
    previous_rounds: list[tuple[int, int]] | None  # the previous drafter's latest drafting rounds, (drafted, accepted)
    start_counts: tuple[int, int]  # the new drafter's (drafted, accepted) at the swap (non-zero if it served before)


class Replica:
    """One serving replica (see the module docstring). `start()`, then `submit` from any thread; `close()`."""

    def __init__(self, cfg: DviConfig, pair: Pair, *, producer=None, control=None, tracker=None, engine: FollowedEngine | None = None):
        self.cfg = cfg  # no reference to `pair` is kept: its drafter is freed once newer ones have replaced it
        self.tokenizer = pair.tokenizer
        self.defaults = cfg.serve.sampling
        self.model_name = cfg.serve.served_model_name or pair.target_dir.name
        self.replica_id = cfg.stream.replica_id or default_replica_id()
        self.api_key = api_key(cfg.serve)
        self.store_root = store.serving_root(cfg)
        self.metrics = ServingMetrics(max_domains=cfg.serve.max_domains, model_name=self.model_name)
        self.producer, self.tracker, self.control = producer, tracker, control
        stop_ids = end_ids(pair.target, pair.tokenizer)
        # the config every published layer drafter must match: the configured drafter's family, or the target's (an
        # EAGLE-3 version is checked against the target alone)
        layered = pair.drafter is not None and pair.drafter.kind == LAYERS
        self.family = pair.drafter.model.config if layered else pair.target.config
        # the kind of drafter this replica serves: the configured one's (vLLM sizes its draft model once, by method)
        self.drafter_kind = pair.drafter.kind if pair.drafter is not None else LAYERS
        self.engine: Engine
        if engine is not None:  # vLLM's own server steps it (dvi.cli.vllm.plugin): this replica follows its requests
            self.engine_kind = Pick("vllm", "vLLM's own server steps its engine (serve.engine=vllm-server)")
            self.engine = engine
            engine.adopt, engine.on_finish = self.adopt, self.finish
            self._turns = engine.turns  # its steps wait for the trainer's turns (dvi.busy)
        else:  # the replica decodes here, on dvi's engine
            self.engine_kind = pick_engine(cfg.serve.engine)
            if self.engine_kind.value != "dvi":
                why = f" ({self.engine_kind.why})" if cfg.serve.engine == "auto" else ""
                raise DviError(f"serve.engine={cfg.serve.engine} is vLLM's own server here{why}, which `dvi serve` starts with "
                               "dvi's loop as its plugin; a replica that decodes in this process runs serve.engine=dvi")
            self.engine = SpeculativeEngine(pair.target, pair.drafter, cfg.serve.spec, stop_ids=stop_ids, max_batch=cfg.serve.max_batch)
            self._turns = TurnWait.from_env(decisions)  # the decode loop's rounds wait for the trainer's turns (dvi.busy)
        window = self.engine.window - 1  # the longest prompt the engine takes: one token of room to answer
        self.max_prompt_tokens = min(cfg.serve.max_prompt_tokens or window, window)
        self._prompt_cap = self.max_prompt_tokens < window  # below the window (else the engine's own check says it)
        # a text longer than this cannot be a prompt of max_prompt_tokens tokens: refused before it is tokenized (the
        # bound vLLM's own server applies: tokens times the longest vocabulary entry)
        self.max_prompt_chars = self.max_prompt_tokens * longest_token_chars(self.tokenizer)
        self.rejected: OrderedDict[str, None] = OrderedDict()  # versions never to serve again, oldest first
        self._answered: OrderedDict[str, dict] = OrderedDict()  # followed requests' `dvi` fields, by request id, oldest first
        self._answered_lock = threading.Lock()
        # the target's features the records carried (dvi.features): requests, rows, and positions fed that had none (a
        # prefix-cache hit) or were given twice (a preempted request recomputed)
        self.features = {"requests": 0, "rows": 0, "bytes": 0, "missing": 0, "recomputed": 0}
        # the newest store version this replica has served, or found current in the store at start: an older one is a replay
        self.newest: str | None = None
        self.rollout: Rollout | None = None
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=cfg.serve.max_queue)
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._decoding: list[Job] = []  # the jobs in the running batch (replaced, never mutated: drain reads it)
        self._threads: list[threading.Thread] = []
        self._swap_lock = threading.Lock()
        self._initial_drafter(configured=pair.drafter is not None)
        self.metrics.serving(self._version())

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, decode: bool = True) -> Replica:
        """Measure the engine's cost table (`serve.spec.warmup_reps`; before the HTTP server answers, so no request
        waits behind it), then start the threads; `decode=False`: another loop steps the engine (vLLM's own server),
        and this replica follows its requests, swaps and tracks."""
        spec = self.cfg.serve.spec
        if spec.warmup_reps and spec.adaptive and spec.cost_ratio is None and self.engine_kind.value == "dvi":  # vLLM: from live steps
            try:
                log.info("cost table measured at start-up: %s", self.engine.warm_up(spec.warmup_reps))
            except Exception:  # adaptive K then learns the costs from live rounds only
                log.exception("measuring the cost table failed")
        loops = [("dvi-decode", self._decode_loop)] if decode else []
        loops.append(("dvi-tracking", self._tracking_loop))
        if self.control is not None and self.cfg.serve.swap.enabled:
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
        if self.control is not None:
            self.control.close()
        self.engine.close()  # after the decode thread has stopped: vLLM's engine holds its memory until shut down

    # -- requests --------------------------------------------------------------------------------

    def request(self, c) -> Request:
        """An engine request from a parsed completion (`dvi.serving.api.Completion`); DviError when the engine refuses it,
        or the prompt is longer than serve.max_prompt_tokens (a text too long to be that many tokens before tokenizing).
        Tokenizes: CPU work, for a worker thread."""
        chars = sum(len(m["content"]) for m in c.messages) if c.messages is not None else \
            len(c.prompt) if isinstance(c.prompt, str) else 0
        if chars > self.max_prompt_chars:
            raise DviError(f"prompt of {chars} characters is longer than a prompt of at most {self.max_prompt_tokens} tokens "
                           f"can be (serve.max_prompt_tokens, at most the context window less one; at most "
                           f"{self.max_prompt_chars} characters)")
        if c.messages is not None:
            try:
                ids = encode_chat(self.tokenizer, c.messages)  # special tokens in contents are text
            except DviError:
                raise
            except Exception as e:  # the template refuses the conversation (a role it does not know, an order it forbids)
                raise DviError(f"the model's chat template refused these messages: {type(e).__name__}: {str(e)[:200]}") from None
        elif isinstance(c.prompt, list):
            ids = list(c.prompt)
        else:
            ids = encode_prompt(self.tokenizer, c.prompt, raw=True, split_special_tokens=c.split_special_tokens)
        if self._prompt_cap and len(ids) > self.max_prompt_tokens:
            raise DviError(f"prompt of {len(ids)} tokens is longer than serve.max_prompt_tokens={self.max_prompt_tokens}")
        req = Request(ids, max_new_tokens=c.max_tokens, temperature=c.temperature, top_p=c.top_p, seed=c.seed,
                      ignore_eos=c.ignore_eos, min_tokens=min(c.min_tokens, c.max_tokens), logprobs=c.logprobs)
        self.engine.check_request(req)
        return req

    def submit(self, req: Request, domain: str | None = None, on_tokens: TokenHook | None = None) -> Job:
        """Queue a request; its `future` resolves to the engine's Result. `Unavailable` when shutting down or full."""
        if self._stop.is_set() or self._draining.is_set():
            raise Unavailable("the server is shutting down")
        job = Job(req, domain, on_tokens)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Unavailable(f"{self._queue.maxsize} requests are already waiting; retry later") from None
        return job

    def cancel(self, job: Job, reason: str = "abort") -> None:
        """End `job` at the next round boundary (its client went away, or a stop string was seen): its future
        resolves to the result so far, finish reason `reason`, and its decisions are logged as usual. Any thread."""
        if not job.future.done():
            job.cancelled = reason

    def extension(self, result: Result) -> dict:
        """The `dvi` field of a response: which drafters drafted for it, and how well."""
        return {"request_id": result.request_id, "drafter_version": result.drafter_versions[-1] if result.drafter_versions else None,
                "drafter_versions": result.drafter_versions, "replica_id": self.replica_id, "stats": result.stats.to_dict(),
                "seconds": round(result.seconds, 4)}

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "replica_id": self.replica_id, "pid": os.getpid(), "engine": self.engine_kind.value,
                "queue_depth": self._queue.qsize(),
                "rollout": self.rollout.drafter.version if self.rollout else None, "rejected": sorted(self.rejected),
                "control_refused": getattr(self.control, "invalid", None),  # control messages refused (unsigned, forged, ...)
                "records": self.producer.stats.to_dict() if self.producer is not None else None,
                "features": dict(self.features), "trainer_turns": self.turn_waits(), **self.metrics.snapshot()}

    def turn_waits(self) -> dict | None:
        """What serving gave the trainer's turns under dvi up's pause policy (`dvi.busy`): the turns its steps waited
        for and the seconds in all; None where it takes no turns."""
        if self._turns is None:
            return None
        return {"turns": self._turns.turns, "waited_s": round(self._turns.waited_s, 3)}

    def prometheus(self) -> str:
        producer = self.producer.stats.to_dict() if self.producer is not None else None
        return self.metrics.prometheus(producer, waiting=self._queue.qsize(), running=len(self._decoding))

    # -- decode thread ---------------------------------------------------------------------------

    def _decode_loop(self) -> None:
        """Continuous batching: waiting requests join the running batch at each round boundary while it has free
        slots (`serve.max_batch`); a finished request is answered, and its slot freed, in the round it finishes."""
        batch = self.engine.decoding()
        while not self._stop.is_set():
            if not batch.size:
                try:
                    self._join(batch, self._queue.get(timeout=0.2))
                except queue.Empty:
                    continue
            while batch.size < self.cfg.serve.max_batch:
                try:
                    self._join(batch, self._queue.get_nowait())
                except queue.Empty:
                    break
            if not batch.size:
                continue
            for job in self._decoding:
                if job.cancelled:
                    batch.cancel(job, job.cancelled)
            if self._turns is not None:
                self._turns.wait()  # between two rounds, while dvi up's trainer has its turn on the CPU (dvi.busy)
            try:
                finished = batch.step()
            except Exception as e:
                if self._draining.is_set():
                    log.info("decoding stopped for shutdown: %s", e)
                else:
                    log.exception("decoding a batch of %d requests failed", batch.size)
                for job in self._decoding:
                    if not job.future.done():
                        job.future.set_exception(e)
                self._decoding = []
                batch = self.engine.decoding()
                continue
            for job, result in finished:
                self._decoding = [j for j in self._decoding if j is not job]
                self._finish(job, result)
            self._log_routing()

    def _log_routing(self) -> None:
        """The engine's speculation routing decisions since the last step: counted, and one line per kind of decision
        (drafting on or off, with the batch sizes and the reason; probes, and the drafter's pass put to sleep or woken
        while drafting is off, at DEBUG: they come every few seconds)."""
        taken = self.engine.take_routing()
        if not taken:
            return
        by_kind: dict[str, list] = {}
        for routing, schedule in taken:
            by_kind.setdefault(routing.decision, []).append((routing, schedule))
        for kind, items in by_kind.items():
            first, schedule = items[0][0], items[-1][1]
            self.metrics.route(kind, schedule)
            sizes = _ranges(sorted({r.batch for r, _ in items}))
            if kind == "probe":
                decisions.debug("probe step at batch size %s: K=%d (%s)", sizes, first.k, first.why)
            elif kind in ("sleep", "wake"):
                decisions.debug("drafter pass %s: %s", "skipped" if kind == "sleep" else "running again", first.why)
            elif kind == "calibrate":
                decisions.info("measuring plain decoding first: %s", first.why)
            else:
                decisions.info("drafting %s at batch size %s%s: %s", kind, sizes, f" (K={first.k})" if first.k else "", first.why)

    @staticmethod
    def _emitter(job: Job) -> TokenHook:
        """What the engine calls with a request's new tokens: its latencies are noted, its client's callback called."""

        def emit(ids: list[int], logprobs: list[LogProb] | None) -> None:
            now = time.perf_counter()
            if job.first is None:
                job.first = now
            elif ids:
                job.gaps.append((now - job.last, len(ids)))
            job.last = now
            if job.on_tokens is not None and ids:
                try:
                    job.on_tokens(ids, logprobs)
                except Exception:  # a client gone away must not stop the batch
                    log.debug("streaming callback failed", exc_info=True)

        return emit

    def adopt(self, request: Request, domain: str | None, arrived: float) -> tuple[Job, TokenHook]:
        """A request that another loop (vLLM's own server) started decoding: followed as a job of this replica's
        (`arrived`: when it arrived, time.perf_counter). Returns the job and the hook for its tokens."""
        job = Job(request, domain, arrived=arrived)
        job.joined = time.perf_counter()
        self._decoding = self._decoding + [job]
        return job, self._emitter(job)

    def finish(self, job: Job, result: Result) -> None:
        """An adopted request finished: measured, logged, its decisions recorded (as for a request decoded here)."""
        self._decoding = [j for j in self._decoding if j is not job]
        self._finish(job, result)
        self._log_routing()
        with self._answered_lock:
            self._answered[result.request_id] = self.extension(result)
            while len(self._answered) > ANSWERED_KEPT:
                self._answered.popitem(last=False)

    def answered(self) -> list[tuple[str, dict]]:
        """The `dvi` fields of the last ANSWERED_KEPT followed requests (`finish`), by request id: what the server that
        decoded them adds to their answers (dvi.cli.vllm.middleware). Any thread."""
        with self._answered_lock:
            return list(self._answered.items())

    def _join(self, batch, job: Job) -> None:
        emit = self._emitter(job)
        if job.future.done():  # failed by a drain while it waited
            return
        if job.cancelled:  # its client went away while it waited: nothing was decoded, nothing to log
            job.future.set_exception(DviError(f"request {job.request.request_id} cancelled ({job.cancelled}) before it started"))
            return
        try:
            batch.add(job.request, key=job, on_tokens=emit)
        except DviError as e:
            job.future.set_exception(e)
            return
        job.joined = time.perf_counter()
        self._decoding = self._decoding + [job]

    def _finish(self, job: Job, result: Result) -> None:
        self.metrics.observe(result, job.domain)
        end = time.perf_counter()
        self.metrics.observe_latency(queued_s=(job.joined or end) - job.arrived, total_s=end - job.arrived, gaps=job.gaps,
                                     first_token_s=job.first - job.arrived if job.first is not None else None)
        self._log_decisions(job, result)
        if not job.future.done():  # a drain may have failed it already
            job.future.set_result(result)

    def _log_decisions(self, job: Job, result: Result) -> None:
        if self.producer is None:
            return
        s = self.cfg.stream
        try:
            records = records_from_result(result, replica_id=self.replica_id, target_name=self.model_name,
                                          vocab_size=self.engine.vocab_size, sampling=job.request, domain=job.domain,
                                          **s.record_args)
        except DviError as e:
            log.warning("request %s: no decision record: %s", result.request_id, e)
            return
        carried = [r.features for r in records if r.features is not None]
        if carried:
            f = self.features
            f["requests"] += 1
            f["rows"] += sum(x.rows for x in carried)
            f["bytes"] += sum(x.nbytes for x in carried)
            f["missing"] += result.features_missing
            f["recomputed"] += result.features_recomputed
        for record in records:
            self.producer.submit(record)

    # -- drafters --------------------------------------------------------------------------------

    def _version(self) -> str | None:
        d = self.engine.drafter
        return d.version if d is not None else None

    def _initial_drafter(self, configured: bool) -> None:
        """serve.swap.initial: the store's production version (production: the newest kept by live traffic, else the
        newest never rejected), the newest never rejected (latest), a named one, or the configured drafter (none).
        Automatic, a version that fails its checks is skipped, said and counted, for the next one
        (`store.serving_candidates`), and the configured drafter serves only when none passes, which the log says."""
        choice = self.cfg.serve.swap.initial
        for v, verdict in store.verdicts(self.store_root).items():
            if verdict == store.REJECTED:
                self._reject(v)
        # whatever this replica starts with, the store says which version is current: an announcement of an older
        # one, read first by a replica started later, is a replay, not news (`install` refuses it as stale)
        self.newest = store.serving_version(self.store_root, prefer_production=False)  # the newest never rejected
        if choice == "none" or not configured:
            return
        automatic = choice in ("production", "latest")
        candidates = store.serving_candidates(self.store_root, prefer_production=choice == "production") if automatic else [choice]
        for version in candidates:
            path = self.store_root / version
            if not (path / store.SUMS).is_file():
                raise DviError(f"serve.swap.initial={choice}: no published drafter {version} in the store {self.store_root}")
            try:
                drafter = self._load(DrafterPublished(version, str(path), sha256_file(path / store.SUMS)))
            except Refused as e:
                if not automatic:
                    raise
                decisions.warning("skipping the store's drafter %s: %s", version, e)
                self.metrics.event(f"refused:{e.reason}", version)
                continue
            self.engine.swap_drafter(drafter)
            if self.newest is None or store.older(self.store_root, self.newest, version):
                self.newest = version
            decisions.info("serving drafter %s from the store %s", version, self.store_root)
            return
        if candidates:
            decisions.warning("no drafter in the store %s passes its checks (%s tried): serving %s", self.store_root,
                              ", ".join(candidates), self._version())

    def _load(self, ann: DrafterPublished) -> Drafter | Eagle3Drafter:
        """The announced drafter, checked and loaded where this engine takes drafters from (or Refused): a version of
        the kind this replica serves (a layer drafter, or an EAGLE-3 one where it was started with one)."""
        drafter = load_announced(ann, self.store_root, self.engine.target, self.cfg.serve.swap.smoke_tokens,
                                 self.engine.target.dtype, self.family, device=self.engine.device, kind=self.drafter_kind)
        try:
            self.engine.check_drafter(drafter)
        except DviError as e:
            raise Refused("load", f"drafter {ann.version}: {e}") from None
        return drafter

    def on_control(self, msg: Message) -> None:
        """Act on one control message (the swap thread calls it; tests may too)."""
        if isinstance(msg, DrafterPublished):
            try:
                self.install(msg)
            except Refused as e:
                self.metrics.event(f"refused:{e.reason}", msg.version)
                decisions.warning("%s refused (%s): %s; still serving %s", msg.version, e.reason, e, self._version())
            except Exception as e:  # whatever else checking or loading it raised: refused too, for good, and said once
                self._reject(msg.version)
                self.metrics.event("refused:error", msg.version)
                decisions.warning("%s refused (error): %s: %s; still serving %s", msg.version, type(e).__name__,
                                  str(e)[:300], self._version(), exc_info=True)
        elif isinstance(msg, DrafterRejected):
            self._reject(msg.version)
            if msg.replica_id != self.replica_id and self._version() == msg.version:
                self._roll_back(f"rejected by replica {msg.replica_id}", announce=False)

    def _reject(self, version: str) -> None:
        """Never serve `version` again; the set keeps the newest REJECTED_KEPT names (older ones are not announced
        again: the trainer publishes new names)."""
        self.rejected.pop(version, None)
        self.rejected[version] = None
        while len(self.rejected) > REJECTED_KEPT:
            self.rejected.popitem(last=False)

    def install(self, ann: DrafterPublished) -> bool:
        """Check, load and swap in an announced drafter; False when it is already serving or was rejected."""
        if ann.version in self.rejected or ann.version == self._version():
            log.info("ignoring drafter %s: %s", ann.version, "rejected before" if ann.version in self.rejected else "already serving")
            return False
        if self.newest is not None and store.older(self.store_root, ann.version, self.newest):  # a signed old message again
            raise Refused("stale", f"drafter {ann.version} was published before {self.newest}, which this replica has served: "
                                   "a replayed or late announcement (a rollback is the replica's own, never an announcement)")
        t0 = time.perf_counter()
        drafter = self._load(ann)
        with self._swap_lock:
            previous = self.engine.drafter
            # the baseline is the previous drafter on the latest traffic, as much of it as the new one is judged on:
            # its lifetime figure would hold it to traffic that has since drifted away
            window = self.cfg.serve.swap.window_tokens
            prev_rounds = self.metrics.recent_rounds_of(previous.version, window) if previous is not None else None
            self.engine.swap_drafter(drafter)  # takes effect at the next round boundary
            self.rollout = Rollout(drafter, previous, prev_rounds, self.metrics.acceptance_of(drafter.version))
            self.newest = drafter.version
        self.metrics.serving(drafter.version)
        self.metrics.event("swap", drafter.version)
        decisions.info("%s swapped in (was %s), checked and loaded in %.2f s; on trial for %d drafted tokens", drafter.version,
                      previous.version if previous else None, time.perf_counter() - t0, window)
        return True

    def check_rollout(self) -> str | None:
        """Judge the drafter on trial (see dvi.swap.judge); returns the decision once there is one."""
        for version, why in self.engine.take_load_failures():
            self._load_failed(version, why)
        with self._swap_lock:
            r = self.rollout
            if r is None:
                return None
            trial = self.metrics.acceptance_of(r.drafter.version)[0] - r.start_counts[0]  # drafted since the swap
            current = self.metrics.recent_rounds_of(r.drafter.version, trial) if trial > 0 else []
            sw = self.cfg.serve.swap
            decision = judge(r.previous_rounds, current, sw.window_tokens, sw.baseline_tokens, sw.rollback_margin)
        if decision is None:
            return None
        drafted, accepted = sum(k for k, _ in current), sum(a for _, a in current)
        prev = r.previous_rounds if r.previous_rounds else None
        before, now = compare(prev, current) if prev else (0.0, accepted / drafted)
        at = " on first drafts (every round's, whatever its K)" if prev else ""
        before_s = f"{before:.3f}" if prev else "-"
        if decision == "keep":
            self.rollout = None
            self.metrics.event("promote", r.drafter.version)
            decisions.info("%s promoted: live acceptance %s -> %.3f%s (%s over %d drafted tokens, %s before it)",
                          r.drafter.version, before_s, now, at, r.drafter.version, drafted,
                          r.previous.version if r.previous else "no drafter")
            if self.tracker is not None:
                self.tracker.promote(r.drafter.version)  # alias production on it, candidate off it
            self._announce(DrafterPromoted(r.drafter.version, self.replica_id, acceptance=accepted / drafted))
        else:
            why = (f"live acceptance 0: live traffic accepted none of its {drafted} drafted tokens" if accepted == 0 else
                   f"live acceptance {now:.3f}{at} over {drafted} drafted tokens is more than "
                   f"{self.cfg.serve.swap.rollback_margin} below {r.previous.version if r.previous else None}'s {before_s}")
            self._roll_back(why, announce=True)
        return decision

    def _load_failed(self, version: str, why: str) -> None:
        """The engine could not load a drafter it was handed (and serves the previous one again): refused here, not
        announced (the fault may be this replica's)."""
        with self._swap_lock:
            if self.rollout is not None and self.rollout.drafter.version == version:
                self.rollout = None
        self._reject(version)
        self.metrics.serving(self._version())
        self.metrics.event("refused:load", version)
        decisions.warning("%s refused (load): %s; still serving %s", version, why, self._version())

    def _roll_back(self, why: str, announce: bool) -> None:
        with self._swap_lock:
            r, self.rollout = self.rollout, None
            current = self.engine.drafter
            if current is None or r is None or r.drafter is not current:
                return
            self.engine.swap_drafter(r.previous)
        version = current.version
        self._reject(version)
        self.metrics.serving(r.previous.version if r.previous else None)
        self.metrics.event("rollback", version)
        decisions.warning("%s rolled back to %s: %s", version, r.previous.version if r.previous else None, why)
        if self.tracker is not None:
            self.tracker.tag_version(version, {"dvi.rejected": "true", "dvi.rejected_reason": why[:500], "dvi.rejected_by": self.replica_id})
        if announce:
            self._announce(DrafterRejected(version, self.replica_id, reason=why, previous=r.previous.version if r.previous else None))

    def _announce(self, msg: Message) -> None:
        """Tell trainers and the other replicas what this replica decided (a channel that is down: logged)."""
        if self.control is None:
            return
        try:
            self.control.send(msg)
        except DviError as e:
            log.warning("could not announce %s of %s: %s", msg.kind, msg.version, e)

    # -- swap thread -----------------------------------------------------------------------------

    def _swap_loop(self) -> None:
        while not self._stop.is_set():
            try:
                for msg in self.control.poll(timeout_s=0.5):
                    self.on_control(msg)
                self.check_rollout()
            except Exception:  # a bug must not end hot swapping: log it and go on with the next message
                log.exception("the swap loop failed")
                self._stop.wait(1.0)

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
        self.metrics.speeds(self.engine.costs.speed_vs_target_only())
        metrics = self.metrics.interval()
        if self.tracker is not None:
            if self.producer is not None:
                st = self.producer.stats
                metrics.update({"records/sent": st.sent, "records/dropped": st.dropped,
                                **{f"features/{k}": v for k, v in self.features.items()}})
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


def _ranges(sizes: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    out, start = [], None
    for i, b in enumerate(sizes):
        if start is None:
            start = b
        if i + 1 == len(sizes) or sizes[i + 1] != b + 1:
            out.append(str(start) if start == b else f"{start}-{b}")
            start = None
    return ", ".join(out)
