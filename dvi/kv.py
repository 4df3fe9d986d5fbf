"""The KV state of speculative decoding over a batch of sequences of different lengths: `BatchKV` for a causal LM
(the target), and a drafter's cache by its kind: `DraftKV` for a layer drafter (a causal LM fed the sequence's tokens,
as the target is) and `FeatureKV` for an EAGLE-3 drafter, which feeds each token beside a target feature.

Rows accept different numbers of drafted tokens each round; rather than copying caches to re-align them, a rejected
slot stays in the cache as a masked "hole" (a 4D attention mask hides it, explicit position ids skip it) and holes are
squeezed out when they grow (`BatchKV.compact`). Rows join (`add_rows`) and leave (`select`) between rounds.

A drafter's cache answers what the decoding loop asks of a drafter whatever its kind (`DraftKV`'s methods): how it
starts on rows already decoding, which target layers' states it reads, whether a row can draft, whether a round's
drafting is a representative cost, and what it keeps of a verified round. A third kind of drafter is a third class.

This module knows transformers' `DynamicCache` and the models' forward signatures; what is drafted, verified and
accepted is `dvi.engine`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from dvi.eagle3 import Eagle3Drafter, target_features
from dvi.models import cache_kwarg



class BatchKV:
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
        """Queue `tokens` for row b (`hidden`: their features, for `FeatureKV`)."""
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


@dataclass
class Accepted:
    """A verified round as a drafter's cache rolls back to it (`DraftKV.roll_back`)."""

    drafted: list[list[int]]  # each row's drafts d_1..d_Kmax (target ids)
    accepted: torch.Tensor  # [B] how many of them the target accepted
    accepted_list: list[int]  # the same, read once
    tokens: list[int]  # the token after each row's accepted prefix
    fed: list[list[int]]  # each row's tokens the verify forward fed before the drafts (right-aligned)
    features: torch.Tensor | None = None  # [B, Q, hidden] the fused target features of its positions, drafts included
    # (for a cache that reads them)

    @property
    def kmax(self) -> int:
        return len(self.drafted[0]) if self.drafted else 0


class DraftKV(BatchKV):
    """A layer drafter's cache: fed each row's tokens as the target is (its drafts, then the accepted ones), and the
    interface of every drafter's cache to the decoding loop (`dvi.engine.Decoding`). With no drafter, rows keep their
    tokens pending, never fed."""

    reads: tuple[int, ...] = ()  # the target layers whose aux hidden states it is fed (ascending): none

    @classmethod
    def fresh(cls, model, pending: list[list[int]], device: torch.device) -> DraftKV:
        """An empty cache for the drafter's `model` (what drafts, `dvi.drafter_kinds.DrafterKind.draft_model`) with
        `pending` tokens to feed (a warm-up's)."""
        return cls(pending, device)

    @classmethod
    def resume(cls, model, target, seqs: list[list[int]], seen: list[int], device: torch.device) -> DraftKV:
        """A fresh cache for rows decoding `seqs` so far, `seen[b]` of row b's tokens fed to the target already
        (a drafter swapped in mid-request): a layer drafter is fed every token of each."""
        return cls(seqs, device)

    def ready(self, b: int) -> bool:
        """Whether row b can draft this round."""
        return True

    def steady(self, k_max: int) -> bool:
        """Whether this round's drafting is a representative cost: each row feeds its last token, and its last draft
        where it accepted all of them (a prefill is not)."""
        return max(len(p) for p in self.pending) <= 2

    def fuse(self, states: torch.Tensor) -> torch.Tensor | None:
        """The features it is fed, from the target's aux hidden states at `reads` [..., len(reads) x hidden]: none."""
        return None

    def roll_back(self, v: Accepted) -> None:
        """Back to each row's accepted prefix after the verified round `v`: of its drafts d_1..d_Kmax the drafter fed
        d_1..d_{Kmax-1}; the accepted ones stay, the token after them and an accepted d_Kmax are pending."""
        kmax = v.kmax
        if not kmax:
            for b, t in enumerate(v.tokens):
                self.pending[b].append(t)
            return
        j = torch.arange(1, kmax, device=self.device)
        self.keep_last(j.unsqueeze(0) <= v.accepted.unsqueeze(1))  # slots of d_1..d_{Kmax-1}
        self.pending = [([v.drafted[b][-1]] if v.accepted_list[b] == kmax else []) + [t] for b, t in enumerate(v.tokens)]


class FeatureKV(DraftKV):
    """An EAGLE-3 drafter's KV cache (`dvi.eagle3.Eagle3Drafter.decode`), slots and holes as `BatchKV`'s. Each pending
    token comes with the feature it is fed beside (`hidden[b]` [n, hidden], one row per pending token): the fused
    target features of the position before it. Slot i holds (feature of position i, token i + 1), as vLLM's drafter
    cache does. An `extra` token is fed beside the drafter's own pre-norm output at the position before it (its
    last forward's, `prenorm`): drafting on from its own guess. A row drafts from its second round on (its prefill
    gives the first features), and drafts made on the drafter's own features are dropped from the cache once verified,
    the target's replacing them, as vLLM's EAGLE-3 proposer does."""

    def __init__(self, drafter: Eagle3Drafter, pending: list[list[int]], device: torch.device | str = "cpu"):
        super().__init__(pending, device)
        self.drafter = drafter
        self.reads = tuple(sorted(int(i) for i in drafter.layer_ids))
        self.width = drafter.config.hidden_size  # the drafter's hidden size
        self.hidden = [torch.zeros(len(p), self.width, device=self.device) for p in pending]  # pending tokens' features: zeros
        self.prenorm: torch.Tensor | None = None  # [B, 1, hidden] the last forward's output at each row's last slot
        # (within one round's drafting: rows joining or leaving drop it)

    @classmethod
    def fresh(cls, model, pending: list[list[int]], device: torch.device) -> FeatureKV:
        """Each pending token beside a zero feature (a warm-up's; decoding feeds the target's, `feed`)."""
        return cls(model, pending, device)

    @classmethod
    def resume(cls, model, target, seqs: list[list[int]], seen: list[int], device: torch.device) -> FeatureKV:
        """Fed, for each row, the positions the target has seen beside their features (recomputed by `target`)."""
        kv = cls(model, [[] for _ in seqs], device)
        for b, (seq, k) in enumerate(zip(seqs, seen)):
            if k:
                ids = torch.tensor([seq[:k]], device=device)
                kv.feed(b, seq[1 : k + 1], model.fuse(target_features(target, ids, model.layer_ids))[0])
        return kv

    def ready(self, b: int) -> bool:
        return self.length[b] > 0 or len(self.pending[b]) > 0  # the target's features of it are fed or queued

    def steady(self, k_max: int) -> bool:
        return max(len(p) for p in self.pending) <= k_max + 1  # each kept position of a round: up to K + 1

    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        return self.drafter.fuse(states)

    def roll_back(self, v: Accepted) -> None:
        batch, kmax, width = len(v.tokens), v.kmax, max(len(f) for f in v.fed)
        # the drafter's slots of d_1..d_{Kmax-1} came from its own features: the target's replace them
        self.keep_last(torch.zeros(batch, max(kmax - 1, 0), dtype=torch.bool, device=self.device))
        for b in range(batch):  # each position the target fed and kept, beside the token after it
            n, fed = v.accepted_list[b], v.fed[b]
            seen = fed + v.drafted[b][:n]
            self.feed(b, seen[1:] + [v.tokens[b]], v.features[b, width - len(fed) : width + n])

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
