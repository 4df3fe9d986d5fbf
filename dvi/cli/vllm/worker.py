"""The part of dvi that runs inside vLLM's worker: it reads every verification and swaps the draft model's weights.

vLLM mixes this class into its worker (`worker_extension_cls`); `dvi.cli.vllm.engine` calls its methods through
the engine core's `collective_rpc`, from inside vLLM's engine-core process (dvi's loop runs there: no RPC server, no
HTTP route, nothing an API client can reach). It reads vLLM at a private interface, `GPUModelRunner._sample(logits,
spec_decode_metadata)` and the runner's `input_batch`, pinned to vLLM 0.32 (`dvi.cli.vllm.engine.VLLM_VERSION`):

- `dvi_capture(topk)` wraps `_sample`: for every step it keeps the batch's request ids, each request's drafted ids,
  the tokens the rejection sampler emitted (vLLM pads a row with -1 after a rejection; the row of a prefill chunk
  that is not the last, whose token vLLM discards, is all -1 here), and, from the logits the
  sampler verifies with (the target's, before any temperature or top-p; with a structured-output request's grammar
  applied, its forbidden tokens at `FORBIDDEN`), the `topk` most likely ids with their log-probs at every drafted and
  bonus position, and the log-prob of each emitted token;
- it also times each step's parts for the cost table that decides where drafting pays (`dvi.planner.StepPlanner`):
  wrapping the runner's `execute_model` (what the step scheduled: requests, tokens, drafts to verify, the K to
  propose, `SchedulerOutput.num_spec_tokens_to_schedule`) and `propose_draft_token_ids` (the seconds the drafter took);
- with `features` (an EAGLE-3 draft model), it keeps the target's aux hidden states of every token the step fed
  that stays in its request's sequence (`_features`): vLLM passes them to its drafter (`propose_draft_token_ids`'s
  `aux_hidden_states`, one [tokens, hidden] tensor per aux layer, in the order the drafter names its layers),
  at every step, drafting or not (K = 0 still runs the target with those outputs kept). A step's rows are its requests'
  scheduled tokens, request after request (the input batch's order): a prefill chunk's, or the last token and its
  drafts, of which the target's features stand for the accepted ones only;
- `dvi_sleep(flag)`: while set, a step that proposes no drafts skips the drafter's pass over its new tokens (vLLM
  runs it at K = 0 to keep the draft model's KV cache whole; it costs several percent of a step); the requests then
  in flight draft from a cache with holes when drafting comes back, which costs acceptance, never correctness;
- the steps kept since the last hand-over travel with each step's output (`ModelRunnerOutput`, under `CARRIED`: the
  runner's `sample_tokens` returns it once the step's drafts are proposed), which vLLM's queue pickles to the engine
  core anyway; `dvi_take()` hands them over where an output cannot carry them (none, or one vLLM delivers later: async
  scheduling). A call of its own cost a round trip through vLLM's queues at every step: 1.9 ms of an 18-ms step at
  batch 1 on a 2-core CPU, where the processes on either side spin for their turn. For the same reason the drafts the
  step proposed travel with it too (under `DRAFTS`, vLLM's `DraftTokenIds`) where vLLM's engine core asks for them
  right after the step (`take_draft_token_ids`, a call of its own at every step of a server that drafts, K = 0 too:
  without async scheduling, as on the CPU): `dvi.cli.vllm.engine` answers that call from the output;
- the log-probs are computed on vLLM's own thread, before its sampler: on a thread of their own, their torch ops
  started a second OpenMP team beside the one vLLM binds to the cores, and on a 2-core CPU the two spin-waited against
  each other (vLLM's server with the loop and no drafter ran 0.87x plain vLLM);
- `dvi_load_drafter(weights)` loads a state dict into the draft model (a layer drafter's, Hugging Face names; an
  EAGLE-3 drafter's checkpoint tensors, which vLLM's eagle3 model's `load_weights` maps: `fc`, `midlayer.*`, `norm`,
  `lm_head`, `d2t`), through vLLM's layer-wise reload (a plain `load_weights` fails where the CPU build has repacked
  linear weights). An EAGLE-3 draft model shares the target's embedding and has a rotary embedding, which its
  checkpoint does not hold: the reload puts their tensors back as they were, and its warning that they "failed to
  load" is dropped for such a load.

On vLLM's CPU build (no Triton), `dvi_capture` also replaces one of its kernels: the C++ stand-in for the rejection
sampler's `expand_kernel` writes into an int64 copy of its output, so a float tensor it expands (each request's
temperature and top-p, per drafted token) comes back uninitialized; a sampled request then verifies its drafts
against NaN or uniform probabilities, accepts none, and samples its recovered tokens from them (vLLM's own counters:
0 of 1,512 EAGLE-3 rounds accepted at temperature 0.7). `fix_cpu_expand` registers an implementation of any dtype
through vLLM's own kernel registry (`vllm.triton_utils.dispatcher.register_kernels`), in the worker dvi's loop runs in.

vLLM 0.32 has two model runners, and runs its Model Runner V2 by default where Triton is installed (every CUDA host);
this extension hooks the V1 runner. `select_v1_runner` sets `VLLM_USE_V2_MODEL_RUNNER=0` where nothing is set,
`runner_problem` says why a setting or a configuration that forces V2 cannot run the loop (an error at start), and
`dvi_capture` refuses a runner without the methods it wraps, before any request.

The logits of a step hold one row per drafted position and one bonus row per request, request after request
(`SpecDecodeMetadata.cu_num_sampled_tokens`); a step without drafts has one row per request. This module knows
vLLM's worker; it does not know dvi's records, requests or drafter versions.
"""

from __future__ import annotations

import inspect
import logging
import time

import torch

FORBIDDEN = -1e4  # the log-prob recorded for a token the request's constraints forbid (see _log_probs)
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # vLLM 0.32's layer-wise reload logs here
# the layers of vLLM's EAGLE-3 draft model that its checkpoint does not hold: the embedding it shares with the target,
# and the rotary embedding (buffers only)
EAGLE3_NOT_LOADED = frozenset({"VocabParallelEmbedding", "RotaryEmbedding"})
V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's choice of model runner: "0" selects the V1 runner this extension hooks
SELECTED = "DVI_SELECTED_V1_RUNNER"  # "1": dvi set V2_RUNNER (here, or in the vLLM process that started this one)
HOOKED = ("_sample", "execute_model", "propose_draft_token_ids", "sample_tokens", "input_batch")  # what dvi_capture reads
CARRIED = "dvi_steps"  # the attribute of a step's ModelRunnerOutput that carries the steps kept since the last hand-over
DRAFTS = "dvi_drafts"  # ... and the one that carries the drafts the step proposed, [vLLM's DraftTokenIds or None]


def select_v1_runner(env) -> bool:
    """Select vLLM's V1 model runner in `env` (a mutable mapping of environment variables) unless it names a runner
    already; True where dvi selected it (here, or in a parent process whose environment `env` inherited)."""
    if env.get(V2_RUNNER, "").strip():
        return env.get(SELECTED) == "1"
    env[V2_RUNNER], env[SELECTED] = "0", "1"
    return True


def runner_problem(env, vllm_config=None) -> str | None:
    """Why the loop cannot run on the model runner `env` (environment variables) and, given, vLLM's config select:
    None where it is the V1 runner."""
    value = env.get(V2_RUNNER, "").strip()
    if value not in ("", "0"):
        what = "asks for vLLM's Model Runner V2" if value.isdigit() else "is not 0 or 1"
        return (f"{V2_RUNNER}={value} {what}: dvi's loop hooks vLLM's V1 model runner (its worker extension wraps that "
                f"runner's sampler); unset it or set {V2_RUNNER}=0")
    if vllm_config is not None and vllm_config.use_v2_model_runner:
        return (f"this vLLM configuration runs Model Runner V2 whatever {V2_RUNNER} says (a feature that needs it, such "
                "as HiSparse attention or watermarking): dvi's loop hooks vLLM's V1 model runner")
    return None


class DviWorkerExtension:
    """Mixed into vLLM's worker (see the module docstring); `self.model_runner` and `self.vllm_config` are vLLM's."""

    def dvi_capture(self, topk: int, features: bool = False) -> bool:
        runner = self.model_runner
        if getattr(runner, "_dvi_sample", None) is not None:
            return False
        missing = [name for name in HOOKED if not hasattr(runner, name)]
        if missing:
            raise RuntimeError(f"dvi's worker extension hooks vLLM's V1 model runner; this worker runs "
                               f"{type(runner).__module__}.{type(runner).__qualname__}, which has no {', '.join(missing)} "
                               f"({V2_RUNNER}=0 selects the V1 runner)")
        fix_cpu_expand()
        original = runner._sample
        execute, propose, sample_tokens = runner.execute_model, runner.propose_draft_token_ids, runner.sample_tokens
        arguments = inspect.signature(propose).bind  # by name: vLLM passes them positionally
        self._dvi_steps: list[dict] = []
        self._dvi_meta: dict = {}
        self._dvi_features = bool(features) and bool(getattr(runner, "use_aux_hidden_state_outputs", False))
        # vLLM's engine core asks for a step's drafts right after it (without async scheduling): they ride on its output
        self._dvi_carry_drafts = (getattr(runner, "speculative_config", None) is not None
                                  and not getattr(runner, "use_async_scheduling", False))

        def _sample(logits, spec_decode_metadata):
            if logits is None:
                return original(logits, spec_decode_metadata)
            # on this thread, before the sampler (which may scale the logits in place): a second thread's torch ops
            # would start a second OpenMP team beside the one vLLM binds to the cores, and both would spin-wait
            log_p = _log_probs(logits.detach())  # [rows, vocabulary]
            out = original(logits, spec_decode_metadata)
            req_ids = list(runner.input_batch.req_ids)
            n = len(req_ids)
            if spec_decode_metadata is None:
                drafts, drafted = [0] * n, []
            else:
                drafts, drafted = list(spec_decode_metadata.num_draft_tokens), spec_decode_metadata.draft_token_ids.tolist()
            sampled = out.sampled_token_ids[:n].clone()  # [B, max drafts + 1], -1 after the last emitted token
            # a chunk of a prefill that is not finished samples a token that vLLM then throws away: none emitted
            discard = torch.from_numpy(runner.discard_request_mask.np[:n].copy()).to(sampled.device)
            sampled[discard] = -1
            self._dvi_steps.append(_step(log_p, sampled, req_ids, drafts, drafted, topk, self._dvi_meta))
            return out

        def execute_model(scheduler_output, *args, **kwargs):
            # a dict per step, read by the step's capture; propose_draft_token_ids adds its seconds to it
            self._dvi_meta = {"requests": len(scheduler_output.num_scheduled_tokens),
                              "tokens": scheduler_output.total_num_scheduled_tokens,
                              "verify_tokens": sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values()),
                              "proposed_k": scheduler_output.num_spec_tokens_to_schedule, "propose_s": 0.0}
            return execute(scheduler_output, *args, **kwargs)

        def propose_draft_token_ids(*args, **kwargs):
            if self._dvi_features and self._dvi_steps:
                try:
                    self._dvi_steps[-1]["features"] = _features(runner, arguments(*args, **kwargs).arguments, self._dvi_steps[-1])
                except Exception:  # the step and its records go on without features
                    logging.getLogger(__name__).exception("reading the target's features of a step failed")
            t0 = time.perf_counter()  # the drafter's time only: reading the features is the step's, drafting or not
            drafts = propose(*args, **kwargs)
            if isinstance(drafts, torch.Tensor) and drafts.is_cuda:
                torch.cuda.synchronize(drafts.device)  # kernels run asynchronously: time them, not their launch
            self._dvi_meta["propose_s"] += time.perf_counter() - t0
            return drafts

        def sample_tokens_(*args, **kwargs):
            out = sample_tokens(*args, **kwargs)
            carry(out, self)
            return out

        self._dvi_asleep = False
        proposer = getattr(runner, "drafter", None)
        if proposer is not None and hasattr(proposer, "propose"):
            propose_drafts = proposer.propose

            def skip_or_propose(*args, num_speculative_tokens, **kwargs):
                if self._dvi_asleep and num_speculative_tokens == 0:  # what the proposer returns at K = 0, without its pass
                    proposer.num_speculative_tokens, proposer._last_draft_probs = 0, None
                    nxt = kwargs["next_token_ids"]
                    return torch.empty(nxt.shape[0], 0, dtype=torch.int64, device=nxt.device)
                return propose_drafts(*args, num_speculative_tokens=num_speculative_tokens, **kwargs)

            proposer.propose = skip_or_propose
        runner._dvi_sample = _sample
        runner._sample = _sample
        runner.execute_model = execute_model
        runner.propose_draft_token_ids = propose_draft_token_ids
        runner.sample_tokens = sample_tokens_
        return True

    def dvi_sleep(self, asleep: bool) -> None:
        """Skip the drafter's pass at K = 0 (True) or run it again (False); see the module docstring."""
        self._dvi_asleep = bool(asleep)

    def dvi_take(self) -> list[dict]:
        """The steps kept since the last call, oldest first."""
        steps, self._dvi_steps = self._dvi_steps, []
        return steps

    def dvi_drafts(self) -> list | None:
        """[the drafts the last step proposed, as vLLM's engine core takes them after it (the runner's
        `take_draft_token_ids`: a DraftTokenIds, or None)]; None where the engine core does not ask for them after the
        step (no speculator, or async scheduling)."""
        if not self._dvi_carry_drafts:
            return None
        return [self.model_runner.take_draft_token_ids()]

    def dvi_load_drafter(self, weights: dict[str, torch.Tensor], eagle3: bool = False) -> float:
        """Load `weights` into the draft model (`eagle3`: an EAGLE-3 drafter's checkpoint tensors); returns the seconds
        it took."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        t0 = time.perf_counter()
        model = self.model_runner.get_draft_model()
        quiet = _NotLoaded(EAGLE3_NOT_LOADED) if eagle3 else None
        reload_log = logging.getLogger(RELOAD_LOGGER)
        if quiet is not None:
            reload_log.addFilter(quiet)
        try:
            with set_current_vllm_config(self.vllm_config):
                initialize_layerwise_reload(model)
                model.load_weights(iter(weights.items()))
                finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
        finally:
            if quiet is not None:
                reload_log.removeFilter(quiet)
        return time.perf_counter() - t0


class _NotLoaded(logging.Filter):
    """Drops vLLM's reload warning "<layer>: Failed to load weights" for the layers named, which no checkpoint of the
    draft model holds (their tensors are put back as they were)."""

    def __init__(self, layers: frozenset[str]):
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args and args[0] in self.layers)


def fix_cpu_expand() -> bool:
    """On vLLM's CPU build without Triton, replace its `expand_kernel` stand-in (see the module docstring) with one that
    expands tensors of any dtype; True if it did."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not current_platform.is_cpu():
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_tokens})
    return True


def expand_tokens(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
                  MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (the kernel's parameter name)
    """The rejection sampler's `expand_kernel`, in torch: request b's value (`input_val` [B], `replace_from` there
    replaced by `replace_to`) into its tokens' places of `output` [tokens] (cumulative counts `cu_num_tokens` [B])."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(counts.sum())] = values.repeat_interleave(counts)


def carry(output, extension: DviWorkerExtension) -> None:
    """The steps `extension` kept since the last hand-over onto `output`, a step's `ModelRunnerOutput` (`CARRIED`),
    and the drafts the step proposed where vLLM's engine core asks for them after it (`DRAFTS`, `dvi_drafts`): not onto
    vLLM's shared empty output, nor one it delivers later (async scheduling), which `dvi_take` hands over."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if type(output) is ModelRunnerOutput and output is not EMPTY_MODEL_RUNNER_OUTPUT:
        setattr(output, CARRIED, extension.dvi_take())
        drafts = extension.dvi_drafts()
        if drafts is not None:
            setattr(output, DRAFTS, drafts)


def carried(output) -> list[dict] | None:
    """The steps a worker's `ModelRunnerOutput` carried (`carry`), taken off it; None where it carried none."""
    steps = getattr(output, "__dict__", {}).pop(CARRIED, None)
    return steps if isinstance(steps, list) else None


def carried_drafts(output) -> list | None:
    """[the drafts] a worker's `ModelRunnerOutput` carried (`carry`: a DraftTokenIds or None), taken off it; None
    where it carried none (then vLLM's engine core asks the worker)."""
    drafts = getattr(output, "__dict__", {}).pop(DRAFTS, None)
    return drafts if isinstance(drafts, list) and len(drafts) == 1 else None


def _features(runner, arguments: dict, step: dict) -> list[tuple[int, torch.Tensor]] | None:
    """Per request of a captured step, in its order: (the position of its first row, its rows [n, layers x hidden] on the
    CPU): the target's aux hidden states of the tokens the step fed that stay in its sequence (a prefill chunk's every
    token; of the last token and its drafts, the last token and the accepted drafts). None when vLLM passed none."""
    aux = arguments.get("aux_hidden_states")
    scheduler_output = arguments.get("scheduler_output")
    if not aux or scheduler_output is None:
        return None
    counts = [int(scheduler_output.num_scheduled_tokens[r]) for r in step["req_ids"]]
    total = sum(counts)
    states = torch.cat([h[:total] for h in aux], dim=-1).to("cpu", copy=True)  # [tokens, layers x hidden]
    starts = torch.tensor(counts).cumsum(0) - torch.tensor(counts)
    positions = runner.positions[:total][starts.to(runner.positions.device)].tolist() if total else []
    out = []
    for i, (first, n) in enumerate(zip(starts.tolist(), counts)):
        k = step["num_draft"][i]
        emitted = sum(t >= 0 for t in step["sampled"][i])
        kept = n - k + (max(emitted - 1, 0) if k else 0)  # the drafts the target rejected are not in the sequence
        out.append((int(positions[i]), states[first : first + kept]))
    return out


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The target's log-probs at every verified row (float32). A token the request's constraints forbid (structured
    outputs mask its logit to -inf) has log-prob -inf: records carry finite log-probs, so it gets FORBIDDEN, far below
    any the target gives a token it may emit."""
    return torch.log_softmax(logits.float(), -1).clamp_(min=FORBIDDEN)


def _step(log_p: torch.Tensor, sampled: torch.Tensor, req_ids: list[str], drafts: list[int], drafted: list[int], topk: int,
          meta: dict) -> dict:
    """One captured step: the top-k log-probs at every verified row; `meta`, what the step scheduled and the proposer's
    seconds (filled in after the sampler, read once the step is over)."""
    top = log_p.topk(topk, -1) if topk else None
    return {
        "req_ids": req_ids,
        "num_draft": drafts,
        "drafted": drafted,
        "sampled": sampled.tolist(),
        "top_ids": top.indices.cpu() if top is not None else None,  # [sum(k + 1), topk]
        "top_logprobs": top.values.cpu() if top is not None else None,
        "meta": meta,
    }
