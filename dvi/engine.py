"""The speculative decoding loop over Hugging Face causal LMs, for a batch of concurrent requests.

Each round: the drafter proposes K tokens (one cached forward each), the target verifies all of them plus
a bonus position in one forward, `dvi.speculative.rejection_sample` decides how many are accepted, and
both KV caches are rolled back to the accepted length. Rows of a batch accept different numbers of tokens;
rather than copying caches to re-align them, a rejected slot stays in the cache as a masked "hole"
(see `_KV`) and holes are squeezed out when they grow. Greedy decoding is the temperature-0 case of the
same rule and returns exactly the target's greedy tokens.

Per-round statistics and the target's top-k log-probs are returned as data (`Round`, `SpecStats`); this
module does not know where they go (streams, MLflow, /metrics), nor about tokenization or text.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from dvi.config import SpecConfig, check_sampling
from dvi.errors import DviError
from dvi.models import Drafter
from dvi.speculative import (
    acceptance_estimate,
    choose_k,
    expand_draft_probs,
    logits_to_probs,
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
    finish_reason: str  # "stop" or "length"
    drafter_versions: list[str]  # every drafter version that drafted for this request, in order
    rounds: list[Round]
    stats: SpecStats
    seconds: float


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
        dtype = model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        out = model(
            input_ids=ids,
            attention_mask=mask.unsqueeze(1),  # [B, 1, Q, L + Q]
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        self.valid = keys_ok
        self.length += ok.sum(1)
        self.pending = [[] for _ in range(batch)]
        return out.logits

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

    def select(self, rows: list[int] | torch.Tensor) -> None:
        """Keep only `rows` of the batch."""
        rows = [int(r) for r in rows]
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.valid.shape[1]:
            self.cache.batch_select_indices(index)
        self.valid = self.valid[index]
        self.length = self.length[index]
        self.pending = [self.pending[r] for r in rows]


# ----------------------------------------------------------------------------------------------
# Choosing K.


class _Costs:
    """Measured seconds of one drafter step and one target step (exponential moving averages)."""

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.draft_step: float | None = None
        self.target_step: float | None = None

    def observe(self, draft_seconds: float, draft_steps: int, verify_seconds: float, kmax: int) -> None:
        target_step = verify_seconds / (1.0 + self.spec.verify_slope * kmax)
        self.target_step = target_step if self.target_step is None else 0.8 * self.target_step + 0.2 * target_step
        if draft_steps:
            step = draft_seconds / draft_steps
            self.draft_step = step if self.draft_step is None else 0.8 * self.draft_step + 0.2 * step

    @property
    def ratio(self) -> float:
        if self.spec.cost_ratio is not None:
            return self.spec.cost_ratio
        if self.draft_step is None or not self.target_step:
            return 0.25  # until measured: a small drafter's typical cost
        return self.draft_step / self.target_step


class _KController:
    """One request's K: fixed, or the K with the best predicted speedup for its measured acceptance."""

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.accepted = 0.0
        self.trials = 0.0
        self.off_at: int | None = None  # tokens generated when drafting was switched off

    def acceptance(self) -> float:
        s = self.spec
        return acceptance_estimate(self.accepted, self.trials, s.prior_acceptance, s.prior_weight)

    def next_k(self, generated: int, cost_ratio: float) -> int:
        s = self.spec
        if not s.adaptive or not self.trials:  # adaptive K starts at k until a drafted round is seen
            return s.k
        k = choose_k(self.acceptance(), cost_ratio, s.verify_slope, s.k_min, s.k_max, s.min_speedup)
        if k:
            self.off_at = None
            return k
        if self.off_at is None:
            self.off_at = generated
        if generated - self.off_at >= s.probe_every:  # probe: the traffic, or the drafter, may have changed
            self.off_at = generated
            return s.k_min
        return 0

    def observe(self, k: int, n: int) -> None:
        if k == 0:
            return
        self.accepted = self.accepted * self.spec.decay + n
        self.trials = self.trials * self.spec.decay + n + (n < k)


# ----------------------------------------------------------------------------------------------
# The engine.


class SpeculativeEngine:
    """Decode batches of requests with a target and (optionally) a drafter.

    `drafter` may be replaced at any time by `swap_drafter`; the switch takes effect between rounds, and a
    request that sees it re-feeds its sequence to the new drafter's fresh cache. With no drafter the engine
    decodes plainly (K = 0).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter | None,
        spec: SpecConfig,
        stop_ids: set[int] | frozenset[int] = frozenset(),
        max_batch: int = 8,
    ):
        self.target = target
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
            self._check_drafter(drafter)
        self.costs = _Costs(spec)

    # -- drafter pointer --------------------------------------------------------------------------

    @property
    def drafter(self) -> Drafter | None:
        with self._lock:
            return self._drafter

    def abort(self) -> None:
        """Stop decoding for good (shutdown): a `generate` in progress raises DviError at its next round boundary,
        so the decoding thread is out of the model's code before the process exits."""
        self._abort.set()

    def swap_drafter(self, drafter: Drafter | None) -> None:
        """Install a new drafter; decoding picks it up at the next round boundary."""
        if drafter is not None:
            self._check_drafter(drafter)
        with self._lock:
            self._drafter = drafter

    def _check_drafter(self, drafter: Drafter) -> None:
        if int(drafter.model.config.vocab_size) != self.vocab_size:
            raise DviError(
                f"drafter {drafter.version!r} has vocabulary size {drafter.model.config.vocab_size}, "
                f"the target has {self.vocab_size}"
            )

    # -- requests ---------------------------------------------------------------------------------

    def check_request(self, r: Request) -> None:
        if not r.prompt_ids:
            raise DviError("empty prompt: give at least one token")
        if len(r.prompt_ids) >= self.window:
            raise DviError(f"prompt of {len(r.prompt_ids)} tokens does not fit the target's context window of {self.window}")
        if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.vocab_size:
            raise DviError(f"prompt token ids must be in [0, {self.vocab_size})")
        check_sampling(r.temperature, r.top_p, r.max_new_tokens)

    @torch.inference_mode()
    def generate(self, requests: list[Request], on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Result]:
        """Decode `requests` (in batches of `max_batch`). `on_tokens(i, ids)`, if given, is called on the decoding
        thread after every round with the tokens request i gained in it (for streaming)."""
        for r in requests:
            self.check_request(r)
        results: list[Result] = []
        for i in range(0, len(requests), self.max_batch):
            emit = (lambda j, ids, i=i: on_tokens(i + j, ids)) if on_tokens is not None else None
            results += self._generate_batch(requests[i : i + self.max_batch], emit)
        return results

    def _generate_batch(self, reqs: list[Request], on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Result]:
        start = time.perf_counter()
        batch = len(reqs)
        rows = list(range(batch))  # active row -> request index
        out: list[list[int]] = [[] for _ in reqs]
        rounds: list[list[Round]] = [[] for _ in reqs]
        stats = [SpecStats() for _ in reqs]
        versions: list[list[str]] = [[] for _ in reqs]
        finish = [""] * batch
        budget = [min(r.max_new_tokens, self.window - len(r.prompt_ids)) for r in reqs]
        gens = [torch.Generator().manual_seed(r.seed if r.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1) for r in reqs]
        ctrl = [_KController(self.spec) for _ in reqs]
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=self.device)
        top_ps = torch.tensor([r.top_p for r in reqs], dtype=torch.float32, device=self.device)

        tgt = _KV([r.prompt_ids for r in reqs], self.device)
        drafter = self.drafter
        dft = _KV([r.prompt_ids for r in reqs], self.device)
        first_round = True

        while rows:
            if self._abort.is_set():
                raise DviError("decoding was aborted: the server is shutting down")
            current = self.drafter  # one drafter for the whole round
            if current is not drafter:  # hot-swapped: the new drafter starts from a fresh cache
                drafter = current
                dft = _KV([reqs[i].prompt_ids + out[i] for i in rows], self.device)
            idx = torch.tensor(rows, device=self.device)
            ks = []
            for i in rows:
                k = ctrl[i].next_k(len(out[i]), self.costs.ratio) if drafter is not None else 0
                ks.append(max(0, min(k, budget[i] - len(out[i]) - 1)))  # never draft past the budget
            k_row = torch.tensor(ks, device=self.device)
            kmax = max(ks)
            # each row draws 2 k + 1 uniforms from its own generator, however long the other rows draft, so a
            # seeded request samples the same tokens alone or in any batch; drafts past k use u = 0 (ignored)
            u_draft, u_accept, u_sample = torch.zeros(len(rows), kmax), torch.zeros(len(rows), kmax), torch.zeros(len(rows))
            for b, (i, kb) in enumerate(zip(rows, ks)):
                u = torch.rand(2 * kb + 1, generator=gens[i])
                u_draft[b, :kb], u_accept[b, :kb], u_sample[b] = u[:kb], u[kb : 2 * kb], u[-1]
            u_draft, u_accept, u_sample = (u.to(self.device) for u in (u_draft, u_accept, u_sample))
            temp, top_p = temps[idx], top_ps[idx]

            t0 = time.perf_counter()
            draft_ids = torch.zeros(len(rows), 0, dtype=torch.long, device=self.device)  # [B, Kmax]
            q = torch.zeros(len(rows), 0, self.vocab_size, device=self.device)  # [B, Kmax, V]
            if kmax:
                draft_ids, q = self._draft(drafter, dft, kmax, temp, top_p, u_draft)
            t1 = time.perf_counter()
            logits = tgt.forward(self.target, draft_ids, keep=kmax + 1)  # [B, Kmax + 1, V]
            p = logits_to_probs(logits, temp, top_p)  # [B, Kmax + 1, V]
            n, token = rejection_sample(draft_ids, q, p, k_row, u_accept, u_sample)
            topk = self.spec.topk_logprobs
            if topk:
                top_lp, top_ids = torch.log_softmax(logits.float(), -1).topk(topk, -1)  # [B, Kmax + 1, topk]
            t2 = time.perf_counter()
            if not first_round:  # the first round also prefills the prompts: not a representative cost
                self.costs.observe(t1 - t0, kmax, t2 - t1, kmax)
            first_round = False

            # roll both caches back to the accepted prefix
            j = torch.arange(1, kmax + 1, device=self.device)
            tgt.keep_last(j.unsqueeze(0) <= n.unsqueeze(1))  # slots of d_1..d_Kmax
            tgt.pending = [[int(t)] for t in token]
            if kmax:
                dft.keep_last(j[:-1].unsqueeze(0) <= n.unsqueeze(1))  # slots of d_1..d_{Kmax-1}
                dft.pending = [([int(draft_ids[b, -1])] if int(n[b]) == kmax else []) + [int(token[b])] for b in range(len(rows))]
            else:
                for b in range(len(rows)):
                    dft.pending[b].append(int(token[b]))

            done = []
            for b, i in enumerate(rows):
                nb, kb = int(n[b]), ks[b]
                version = drafter.version if drafter is not None and kb else None
                if version and (not versions[i] or versions[i][-1] != version):
                    versions[i].append(version)
                rounds[i].append(
                    Round(
                        position=len(out[i]),
                        k=kb,
                        drafted=draft_ids[b, :kb].tolist(),
                        accepted=nb,
                        token=int(token[b]),
                        drafter_version=version,
                        topk_ids=top_ids[b, : kb + 1].clone() if topk else None,
                        topk_logprobs=top_lp[b, : kb + 1].clone() if topk else None,
                    )
                )
                stats[i].add(kb, nb)
                ctrl[i].observe(kb, nb)
                before = len(out[i])
                for t in draft_ids[b, :nb].tolist() + [int(token[b])]:
                    out[i].append(t)
                    if t in self.stop_ids:
                        finish[i] = "stop"
                        break
                    if len(out[i]) >= budget[i]:
                        finish[i] = "length"
                        break
                if on_tokens is not None:
                    on_tokens(i, out[i][before:])
                if finish[i]:
                    done.append(b)
            if done:
                keep = [b for b in range(len(rows)) if b not in done]
                rows = [rows[b] for b in keep]
                if rows:
                    tgt.select(keep)
                    dft.select(keep)
            tgt.compact()
            dft.compact()

        seconds = time.perf_counter() - start
        return [
            Result(r.request_id, list(r.prompt_ids), out[i], finish[i], versions[i], rounds[i], stats[i], seconds)
            for i, r in enumerate(reqs)
        ]

    def _draft(
        self, drafter: Drafter, dft: _KV, kmax: int, temp: torch.Tensor, top_p: torch.Tensor, u_draft: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose kmax tokens per row. Returns draft ids [B, Kmax] (target ids) and q [B, Kmax, V]."""
        drafts, qs = [], []
        logits = dft.forward(drafter.model, None, keep=1)[:, -1]  # [B, Vd]
        for j in range(kmax):
            q_j = logits_to_probs(logits, temp, top_p)  # [B, Vd]
            d = sample_from(q_j, u_draft[:, j])  # [B] drafter-vocabulary ids
            if drafter.vocab_map is not None:
                d = drafter.vocab_map[d]
            drafts.append(d)
            qs.append(q_j)
            if j < kmax - 1:
                logits = dft.forward(drafter.model, d.unsqueeze(1), keep=1)[:, -1]
        q = expand_draft_probs(torch.stack(qs, 1), drafter.vocab_map, self.vocab_size)  # [B, Kmax, V]
        return torch.stack(drafts, 1), q
