"""The speculative decoding loop over Hugging Face causal LMs, for a continuously refilled batch of requests.

Each round: the drafter proposes K tokens (one cached forward each), the target verifies all of them plus
a bonus position in one forward, `dvi.speculative.rejection_sample` decides how many are accepted, and
both KV caches are rolled back to the accepted length. Rows of a batch accept different numbers of tokens;
rather than copying caches to re-align them, a rejected slot stays in the cache as a masked "hole"
(see `_KV`) and holes are squeezed out when they grow. A request joins a running batch between rounds (its
prompt is prefilled beside the others' verification, every existing slot a hole for it) and leaves it in the
round it finishes (`Decoding`). Greedy decoding is the temperature-0 case of the same rule and returns
exactly the target's greedy tokens.

The drafter is a layer drafter (a causal LM over the target's vocabulary or part of it) or an EAGLE-3 drafter
(`dvi.eagle3`), which drafts from the target's own features: the verify forward records the target's aux hidden
states, and each position the target kept is queued for the drafter beside the token after it (`_FeatureKV`); a
request drafts from its second round on (its prefill gives the first features), and drafts made on the drafter's own
features are dropped from its cache once verified, the target's replacing them, as vLLM's EAGLE-3 proposer does.

Adaptive K picks each row's K from its measured acceptance and a cost table measured on this machine
(`CostTable`: verify seconds per K and batch bucket, drafter step seconds; a start-up warm-up, then moving
averages of live rounds); a row whose drafts keep failing decodes plainly and probes now and then. Every tensor
of a round lives on the target's device; the random draws come from per-request CPU generators, so a seeded
request repeats on any device. There is no static KV cache and no CUDA graph here (yet): the CPU and CUDA run
the same code.

Per-round statistics and the target's top-k log-probs are returned as data (`Round`, `SpecStats`); this
module does not know where they go (streams, MLflow, /metrics), nor about tokenization or text.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from dvi.config import SpecConfig, check_sampling
from dvi.errors import DviError
from dvi.eagle3 import Eagle3Drafter, aux_hidden_states, target_features, target_ids
from dvi.features import Captured
from dvi.models import Drafter, cache_kwarg
from dvi.speculative import (
    acceptance_estimate,
    ban_tokens,
    batch_bucket,
    cheapest_k,
    choose_k_from_costs,
    expand_draft_probs,
    ideal_speedup,
    linear_verify_costs,
    logits_to_probs,
    moving_average,
    position_acceptance,
    rejection_sample,
    sample_from,
)


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # None: fresh entropy; an int makes a sampled run repeat exactly (with fixed K)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    logprobs: int | None = None  # the log-prob of each emitted token and this many top alternatives (Round.logprobs)
    ignore_eos: bool = False  # the engine's stop ids do not end generation (fixed-length benchmark requests)
    min_tokens: int = 0  # the stop ids cannot be generated before this many tokens (their target probability is 0)


MAX_LOGPROBS = 20  # the most alternatives a request may ask for (as OpenAI's API)


def check_request(r: Request, window: int, vocab_size: int, window_name: str = "the target's context window") -> None:
    """DviError unless an engine whose context holds `window` tokens can decode `r`."""
    if not r.prompt_ids:
        raise DviError("empty prompt: give at least one token")
    if len(r.prompt_ids) >= window:
        raise DviError(f"prompt of {len(r.prompt_ids)} tokens does not fit {window_name} of {window}")
    if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab_size:
        raise DviError(f"prompt token ids must be in [0, {vocab_size})")
    check_sampling(r.temperature, r.top_p, r.max_new_tokens)
    if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
        raise DviError(f"logprobs must be in [0, {MAX_LOGPROBS}] alternatives, got {r.logprobs}")
    if not 0 <= r.min_tokens <= r.max_new_tokens:
        raise DviError(f"min_tokens must be in [0, max_new_tokens={r.max_new_tokens}], got {r.min_tokens}")


LogProb = tuple[float, list[tuple[int, float]]]  # an emitted token's log-prob and its top alternatives (id, log-prob)
# streaming: called on the decoding thread after every round with the tokens a request gained in it, and their
# LogProbs if the request asked for them (else None)
TokenHook = Callable[[list[int], "list[LogProb] | None"], None]


@dataclass
class Round:
    """One verification decision for one request."""

    position: int  # tokens generated before this round
    k: int  # drafts that counted (0: decoded plainly)
    drafted: list[int]  # [k] drafted target ids
    accepted: int  # 0..k
    token: int  # the target's token after the accepted prefix: recovered (accepted < k) or bonus
    drafter_version: str | None
    topk_ids: torch.Tensor | None = None  # [k + 1, topk] target's top-k ids at each drafted and the bonus position
    topk_logprobs: torch.Tensor | None = None  # [k + 1, topk] their log-probs (temperature 1, unwarped)
    # for a request that asked for them: per emitted token (accepted drafts, then `token`), its log-prob and the
    # top alternatives as (id, log-prob), from the same unwarped distribution
    logprobs: list[LogProb] | None = None


@dataclass
class SpecStats:
    """Counts over rounds; mean accepted length counts the recovered / bonus token (see dvi.speculative)."""

    rounds: int = 0
    spec_rounds: int = 0  # rounds that drafted at least one token
    drafted: int = 0
    accepted: int = 0
    position_drafted: list[int] = field(default_factory=list)  # [j] rounds that drafted position j
    position_accepted: list[int] = field(default_factory=list)  # [j] rounds that accepted position j

    def add(self, k: int, n: int) -> None:
        self.rounds += 1
        self.spec_rounds += k > 0
        self.drafted += k
        self.accepted += n
        grow = k - len(self.position_drafted)
        if grow > 0:
            self.position_drafted += [0] * grow
            self.position_accepted += [0] * grow
        for j in range(k):
            self.position_drafted[j] += 1
            self.position_accepted[j] += j < n

    def merge(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        self.spec_rounds += other.spec_rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        for j, (d, a) in enumerate(zip(other.position_drafted, other.position_accepted)):
            if j >= len(self.position_drafted):
                self.position_drafted.append(0)
                self.position_accepted.append(0)
            self.position_drafted[j] += d
            self.position_accepted[j] += a

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per round, the recovered or bonus token included."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 6),
            "mean_accepted_length": round(self.mean_accepted_length, 6),
            "per_position_acceptance": [round(x, 6) for x in self.per_position_acceptance],
        }


@dataclass
class Result:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only (a stop token, if hit, is the last one)
    finish_reason: str  # "stop", "length", or the reason given to `Decoding.cancel` (e.g. "abort")
    drafter_versions: list[str]  # every drafter version that drafted for this request, in order
    rounds: list[Round]
    stats: SpecStats
    seconds: float
    # the target's aux hidden states (`dvi.features`) of positions features_start.. of prompt + token_ids, from the
    # forwards that verified them: [R, W], W = len(features_layers) x hidden; None where the engine kept none
    features: torch.Tensor | None = None
    features_start: int = 0
    features_layers: tuple[int, ...] = ()
    features_missing: int = 0  # positions fed before features_start that no forward gave (a prefix-cache hit)
    features_recomputed: int = 0  # rows a forward gave again (a preempted request recomputed)


# ----------------------------------------------------------------------------------------------
# KV state with holes.


class _KV:
    """One model's KV cache over a batch of sequences of different lengths.

    Slots are shared across rows; `valid[b, s]` says whether slot s holds a token of row b's sequence.
    Left padding, and drafts rejected in one row but not another, are invalid slots ("holes"): a 4D mask
    hides them and explicit position ids count only valid slots, so each row computes exactly what it
    would alone. `pending[b]` are row b's tokens not yet fed to the model.
    """

    def __init__(self, pending: list[list[int]], device: torch.device | str = "cpu"):
        batch = len(pending)
        self.device = torch.device(device)
        self.cache = DynamicCache()
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=self.device)  # [B, L]
        self.length = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B] valid slots = next position id
        self.pending = [list(p) for p in pending]

    def forward(self, model: PreTrainedModel, extra: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Feed each row's pending tokens (right-aligned) plus `extra` [B, T]; return logits [B, keep, V]."""
        ids, ok, positions, mask = self._inputs(extra, model.dtype)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep,
            **{cache_kwarg(model): self.cache},
        )
        self._fed(ok)
        return out.logits

    def _inputs(self, extra: torch.Tensor | None, dtype: torch.dtype):
        """A forward's inputs: ids [B, Q] (pending right-aligned, then `extra`), which are real tokens [B, Q],
        their position ids [B, Q] and the additive attention mask [B, 1, Q, L + Q] over the cache and them."""
        batch = len(self.pending)
        width = max(len(p) for p in self.pending)
        ids = torch.zeros(batch, width, dtype=torch.long)
        ok = torch.zeros(batch, width, dtype=torch.bool)
        for b, p in enumerate(self.pending):
            if p:
                ids[b, width - len(p) :] = torch.tensor(p)
                ok[b, width - len(p) :] = True
        ids, ok = ids.to(self.device, non_blocking=True), ok.to(self.device, non_blocking=True)
        if extra is not None and extra.shape[1]:
            ids = torch.cat([ids, extra], 1)
            ok = torch.cat([ok, torch.ones_like(extra, dtype=torch.bool)], 1)
        q_len, past = ids.shape[1], self.valid.shape[1]
        positions = (self.length.unsqueeze(1) + ok.long().cumsum(1) - 1).clamp_(min=0)  # [B, Q]
        keys_ok = torch.cat([self.valid, ok], 1)  # [B, L + Q]
        q_slot = torch.arange(past, past + q_len, device=self.device).unsqueeze(1)  # [Q, 1]
        k_slot = torch.arange(past + q_len, device=self.device).unsqueeze(0)  # [1, L + Q]
        allowed = keys_ok.unsqueeze(1) & (k_slot <= q_slot)  # [B, Q, L + Q] causal over valid slots
        allowed |= k_slot == q_slot  # a padding query sees itself: no fully masked row, no NaN
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        return ids, ok, positions, mask.unsqueeze(1)

    def _fed(self, ok: torch.Tensor) -> None:
        """The forward of `_inputs` ran: its slots [B, Q] (`ok` the real ones) are the cache's newest."""
        self.valid = torch.cat([self.valid, ok], 1)
        self.length += ok.sum(1)
        self.pending = [[] for _ in self.pending]

    def feed(self, b: int, tokens: list[int], hidden: torch.Tensor | None = None) -> None:
        """Queue `tokens` for row b (`hidden`: their features, for `_FeatureKV`)."""
        self.pending[b] += tokens

    def add_rows(self, pending: list[list[int]]) -> None:
        """Append rows whose tokens are all still pending (a request joining a running batch): every existing slot
        is a hole for them, so the next forward prefills them beside the others."""
        n, past = len(pending), self.valid.shape[1]
        if past:
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                    continue
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros((n,) + layer.keys.shape[1:])], 0)  # [B + n, H, L, D]
                layer.values = torch.cat([layer.values, layer.values.new_zeros((n,) + layer.values.shape[1:])], 0)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(n, past)], 0)  # [B + n, L]
        self.length = torch.cat([self.length, self.length.new_zeros(n)], 0)  # [B + n]
        self.pending += [list(p) for p in pending]

    def keep_last(self, keep: torch.Tensor) -> None:
        """Invalidate the last keep.shape[1] slots where `keep` [B, n] is False; trim all-invalid tail slots."""
        n = keep.shape[1]
        if n == 0:
            return
        was = self.valid[:, -n:]
        self.length -= (was & ~keep).sum(1)
        self.valid[:, -n:] = was & keep
        used = self.valid.any(0).nonzero()
        end = int(used[-1]) + 1 if used.numel() else 0
        if end < self.valid.shape[1]:
            self.cache.crop(end - self.valid.shape[1])
            self.valid = self.valid[:, :end]
            self._drop_if_empty()

    def compact(self, slack: int = 64) -> None:
        """Squeeze holes out once the cache holds `slack` more slots than the longest row needs."""
        longest = int(self.length.max()) if self.length.numel() else 0
        if self.valid.shape[1] - longest < slack:
            return
        # stable sort puts each row's invalid slots first and keeps valid ones in order: right-align them
        idx = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, self.valid.shape[1] - longest :]  # [B, L']
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            gather = idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.valid = self.valid.gather(1, idx)
        self._drop_if_empty()

    def select(self, rows: list[int] | torch.Tensor) -> None:
        """Keep only `rows` of the batch."""
        rows = [int(r) for r in rows]
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.valid.shape[1]:
            self.cache.batch_select_indices(index)
        self.valid = self.valid[index]
        self.length = self.length[index]
        self.pending = [self.pending[r] for r in rows]

    def _drop_if_empty(self) -> None:
        """A cache whose last slots went (`keep_last`, `compact`) starts afresh: its layers' tensors, though empty,
        keep the batch size they had, which rows joining since would no longer match (`add_rows` and `select` leave a
        cache without slots alone, as transformers' own batch selection does)."""
        if not self.valid.shape[1]:
            self.cache = DynamicCache()


class _FeatureKV(_KV):
    """An EAGLE-3 drafter's KV cache (`dvi.eagle3.Eagle3Drafter.decode`), slots and holes as `_KV`'s. Each pending
    token comes with the feature it is fed beside (`hidden[b]` [n, hidden], one row per pending token): the fused
    target features of the position before it. Slot i holds (feature of position i, token i + 1), as vLLM's drafter
    cache does. An `extra` token is fed beside the drafter's own pre-norm output at the position before it (its
    last forward's, `prenorm`): drafting on from its own guess."""

    def __init__(self, pending: list[list[int]], hidden: list[torch.Tensor], width: int, device: torch.device | str = "cpu"):
        super().__init__(pending, device)
        self.width = width  # the drafter's hidden size
        self.hidden = list(hidden)
        self.prenorm: torch.Tensor | None = None  # [B, 1, hidden] the last forward's output at each row's last slot
        # (within one round's drafting: rows joining or leaving drop it)

    def forward(self, model, extra: torch.Tensor | None, keep: int) -> torch.Tensor:
        ids, ok, positions, mask = self._inputs(extra, model.dtype)
        width = max(len(p) for p in self.pending)
        hidden = torch.zeros(len(self.pending), ids.shape[1], self.width, dtype=model.dtype, device=self.device)
        for b, h in enumerate(self.hidden):
            if h.shape[0]:
                hidden[b, width - h.shape[0] : width] = h
        if ids.shape[1] > width:
            hidden[:, width:] = self.prenorm  # a drafted token: beside the drafter's own output one step back
        logits, self.prenorm = model.decode(hidden, ids, positions, mask, self.cache, keep)
        self.prenorm = self.prenorm[:, -1:]
        self._fed(ok)
        self.hidden = [h[:0] for h in self.hidden]
        return logits

    def feed(self, b: int, tokens: list[int], hidden: torch.Tensor | None = None) -> None:
        """Queue `tokens` of row b with their features `hidden` [len(tokens), hidden] (zeros if None: a warm-up)."""
        if hidden is None:
            hidden = torch.zeros(len(tokens), self.width, device=self.device)
        self.pending[b] += tokens
        self.hidden[b] = torch.cat([self.hidden[b], hidden.to(self.hidden[b].dtype)], 0)

    def add_rows(self, pending: list[list[int]]) -> None:
        super().add_rows([[] for _ in pending])  # nothing to feed before the target has seen them
        self.hidden += [torch.zeros(0, self.width, device=self.device) for _ in pending]
        self.prenorm = None

    def select(self, rows: list[int] | torch.Tensor) -> None:
        super().select(rows)
        self.hidden = [self.hidden[int(r)] for r in rows]
        self.prenorm = None  # a drafting step's: the next drafts start from a forward of pending tokens


# ----------------------------------------------------------------------------------------------
# Choosing K.


class CostTable:
    """Measured costs per batch-size bucket (`dvi.speculative.batch_bucket`): seconds of a verify forward of
    K + 1 tokens per (bucket, K) (K = 0 is a plain decoding step) and of one drafter step per bucket.

    Filled by `SpeculativeEngine.warm_up` at start-up and refreshed from live rounds (exponential moving averages
    of the observed times); `plan(batch)` turns them into the cost model's units. A K not measured at a bucket
    borrows its cost in target steps from the nearest bucket that has it, else the linear prior
    (`serve.spec.verify_slope`). With `serve.spec.cost_ratio` set nothing measured is used: c is that number
    and verify costs follow the linear model (a fixed, repeatable cost model).
    """

    WEIGHT = 0.2  # of a new observation in the moving averages (the mean of the first 1 / WEIGHT, so that no one
    # sample, such as a server's first and slowest step, weighs more than the others)

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.verify: dict[tuple[int, int], float] = {}  # (bucket, K) -> seconds
        self.draft: dict[int, float] = {}  # bucket -> seconds of one drafter step
        self.propose0: dict[int, float] = {}  # bucket -> seconds a step spends in a proposer drafting nothing (observe_step)
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, drafting) -> tokens per second (observe_rate)
        self.samples: Counter[tuple[str, object]] = Counter()  # (table, key) -> observations so far

    def _average(self, table: str, key, value: float, weight: float | None = None) -> None:
        """A new observation into `table` (verify, draft, propose0 or rate) at `key`: the mean of the first 1 / `weight`
        (default WEIGHT), a moving average after them."""
        values = getattr(self, table)
        self.samples[(table, key)] += 1
        values[key] = moving_average(values.get(key), value, max(weight or self.WEIGHT, 1.0 / self.samples[(table, key)]))

    def observe_verify(self, batch: int, k: int, seconds: float) -> None:
        self._average("verify", (batch_bucket(batch), k), seconds)

    def observe_draft(self, batch: int, steps: int, seconds: float) -> None:
        if steps:
            self._average("draft", batch_bucket(batch), seconds / steps)

    RATE_WEIGHT = 0.05  # of a new step in the tokens-per-second averages (about the last 20 steps; a step's yield varies)
    RATE_SAMPLES = 16  # drafting steps at a bucket before its realized speedup is trusted (their yield varies) ...
    PLAIN_RATE_SAMPLES = 3  # ... and plain ones (steady: StepPlanner's calibration steps give them)

    def observe_rate(self, batch: int, drafting: bool, tokens: int, seconds: float) -> None:
        """A step of decoding (no prefill) emitted `tokens` in `seconds` of wall time (from its start to the next step's:
        all it cost), verifying drafts or not: tokens per second, by bucket and kind, whatever the cost model says
        (`realized_speedup`)."""
        if seconds > 0:
            self._average("rate", (batch_bucket(batch), drafting), tokens / seconds, self.RATE_WEIGHT)

    def realized_speedup(self, batch: int) -> float | None:
        """Tokens per second of steps that verified drafts over those that did not, at this batch size's bucket, once
        there are RATE_SAMPLES and PLAIN_RATE_SAMPLES of them; None before."""
        b = batch_bucket(batch)
        if self.samples[("rate", (b, True))] < self.RATE_SAMPLES or self.samples[("rate", (b, False))] < self.PLAIN_RATE_SAMPLES:
            return None
        return self.rate[(b, True)] / self.rate[(b, False)]

    def target_only_rate(self, bucket: int) -> float | None:
        """Tokens per second of plain decoding at `bucket`: its steps' measured yield once there are
        PLAIN_RATE_SAMPLES, else one token per row per measured plain step (`verify` at K = 0); None unmeasured."""
        if self.samples[("rate", (bucket, False))] >= self.PLAIN_RATE_SAMPLES:
            return self.rate[(bucket, False)]
        step = self.verify.get((bucket, 0))
        return bucket / step if step else None

    def speed_vs_target_only(self) -> dict[int, float]:
        """Per batch-size bucket with RATE_SAMPLES drafting steps and a target-only rate (`target_only_rate`): tokens
        per second of drafting steps over target-only decoding's (> 1: speculation pays there)."""
        out = {}
        for (bucket, drafting), rate in list(self.rate.items()):  # a copy: the decoding thread adds to it
            plain = self.target_only_rate(bucket) if drafting and self.samples[("rate", (bucket, True))] >= self.RATE_SAMPLES else None
            if plain:
                out[bucket] = rate / plain
        return dict(sorted(out.items()))

    def forget_drafting_rates(self) -> None:
        """A new drafter: what drafting yielded says nothing of it."""
        for key in [k for k in self.rate if k[1]]:
            del self.rate[key]
            self.samples.pop(("rate", key), None)

    def observe_step(self, batch: int, verified_k: int, proposed_k: int, step_s: float, propose_s: float) -> float:
        """One step of an engine that verifies and drafts in the same call (vLLM): it verified `verified_k` drafts per
        request in `step_s` seconds, `propose_s` of which went to proposing `proposed_k` drafts for the next step. The
        proposer's time at K = 0 (the drafter's pass over the step's new tokens, paid whatever K is) counts as part of
        every step; what proposing K drafts costs beyond it is K drafter steps. Returns those drafting seconds."""
        b = batch_bucket(batch)
        if proposed_k == 0:
            self._average("propose0", b, propose_s)
        base = self.propose0.get(b, 0.0)
        self.observe_verify(batch, verified_k, max(step_s - propose_s, 0.0) + base)
        drafting_s = max(propose_s - base, 0.0) if proposed_k else 0.0
        if proposed_k:
            self.observe_draft(batch, proposed_k, drafting_s)
        return drafting_s

    @property
    def measured(self) -> bool:
        return self.spec.cost_ratio is None and any(k == 0 for _, k in self.verify)

    def _nearest(self, bucket: int, have) -> int | None:
        found = [b for b in {b for b, _ in self.verify} | set(self.draft) if have(b)]
        return min(found, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b)) if found else None

    def plan(self, batch: int) -> tuple[float, list[float]]:
        """(c, [v_0 .. v_Kmax]) at this batch size, in target steps (v_0 = 1)."""
        s = self.spec
        prior = linear_verify_costs(s.verify_slope, s.k_max)
        if not self.measured:
            return (s.cost_ratio if s.cost_ratio is not None else 0.25), prior  # until measured: a small drafter's typical c
        bucket = batch_bucket(batch)
        v = []
        for k in range(s.k_max + 1):
            at = self._nearest(bucket, lambda b, k=k: (b, k) in self.verify and (b, 0) in self.verify)
            # a measured ratio below 1 is noise: verifying K + 1 tokens cannot cost less than verifying one
            v.append(max(1.0, self.verify[(at, k)] / self.verify[(at, 0)]) if at is not None else prior[k])
        draft_at = self._nearest(bucket, lambda b: b in self.draft and (b, 0) in self.verify)
        c = self.draft[draft_at] / self.verify[(draft_at, 0)] if draft_at is not None else 0.25
        return c, v

    # the figures the stats and tests read: one target step, one drafter step, c (at batch 1)
    @property
    def target_step(self) -> float | None:
        at = self._nearest(1, lambda b: (b, 0) in self.verify)
        return self.verify[(at, 0)] if at is not None else None

    @property
    def draft_step(self) -> float | None:
        at = self._nearest(1, lambda b: b in self.draft)
        return self.draft[at] if at is not None else None

    @property
    def ratio(self) -> float:
        return self.plan(1)[0]

    def to_dict(self) -> dict:
        return {"verify_s": {f"b{b}/k{k}": round(t, 6) for (b, k), t in sorted(self.verify.items())},
                "draft_step_s": {f"b{b}": round(t, 6) for b, t in sorted(self.draft.items())}}


@dataclass(frozen=True)
class Routing:
    """A decision about where drafting runs: `on` or `off` at a batch size, or a `probe` step while it is off."""

    decision: str  # on | off | probe; sleep | wake: the drafter's pass at K = 0 skipped or run again; calibrate (StepPlanner)
    batch: int
    k: int  # the K drafted from then on (on), for the probe (probe), 0 (off)
    why: str


class _KController:
    """One request's K: fixed, or the K with the best predicted speedup for its measured acceptance and the
    engine's cost table; 0 (plain decoding, probing again every `probe_every` tokens) when no K is predicted
    to beat plain decoding."""

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.accepted = 0.0
        self.trials = 0.0
        self.off_at: int | None = None  # tokens generated when drafting was switched off
        self.routed: Routing | None = None  # the routing decision the last next_k took (on, off, probe), if any

    def acceptance(self) -> float:
        s = self.spec
        return acceptance_estimate(self.accepted, self.trials, s.prior_acceptance, s.prior_weight)

    def next_k(self, generated: int, cost_ratio: float, verify_cost: list[float], measured: bool = False) -> int:
        """verify_cost: [k_max + 1] in target steps; measured: the costs come from this machine's table, and a probe
        drafts the K whose round the table says is cheapest (with assumed costs: k_min).

        A request's first round drafts k whatever the costs say: it is the prompt's prefill, where K more
        positions cost little, and every request then measures the drafter (the live check after a swap and the
        trainer's records need drafted rounds)."""
        s = self.spec
        self.routed = None
        if not s.adaptive or not self.trials:
            return s.k
        a = self.acceptance()
        k = choose_k_from_costs(a, cost_ratio, verify_cost, s.k_min, s.k_max, s.min_speedup)
        why = f"acceptance {a:.3f}, drafter step {cost_ratio:.3f} target steps ({'measured' if measured else 'assumed'})"
        if k:
            if self.off_at is not None:
                self.routed = Routing("on", 0, k, why)
            self.off_at = None
            return k
        if self.off_at is None:
            self.off_at = generated
            self.routed = Routing("off", 0, 0, f"no K beats {s.min_speedup:g}x: {why}")
            return 0
        if generated - self.off_at >= s.probe_every:  # probe: the traffic, or the drafter, may have changed
            self.off_at = generated
            # the cheapest round that drafts, by this machine's table
            k = cheapest_k(cost_ratio, verify_cost, s.k_min, s.k_max) if measured else s.k_min
            self.routed = Routing("probe", 0, k, f"drafting has been off for {s.probe_every} tokens")
            return k
        return 0

    def observe(self, k: int, n: int) -> None:
        if k == 0:
            return
        self.accepted = self.accepted * self.spec.decay + n
        self.trials = self.trials * self.spec.decay + n + (n < k)


class StepPlanner:
    """K for every step of an engine that drafts one K for a whole batch (vLLM's batch-size schedule), the engine-wide
    counterpart of `_KController`: from the live acceptance of the serving drafter and the cost table, the K with the
    best predicted speedup at each batch size, 0 (drafting off) where none beats `serve.spec.min_speedup`. Drafting off
    at a batch size comes back on only when the best K is predicted to beat plain decoding by `HYSTERESIS` more, so
    that an estimate hovering at the line does not flip it every step. The model is checked against what the steps
    yield: once a bucket has `CostTable.RATE_SAMPLES` steps that drafted and a few that did not, drafting stays on
    there only while its tokens per second beat plain decoding's (`CostTable.realized_speedup`; at batch 8 on a CPU
    the model, fed with noisy per-K costs, predicted 1.08x where the steps gave 0.85x).

    Acceptance is measured on the rounds of requests whose drafter cache is whole (`observe`; the engine says which),
    position by position (`position_acceptance`: a drafter that is right tends to stay right, which one rate over all
    positions misses, mispredicting what each K returns), decayed over about the last 100 drafting rounds, shrunk to the prior. While the batch about to step has drafting
    off, every `probe_every`-th step is a probe that drafts the cheapest K, so acceptance (which traffic or a new
    drafter may change) keeps being measured.

    Off at every batch size, even the drafter's pass over each step's new tokens (which keeps its cache whole, and
    which an engine pays at K = 0) is a cost: once `WAKE_TOKENS` drafted tokens have been measured since the planner
    last woke and drafting is still off everywhere, it *sleeps* (`awake` False: the engine skips that pass; requests
    then lose their drafter cache) for `SLEEP_STEPS` steps, then wakes to measure again on requests that start awake.
    While awake with drafting off everywhere, and for the first `trial_tokens` drafted tokens of a new drafter (the
    live judge's window after a swap), probes come `FAST_PROBES` times as often and draft `serve.spec.k`.

    No decision is taken on assumed costs. Every prediction is in units of a step of plain decoding at the batch's size
    (a verify of K tokens costs far more, relative to it, at batch 8 than at batch 1 on a CPU), which only a step that
    verifies no drafts measures (the step after one that proposed none). So the first steps at each batch-size bucket
    draft nothing (`calibrate`) until `CALIBRATE_SAMPLES` plain steps there are timed (more than one: a server's first
    decode step is its slowest; at most twice as many tries, where steps that prefill are not plain decoding), and so
    does one step in `RECALIBRATE_EVERY` while drafting is on (off, plain steps come anyway), which keeps the measure
    current for a share of the speedup under 1%.

    A sleep lasts `SLEEP_STEPS` steps, twice as long each time the drafter wakes to find drafting still off everywhere
    (up to `SLEEP_MAX`), and `SLEEP_STEPS` again once drafting is on or a new drafter serves: a drafter that cannot pay
    costs a shrinking share of probes, one that can is found again soon.

    Where drafting is off at a batch size on what its steps yielded (the realized gate above), only a new drafter can
    turn it back on there (the drafting steps' rate is kept until then), so that pass is skipped at that batch size
    alone (`skips_pass`), awake or not: at batch 8 on a CPU it cost about a tenth of a plain step. The requests of such a
    step lose their drafter cache, as asleep.

    `schedule(batch)` returns the dense K lookup for the next step (index = batch size, as vLLM's scheduler reads it)
    and the routing decisions it took. A fresh drafter (`reset`) drafts `serve.spec.k` until its first rounds are seen.
    """

    HYSTERESIS = 0.05
    CALIBRATE_SAMPLES = 3
    RECALIBRATE_EVERY = 128
    FAST_PROBES = 8
    # every request's rounds feed one estimate, and probes are few: it keeps about the last 100 drafting rounds
    # (serve.spec.decay is a request's own, over its last ten or so; with as few trials the prior would dominate)
    DECAY = 0.99
    WAKE_TOKENS = 32
    SLEEP_STEPS = 128
    SLEEP_MAX = 2048

    def __init__(self, spec: SpecConfig, max_batch: int, costs: CostTable, trial_tokens: int = 0):
        self.spec, self.max_batch, self.costs, self.trial_tokens = spec, max_batch, costs, trial_tokens
        self.accepted = 0.0  # decayed accepted drafts, all positions (the summary `acceptance`)
        self.trials = 0.0  # ... and tested drafts
        self.by_position = ([0.0] * spec.k_max, [0.0] * spec.k_max)  # decayed (accepted, tested) at each draft position
        self.steps_off = 0  # steps since the last one that drafted, at batch sizes with drafting off
        self.on = [True] * (max_batch + 1)  # drafting on at each batch size (index 0 unused)
        self.planned = [spec.k] * (max_batch + 1)  # the last lookup planned, probes aside
        self.trial_left = 0  # drafted tokens before the drafter serving now leaves its trial
        self.awake = True  # False: the engine skips the drafter's pass at K = 0
        self.measured_awake = 0  # drafted tokens measured since the planner last woke
        self.sleep_left = 0  # steps until it wakes
        self.sleep_steps = self.SLEEP_STEPS  # how long the next sleep lasts
        self.calibrations: Counter[int] = Counter()  # steps that drafted nothing to measure plain decoding, by bucket
        self.since_calibrated = 0  # steps since the last one that drafted nothing

    def reset(self) -> None:
        """A new drafter serves: what was measured of the last one says nothing about it; it is on trial."""
        self.accepted = self.trials = 0.0
        self.by_position = ([0.0] * self.spec.k_max, [0.0] * self.spec.k_max)
        self.steps_off = 0
        self.trial_left = self.trial_tokens
        self.measured_awake = 0
        self.sleep_steps = self.SLEEP_STEPS
        self.costs.forget_drafting_rates()

    def drafted(self, k: int) -> None:
        """A round of the serving drafter drafted `k` tokens, its cache whole or not (the judge counts them all)."""
        self.trial_left = max(0, self.trial_left - k)

    def observe(self, k: int, n: int) -> None:
        """A round of a request whose drafter cache is whole: `n` of `k` drafts accepted (k = 0: nothing learnt)."""
        if k == 0:
            return
        self.measured_awake += k
        d = self.DECAY
        self.accepted = self.accepted * d + n
        self.trials = self.trials * d + n + (n < k)
        accepted, tested = self.by_position
        for i in range(len(accepted)):  # draft i + 1 was tested when the i before it were accepted
            accepted[i] = accepted[i] * d + (n > i)
            tested[i] = tested[i] * d + (i < k and n >= i)

    def acceptance(self) -> float:
        """The per-token acceptance over all positions (what logs and tests summarise)."""
        s = self.spec
        return acceptance_estimate(self.accepted, self.trials, s.prior_acceptance, s.prior_weight)

    def acceptance_by_position(self) -> list[float]:
        """The acceptance at each draft position given the ones before it were accepted (what K is planned with)."""
        s = self.spec
        return position_acceptance(*self.by_position, s.prior_acceptance, s.prior_weight)

    def plan(self, batch: int, costs: tuple[float, list[float]] | None = None) -> tuple[int, float, str]:
        """(K, predicted speedup, why) at this batch size (`costs`: `self.costs.plan(batch)`), without probing or hysteresis."""
        s = self.spec
        if not self.trials:
            return s.k, 0.0, "no round of this drafter measured yet"
        c, v = costs or self.costs.plan(batch)
        a = self.acceptance_by_position()
        k = choose_k_from_costs(a, c, v, s.k_min, s.k_max, 0.0)
        speedup = ideal_speedup(a, k, c, v[k])
        source = "measured" if self.costs.measured else "assumed"
        by_position = " ".join(f"{x:.2f}" for x in a[:k])
        return k, speedup, (f"acceptance {self.acceptance():.3f} ({by_position} at positions 1-{k}), drafter step {c:.3f} "
                            f"and verify of K={k} {v[k]:.3f} target steps ({source})")

    def schedule(self, batch: int, whole: int | None = None) -> tuple[list[int], list[Routing]]:
        """The K lookup for the next step, the batch about to step having `batch` requests, `whole` of them with a whole
        drafter cache (None: all), and the decisions taken. A probe needs a request to measure on: with none whole,
        only a drafter on trial is probed (the judge counts every round of it)."""
        s = self.spec
        lookup = [0] * (self.max_batch + 1)
        changes = []
        size = self._size(batch)
        if self.costs.spec.cost_ratio is None and self.awake:  # measured costs: plain decoding is the unit (class docstring)
            at = batch_bucket(size)
            self.since_calibrated += 1
            timed = self.costs.samples[("verify", (at, 0))]
            unmeasured = timed < self.CALIBRATE_SAMPLES and self.calibrations[at] < 2 * self.CALIBRATE_SAMPLES
            if unmeasured or self.since_calibrated >= self.RECALIBRATE_EVERY:
                if not self.calibrations[at]:
                    changes.append(Routing("calibrate", size, 0,
                                           f"plain decoding at batch size {batch} is measured first: steps draft nothing "
                                           f"until {self.CALIBRATE_SAMPLES} are timed"))
                self.calibrations[at] += 1
                self.since_calibrated = 0
                return lookup, changes
        by_bucket: dict[int, tuple[float, list[float]]] = {}
        for b in range(1, self.max_batch + 1):
            bucket = batch_bucket(b)
            if bucket not in by_bucket:
                by_bucket[bucket] = self.costs.plan(b)
            k, speedup, why = self.plan(b, by_bucket[bucket])
            on = True
            if self.trials:
                need = s.min_speedup * (1.0 + (0.0 if self.on[b] else self.HYSTERESIS))
                on = speedup > need
                why = f"predicted speedup {speedup:.2f} {'>' if on else '<='} {need:.2f} at K={k}: {why}"
                realized = self._unpaid(b)
                if on and realized is not None:  # what the steps yield overrules the model
                    on = False
                    why = (f"realized speedup {realized:.2f} <= {s.min_speedup:.2f} (tokens per second of the last steps that "
                           f"drafted over those that did not), though {why}")
            if on != self.on[b]:
                self.on[b] = on
                changes.append(Routing("on" if on else "off", b, k if on else 0, why))
            lookup[b] = k if on else 0
        self.planned = lookup
        b = size
        if not lookup[b]:
            self.since_calibrated = 0  # this step drafts nothing: the next one measures plain decoding anyway
        everywhere_off = not any(lookup) and self.trials and not self.trial_left
        if any(lookup):
            self.sleep_steps = self.SLEEP_STEPS
        if not everywhere_off:
            if not self.awake:
                self._wake(changes, b, "drafting is on again" if any(lookup) else "a new drafter")
        elif not self.awake:
            self.sleep_left -= 1
            if self.sleep_left > 0:
                return lookup, changes
            self._wake(changes, b, f"drafting has been off for {self.sleep_steps} steps: measuring the drafter again")
            self.sleep_steps = min(2 * self.sleep_steps, self.SLEEP_MAX)  # if it is still off, the next sleep is longer
        elif self.measured_awake >= self.WAKE_TOKENS:
            self.awake, self.sleep_left = False, self.sleep_steps
            changes.append(Routing("sleep", b, 0, f"drafting off at every batch size after {self.measured_awake} drafted "
                                                   f"tokens measured: the drafter's pass skipped for {self.sleep_steps} steps"))
            return lookup, changes
        if lookup[b]:
            self.steps_off = 0
            return lookup, changes
        self.steps_off += 1
        if not self.trial_left and whole == 0:
            return lookup, changes
        fast = self.trial_left or everywhere_off
        every = max(1, s.probe_every // self.FAST_PROBES) if fast else s.probe_every
        if self.steps_off >= every:
            self.steps_off = 0
            if fast:
                k = s.k
                why = (f"a drafter on trial ({self.trial_left} drafted tokens to go)" if self.trial_left else
                       f"measuring the drafter before its pass is skipped ({self.measured_awake} of {self.WAKE_TOKENS} tokens)")
            else:
                c, v = by_bucket[batch_bucket(b)]
                k = cheapest_k(c, v, s.k_min, s.k_max) if self.costs.measured else s.k_min
                why = f"drafting has been off for {every} steps"
            lookup = [0] + [k] * self.max_batch
            changes.append(Routing("probe", b, k, why))
        return lookup, changes

    def skips_pass(self, batch: int, lookup: list[int]) -> bool:
        """Whether the step about to run at `batch` (drafting `lookup[batch]`, as `schedule` returned it) skips the
        drafter's pass over its new tokens: asleep, or drafting off at this batch size on what its steps yielded (see
        the class docstring)."""
        b = self._size(batch)
        if lookup[b]:
            return False
        return not self.awake or (not self.on[b] and self._unpaid(b) is not None)

    def _size(self, batch: int) -> int:
        """A batch size as the lookup indexes it: 1 to max_batch."""
        return min(max(batch, 1), self.max_batch)

    def _unpaid(self, batch: int) -> float | None:
        """The realized speedup at this batch size where it says drafting does not pay (at most
        serve.spec.min_speedup), else None (it pays, or too few steps are measured to say)."""
        realized = self.costs.realized_speedup(batch)
        return realized if realized is not None and realized <= self.spec.min_speedup else None

    def _wake(self, changes: list[Routing], batch: int, why: str) -> None:
        self.awake, self.measured_awake, self.sleep_left = True, 0, 0
        changes.append(Routing("wake", batch, 0, why))


# ----------------------------------------------------------------------------------------------
# The engine.


class SpeculativeEngine:
    """Decode requests with a target and (optionally) a drafter, in a continuously refilled batch.

    `generate` decodes a list of requests, at most `max_batch` at a time: a finished row leaves at once and the
    next request joins at the following round boundary. A server drives the same `Decoding` (see `decoding()`)
    itself, adding requests as they arrive. `drafter` may be replaced at any time by `swap_drafter`; the
    switch takes effect between rounds (a round never mixes two drafters), and the new drafter starts from a
    fresh cache fed each row's sequence so far. With no drafter the engine decodes plainly (K = 0).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter | None,
        spec: SpecConfig,
        stop_ids: set[int] | frozenset[int] = frozenset(),
        max_batch: int = 8,
        features_layers=None,
    ):
        """`features_layers`: the target layers whose aux hidden states each request's Result carries (`Result.features`,
        what records send to a trainer of EAGLE-3 drafters); None: an EAGLE-3 drafter's own while one drafts, else none."""
        self.target = target
        self.features_layers = None if features_layers is None else tuple(sorted(int(i) for i in features_layers))
        self.device = next(target.parameters()).device  # every tensor of a round lives here; random draws come from CPU generators
        self._drafter = drafter
        self._lock = threading.Lock()
        self._abort = threading.Event()  # set by abort(): decoding stops at the next round boundary
        self.spec = spec
        self.stop_ids = frozenset(stop_ids)
        self.max_batch = max_batch
        self.vocab_size = int(target.config.vocab_size)
        self.window = int(getattr(target.config, "max_position_embeddings", 1 << 30))
        if drafter is not None:
            self.check_drafter(drafter)
            _to_device(drafter, self.device)
        self.costs = CostTable(spec)
        self._routing: list[tuple[Routing, list[int] | None]] = []  # per-request routing decisions (take_routing)

    # -- drafter pointer --------------------------------------------------------------------------

    @property
    def drafter(self) -> Drafter | None:
        with self._lock:
            return self._drafter

    def abort(self) -> None:
        """Stop decoding for good (shutdown): a round about to start raises DviError instead, so the decoding
        thread is out of the model's code before the process exits."""
        self._abort.set()

    def swap_drafter(self, drafter: Drafter | None) -> None:
        """Install a new drafter; decoding picks it up at the next round boundary."""
        if drafter is not None:
            self.check_drafter(drafter)
            _to_device(drafter, self.device)
        with self._lock:
            self._drafter = drafter

    def close(self) -> None:
        """Nothing to release: the models are plain modules, freed with their last reference."""

    def take_load_failures(self) -> list[tuple[str, str]]:
        """Drafters swapped in that the engine failed to load: none here (a swap replaces a pointer)."""
        return []

    def take_routing(self) -> list[tuple[Routing, list[int] | None]]:
        """The speculation routing decisions of requests (drafting off, on again, probes) since the last call; each
        request plans its own K here, so there is no engine-wide schedule (None)."""
        with self._lock:
            out, self._routing = self._routing, []
        return out

    def check_drafter(self, drafter: Drafter | Eagle3Drafter) -> None:
        """DviError unless this engine can draft with `drafter`: its vocabulary is the target's, and an EAGLE-3 drafter
        reads features the target has (its aux layers, the target's width)."""
        model, _ = draft_model(drafter)
        if int(model.config.vocab_size) != self.vocab_size:
            raise DviError(
                f"drafter {drafter.version!r} has vocabulary size {model.config.vocab_size}, "
                f"the target has {self.vocab_size}"
            )
        if isinstance(model, Eagle3Drafter):
            tc = self.target.config
            if model.target_hidden_size != tc.hidden_size or not all(0 <= i <= tc.num_hidden_layers for i in model.layer_ids):
                raise DviError(f"EAGLE-3 drafter {drafter.version!r} reads aux layers {list(model.layer_ids)} of width "
                               f"{model.target_hidden_size}; the target has layers 0..{tc.num_hidden_layers} of width {tc.hidden_size}")

    # -- requests ---------------------------------------------------------------------------------

    def check_request(self, r: Request) -> None:
        check_request(r, self.window, self.vocab_size)

    def decoding(self) -> Decoding:
        """An empty running batch of this engine: `add` requests, `step` rounds."""
        return Decoding(self)

    @torch.inference_mode()
    def generate(self, requests: list[Request], on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Result]:
        """Decode `requests`, at most `max_batch` at a time (a finished row's slot goes to the next request at the
        following round). `on_tokens(i, ids)`, if given, is called on the decoding thread after every round with
        the tokens request i gained in it (for streaming)."""
        for r in requests:
            self.check_request(r)
        results: list[Result | None] = [None] * len(requests)
        waiting = list(range(len(requests)))
        batch = self.decoding()
        while waiting or batch.size:
            while waiting and batch.size < self.max_batch:
                i = waiting.pop(0)
                batch.add(requests[i], key=i, on_tokens=(lambda ids, _, i=i: on_tokens(i, ids)) if on_tokens is not None else None)
            for i, result in batch.step():
                results[i] = result
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def warm_up(self, reps: int = 1, context: int = 32) -> dict:
        """Measure the cost table at batch 1 (`CostTable`): verify forwards of K + 1 tokens for K = 0..k_max and
        drafter steps, on a `context`-token sequence, `reps` times each, interleaved; the median is kept. Returns
        the table (`CostTable.to_dict`)."""
        ids = [(7 * i + 3) % self.vocab_size for i in range(min(context, self.window - self.spec.k_max - 2))]
        tgt = _KV([ids[:-1]], self.device)
        tgt.forward(self.target, None, keep=1)
        drafter = self.drafter
        model, _ = draft_model(drafter) if drafter is not None else (None, None)
        dft = _drafter_cache(model, [ids[:-1]], self.device)
        if model is not None:
            dft.forward(model, None, keep=1)
        greedy = torch.zeros(1, device=self.device)
        samples: dict[int, list[float]] = {}
        for rep in range(reps + 1):  # the first pass warms the shapes up and is not kept
            for k in range(self.spec.k_max + 1):
                extra = torch.tensor([ids[-k:] if k else []], dtype=torch.long, device=self.device).view(1, k)
                tgt.pending = [[ids[-1]]]
                t0 = _now(self.device)
                logits_to_probs(tgt.forward(self.target, extra, keep=k + 1), greedy, greedy + 1)
                if rep:
                    samples.setdefault(k, []).append(_now(self.device) - t0)
                tgt.keep_last(torch.zeros(1, k + 1, dtype=torch.bool, device=self.device))
            if model is not None:
                dft.pending = [[]]
                dft.feed(0, [ids[-1]])
                t0 = _now(self.device)
                logits_to_probs(dft.forward(model, None, keep=1)[:, -1], greedy, greedy + 1)
                if rep:
                    samples.setdefault(-1, []).append(_now(self.device) - t0)
                dft.keep_last(torch.zeros(1, 1, dtype=torch.bool, device=self.device))
        for k, xs in samples.items():
            if k < 0:
                self.costs.draft[1] = statistics.median(xs)
            else:
                self.costs.verify[(1, k)] = statistics.median(xs)
        return self.costs.to_dict()

    def _draft(
        self, model, vocab_map: torch.Tensor | None, dft: _KV, kmax: int, temp: torch.Tensor, top_p: torch.Tensor,
        u_draft: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose kmax tokens per row with a drafter's `model` (`draft_model`). Returns draft ids [B, Kmax] (target
        ids) and q [B, Kmax, V]."""
        drafts, qs = [], []
        logits = dft.forward(model, None, keep=1)[:, -1]  # [B, Vd]
        for j in range(kmax):
            q_j = logits_to_probs(logits, temp, top_p)  # [B, Vd]
            d = sample_from(q_j, u_draft[:, j])  # [B] drafter-vocabulary ids
            if vocab_map is not None:
                d = vocab_map[d]
            drafts.append(d)
            qs.append(q_j)
            if j < kmax - 1:
                logits = dft.forward(model, d.unsqueeze(1), keep=1)[:, -1]
        q = expand_draft_probs(torch.stack(qs, 1), vocab_map, self.vocab_size)  # [B, Kmax, V]
        return torch.stack(drafts, 1), q


def draft_model(drafter: Drafter | Eagle3Drafter) -> tuple[torch.nn.Module, torch.Tensor | None]:
    """What drafts for `drafter`, and the target ids of its output rows (None: all of them): a layer drafter's
    causal LM, or an EAGLE-3 drafter, bare (`dvi.swap.load_announced_eagle3`) or held by a `Drafter`."""
    if isinstance(drafter, Eagle3Drafter):
        return drafter, target_ids(drafter.d2t)
    return drafter.model, drafter.vocab_map


def _layers_of(states: torch.Tensor, hooked, layers) -> torch.Tensor:
    """The part of aux hidden states [..., len(hooked) x hidden] (layers `hooked`, ascending) that `layers` name, in
    ascending order: [..., len(layers) x hidden]."""
    want = sorted(set(int(i) for i in layers))
    if want == list(hooked):
        return states
    parts = states.unflatten(-1, (len(hooked), -1))
    return parts[..., [list(hooked).index(i) for i in want], :].flatten(-2)


def _to_device(drafter: Drafter | Eagle3Drafter, device: torch.device) -> None:
    """A bare EAGLE-3 drafter, loaded on the CPU, moves to the target's device (a layer drafter is loaded there)."""
    if isinstance(drafter, Eagle3Drafter) and drafter.fc.weight.device != device:
        drafter.to(device)


def _drafter_cache(model, pending: list[list[int]], device: torch.device) -> _KV:
    """An empty cache for a drafter's `model` (None: no drafter) with `pending` tokens to feed: an EAGLE-3 drafter's
    feeds each beside a zero feature (a warm-up's; decoding feeds the target's, `_FeatureKV.feed`)."""
    if isinstance(model, Eagle3Drafter):
        width = model.config.hidden_size
        return _FeatureKV(pending, [torch.zeros(len(p), width, device=device) for p in pending], width, device)
    return _KV(pending, device)


def _emitted_logprobs(log_p: torch.Tensor, emitted: list[int], n_top: int) -> list[LogProb]:
    """log_p [J, V] of one row's round: for emitted token j, its log-prob and the `n_top` most likely (id, log-prob)."""
    j = torch.arange(len(emitted), device=log_p.device)
    chosen = log_p[j, torch.tensor(emitted, device=log_p.device)].tolist()
    top_lp, top_ids = log_p[: len(emitted)].topk(n_top, -1) if n_top else (log_p.new_zeros(len(emitted), 0),) * 2
    return [(c, list(zip(map(int, i), lp))) for c, i, lp in zip(chosen, top_ids.tolist(), top_lp.tolist())]


def _now(device: torch.device) -> float:
    """A clock read after the device's queued work (CUDA kernels run asynchronously; the CPU needs no wait)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class _Row:
    """One request in a running batch."""

    key: object  # the caller's handle, returned with the result
    req: Request
    on_tokens: TokenHook | None
    budget: int  # tokens it may generate (max_new_tokens, clipped by the context window)
    gen: torch.Generator
    ctrl: _KController
    start: float
    out: list[int] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    versions: list[str] = field(default_factory=list)
    finish: str = ""
    cancelled: str = ""  # set by Decoding.cancel from any thread: the row leaves at the next round boundary
    captured: Captured = field(default_factory=Captured)  # the target's features of its positions (features_layers)

    def result(self) -> Result:
        r = self.req
        rows, start, counts = self.captured.assemble(len(r.prompt_ids) + len(self.out) - 1)  # the last token: never fed
        return Result(r.request_id, list(r.prompt_ids), self.out, self.finish, self.versions, self.rounds, self.stats,
                      time.perf_counter() - self.start, rows, start, self.captured.layers,
                      counts["missing"] if self.captured.parts else 0, counts["recomputed"])


class Decoding:
    """A running batch of one engine: rows join between rounds (`add`), `step()` runs one round and returns the
    rows that finished in it, whose slots are free at once. Used from one thread (the decoding thread), except
    `cancel`, which any thread may call."""

    def __init__(self, engine: SpeculativeEngine):
        self.engine = engine
        self.rows: list[_Row] = []
        self.tgt = _KV([], engine.device)
        self._use(engine.drafter, [])

    def _use(self, drafter: Drafter | Eagle3Drafter | None, rows: list[_Row]) -> None:
        """Draft with `drafter` from the next round, from a fresh cache fed each of `rows`' sequence so far (an
        EAGLE-3 drafter's beside the target's features of it, recomputed: the positions the target has seen)."""
        self.drafter = drafter
        self.model, self.vocab_map = draft_model(drafter) if drafter is not None else (None, None)
        self.eagle = self.model if isinstance(self.model, Eagle3Drafter) else None
        device = self.engine.device
        self.dft = _drafter_cache(self.model, [[] if self.eagle else r.req.prompt_ids + r.out for r in rows], device)
        if self.eagle is None:
            return
        for b, r in enumerate(rows):
            seq = r.req.prompt_ids + r.out
            seen = len(seq) - len(self.tgt.pending[b])  # tokens the target has fed: their features exist
            if seen:
                ids = torch.tensor([seq[:seen]], device=device)
                self.dft.feed(b, seq[1 : seen + 1], self.eagle.fuse(target_features(self.engine.target, ids, self.eagle.layer_ids))[0])

    @property
    def size(self) -> int:
        return len(self.rows)

    def add(self, req: Request, key: object = None, on_tokens: TokenHook | None = None) -> None:
        """Join the batch; the request is prefilled in the next round, beside the others' verification."""
        e = self.engine
        e.check_request(req)
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        budget = min(req.max_new_tokens, e.window - len(req.prompt_ids))
        self.rows.append(_Row(key, req, on_tokens, budget, torch.Generator().manual_seed(seed), _KController(e.spec), time.perf_counter()))
        self.tgt.add_rows([req.prompt_ids])
        self.dft.add_rows([req.prompt_ids])  # an EAGLE-3 drafter's: nothing to feed until the target has seen it

    def cancel(self, key: object, reason: str = "abort") -> bool:
        """End the row of `key` at the next round boundary (a client went away, a stop string was seen): `step`
        returns its result so far with finish reason `reason`. False if no row has that key (finished or unknown)."""
        for r in list(self.rows):  # a snapshot: the decoding thread replaces the list, never mutates it
            if r.key is key or r.key == key:
                r.cancelled = reason
                return True
        return False

    def _leave(self, keep: list[int]) -> None:
        """Keep only the rows `keep`: the others' slots are free for the next round."""
        self.rows = [self.rows[b] for b in keep]
        if self.rows:
            self.tgt.select(keep)
            self.dft.select(keep)
        else:
            self.tgt = _KV([], self.engine.device)
            self._use(self.drafter, [])  # empty caches of the same drafter

    def _take_cancelled(self) -> list[tuple[object, Result]]:
        gone = [b for b, r in enumerate(self.rows) if r.cancelled]
        if not gone:
            return []
        out = []
        for b in gone:
            r = self.rows[b]
            r.finish = r.cancelled
            out.append((r.key, r.result()))
        self._leave([b for b, r in enumerate(self.rows) if not r.cancelled])
        return out

    @torch.inference_mode()
    def step(self) -> list[tuple[object, Result]]:
        """One round for every row: draft, verify, accept, roll back. Returns (key, result) of the rows that finished
        (cancelled rows first: they leave before the round)."""
        cancelled = self._take_cancelled()
        e, rows = self.engine, self.rows
        if not rows:
            return cancelled
        if e._abort.is_set():
            raise DviError("decoding was aborted: the server is shutting down")
        device, batch = e.device, len(rows)
        current = e.drafter  # one drafter for the whole round
        if current is not self.drafter:  # hot-swapped: the new drafter starts from a fresh cache
            self._use(current, rows)
        drafter, eagle = self.drafter, self.eagle
        c, verify_cost = e.costs.plan(batch)
        measured = e.costs.measured
        ks, routed = [], []
        for b, r in enumerate(rows):
            # an EAGLE-3 drafter drafts for a row once the target's features of it are queued (not in its prefill)
            ready = drafter is not None and (eagle is None or self.dft.length[b] > 0 or len(self.dft.pending[b]) > 0)
            k = r.ctrl.next_k(len(r.out), c, verify_cost, measured) if ready else 0
            ks.append(max(0, min(k, r.budget - len(r.out) - 1)))  # never draft past the budget
            if drafter is not None and r.ctrl.routed is not None:
                routed.append((replace(r.ctrl.routed, batch=batch), None))
        if routed:
            with e._lock:
                e._routing.extend(routed)
        kmax = max(ks)
        # each row draws 2 k + 1 uniforms from its own generator, however long the other rows draft, so a
        # seeded request samples the same tokens alone or in any batch; drafts past k use u = 0 (ignored)
        u_draft, u_accept, u_sample = torch.zeros(batch, kmax), torch.zeros(batch, kmax), torch.zeros(batch)
        for b, (r, kb) in enumerate(zip(rows, ks)):
            u = torch.rand(2 * kb + 1, generator=r.gen)
            u_draft[b, :kb], u_accept[b, :kb], u_sample[b] = u[:kb], u[kb : 2 * kb], u[-1]
        u_draft, u_accept, u_sample = (u.to(device) for u in (u_draft, u_accept, u_sample))
        temp = torch.tensor([r.req.temperature for r in rows], dtype=torch.float32, device=device)  # [B]
        top_p = torch.tensor([r.req.top_p for r in rows], dtype=torch.float32, device=device)  # [B]
        k_row = torch.tensor(ks, device=device)  # [B]
        # a round whose rows feed only their last token is a representative cost (a prefill is not)
        steady_tgt = max(len(p) for p in self.tgt.pending) == 1
        # (an EAGLE-3 drafter is fed each kept position: up to K + 1 a round)
        steady_dft = max(len(p) for p in self.dft.pending) <= (2 if eagle is None else e.spec.k_max + 1)

        timing = e.spec.cost_ratio is None  # fixed costs: nothing to measure
        t0 = _now(device) if timing else 0.0
        draft_ids = torch.zeros(batch, 0, dtype=torch.long, device=device)  # [B, Kmax]
        q = torch.zeros(batch, 0, e.vocab_size, device=device)  # [B, Kmax, V]
        if kmax:
            draft_ids, q = e._draft(self.model, self.vocab_map, self.dft, kmax, temp, top_p, u_draft)
        t1 = _now(device) if timing else 0.0
        fed = [list(p) for p in self.tgt.pending]  # the tokens this forward feeds before the drafts
        layers = e.features_layers if e.features_layers is not None else (tuple(sorted(eagle.layer_ids)) if eagle else None)
        hooked = sorted(set(layers or ()) | set(eagle.layer_ids if eagle is not None else ()))
        if not hooked:
            logits = self.tgt.forward(e.target, draft_ids, keep=kmax + 1)  # [B, Kmax + 1, V]
        else:
            with aux_hidden_states(e.target, hooked) as aux:
                logits = self.tgt.forward(e.target, draft_ids, keep=kmax + 1)
                hooked_states = aux()  # [B, Q, len(hooked) x hidden]: each fed position's, drafts included
            if eagle is not None:
                features = eagle.fuse(_layers_of(hooked_states, hooked, eagle.layer_ids))  # [B, Q, hidden]
            if layers is not None:
                aux_states = _layers_of(hooked_states, hooked, layers)
        early = [min(r.req.min_tokens, r.budget) - len(r.out) for r in rows]  # positions of this round before min_tokens
        warped = logits if max(early) <= 0 or not e.stop_ids else ban_tokens(logits, sorted(e.stop_ids), early)
        p = logits_to_probs(warped, temp, top_p)  # [B, Kmax + 1, V]
        n, token = rejection_sample(draft_ids, q, p, k_row, u_accept, u_sample)  # [B], [B]
        topk = e.spec.topk_logprobs
        wanted = [b for b, r in enumerate(rows) if r.req.logprobs is not None]
        if topk or wanted:
            log_p = torch.log_softmax(logits.float(), -1)  # [B, Kmax + 1, V]
        if topk:
            top_lp, top_ids = log_p.topk(topk, -1)  # [B, Kmax + 1, topk]
        n_list, token_list = n.tolist(), token.tolist()  # the round's one read of the accepted counts
        if timing:
            t2 = time.perf_counter()  # after the .tolist() above: the device is done
            if steady_tgt:
                e.costs.observe_verify(batch, kmax, t2 - t1)
            if kmax and steady_dft:
                e.costs.observe_draft(batch, kmax, t1 - t0)
            if steady_tgt and (not kmax or steady_dft):  # a decoding round's yield (`CostTable.speed_vs_target_only`)
                e.costs.observe_rate(batch, kmax > 0, sum(n_list) + batch, t2 - t0)

        # roll both caches back to the accepted prefix
        j = torch.arange(1, kmax + 1, device=device)
        self.tgt.keep_last(j.unsqueeze(0) <= n.unsqueeze(1))  # slots of d_1..d_Kmax
        self.tgt.pending = [[t] for t in token_list]
        drafted = draft_ids.tolist()
        width = max(len(f) for f in fed)
        if layers is not None:  # each row's kept positions: the tokens it fed, then its accepted drafts
            for b, r in enumerate(rows):
                first = len(r.req.prompt_ids) + len(r.out) - len(fed[b])
                r.captured.add(first, aux_states[b, width - len(fed[b]) : width + n_list[b]].clone(), layers)
        if eagle is not None:
            # the drafter's slots of d_1..d_{Kmax-1} came from its own features: the target's replace them
            self.dft.keep_last(torch.zeros(batch, max(kmax - 1, 0), dtype=torch.bool, device=device))
            for b in range(batch):  # each position the target fed and kept, beside the token after it
                seen = fed[b] + drafted[b][: n_list[b]]
                self.dft.feed(b, seen[1:] + [token_list[b]], features[b, width - len(fed[b]) : width + n_list[b]])
        elif kmax:
            last = draft_ids[:, -1].tolist()
            self.dft.keep_last(j[:-1].unsqueeze(0) <= n.unsqueeze(1))  # slots of d_1..d_{Kmax-1}
            self.dft.pending = [([last[b]] if n_list[b] == kmax else []) + [token_list[b]] for b in range(batch)]
        else:
            for b in range(batch):
                self.dft.pending[b].append(token_list[b])

        finished, keep = [], []
        for b, r in enumerate(rows):
            nb, kb = n_list[b], ks[b]
            version = drafter.version if drafter is not None and kb else None
            if version and (not r.versions or r.versions[-1] != version):
                r.versions.append(version)
            r.rounds.append(
                Round(
                    position=len(r.out),
                    k=kb,
                    drafted=drafted[b][:kb],
                    accepted=nb,
                    token=token_list[b],
                    drafter_version=version,
                    topk_ids=top_ids[b, : kb + 1].clone() if topk else None,
                    topk_logprobs=top_lp[b, : kb + 1].clone() if topk else None,
                    logprobs=_emitted_logprobs(log_p[b], drafted[b][:nb] + [token_list[b]], r.req.logprobs)
                    if r.req.logprobs is not None else None,
                )
            )
            r.stats.add(kb, nb)
            r.ctrl.observe(kb, nb)
            before = len(r.out)
            stops = () if r.req.ignore_eos else e.stop_ids
            for t in drafted[b][:nb] + [token_list[b]]:
                r.out.append(t)
                if t in stops:
                    r.finish = "stop"
                    break
                if len(r.out) >= r.budget:
                    r.finish = "length"
                    break
            if r.on_tokens is not None and len(r.out) > before:
                emitted = r.rounds[-1].logprobs
                r.on_tokens(r.out[before:], None if emitted is None else emitted[: len(r.out) - before])
            if r.finish:
                finished.append((r.key, r.result()))
            else:
                keep.append(b)
        if len(keep) < batch:  # finished rows leave now: their slots are free for the next round
            self._leave(keep)
        self.tgt.compact()
        self.dft.compact()
        return cancelled + finished
