"""The KV state of speculative decoding over a batch of sequences of different lengths: `BatchKV` for a causal LM
(the target, a layer drafter) and `FeatureKV` for an EAGLE-3 drafter, which feeds each token beside a target feature.

Rows accept different numbers of drafted tokens each round; rather than copying caches to re-align them, a rejected
slot stays in the cache as a masked "hole" (a 4D attention mask hides it, explicit position ids skip it) and holes are
squeezed out when they grow (`BatchKV.compact`). Rows join (`add_rows`) and leave (`select`) between rounds.

This module knows transformers' `DynamicCache` and the models' forward signatures; what is fed when, and what is
accepted, are `dvi.engine`'s.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from dvi.eagle3 import Eagle3Drafter
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


class FeatureKV(BatchKV):
    """An EAGLE-3 drafter's KV cache (`dvi.eagle3.Eagle3Drafter.decode`), slots and holes as `BatchKV`'s. Each pending
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


def drafter_cache(model, pending: list[list[int]], device: torch.device) -> BatchKV:
    """An empty cache for a drafter's `model` (None: no drafter) with `pending` tokens to feed: an EAGLE-3 drafter's
    feeds each beside a zero feature (a warm-up's; decoding feeds the target's, `FeatureKV.feed`)."""
    if isinstance(model, Eagle3Drafter):
        width = model.config.hidden_size
        return FeatureKV(pending, [torch.zeros(len(p), width, device=device) for p in pending], width, device)
    return BatchKV(pending, device)
