"""EAGLE-3 drafters: the drafter vLLM 0.32 runs for `method: "eagle3"` (`LlamaForCausalLMEagle3`, vllm/model_executor/
models/llama_eagle3.py), as a torch module dvi can train, and its checkpoint in the speculators format vLLM reads.

An EAGLE-3 drafter drafts from the target's own features. For the token at position t the target's aux hidden states
(`target_features`: the residual stream entering each of `layer_ids`, as vLLM takes them) are fused by `fc`
([3 x target hidden] -> hidden); one Llama decoder layer (`midlayer`) reads the embedding of the token at t + 1
concatenated with the fused features (its q/k/v take 2 x hidden) and a reduced head (`lm_head`, draft vocabulary
only) predicts the token at t + 2. Its pre-norm output is the feature of its next step: step k > 0 feeds it back in
place of the target's. The target's embedding is shared (not saved). `d2t` maps draft ids to target ids
(target id = draft id + d2t[draft id]); `t2d` marks the target ids the draft vocabulary has. `ttt_loss` trains it
as EAGLE-3 does (training-time test: several drafting steps unrolled, each after the first on the drafter's own
output, attending as vLLM's drafting loop does).

On-disk layout of an eagle3 drafter (`save_eagle3`, read by `load_eagle3` and by vLLM with method eagle3):

    <dir>/config.json          speculators format: speculators_model_type "eagle3", speculators_config (its verifier:
                               the target's path and architecture), draft_vocab_size, target_hidden_size,
                               eagle_aux_hidden_state_layer_ids, norm_before_residual, transformer_layer_config
                               (a one-layer Llama config with the target's shapes)
    <dir>/model.safetensors    fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d
    <dir>/tokenizer*           the target's tokenizer, copied
    <dir>/dvi_drafter.json     version, parent, kind "eagle3", how it was built

This module knows the drafter's maths and files; not decoding, streams, serving or the store.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from dvi.errors import DviError
from dvi.model_files import require_model_dir
from dvi.models import (DRAFTER_META, EAGLE3, Drafter, corpus_texts, end_ids, frequent_token_ids, load_causal_lm,
                        load_tokenizer, read_drafter_meta, staged_dir)

KIND = EAGLE3  # the kind dvi_drafter.json records, and the speculators_model_type
WEIGHTS = "model.safetensors"
# what a speculators-format config.json holds beside transformer_layer_config (`eagle3_config` reads them)
SPECULATORS_VERSION = "0.3.0"
SPECULATIVE_TOKENS = 3  # the proposal method's default K, recorded for vLLM's speculators reader
SHARED_PREFIXES = ("embed_tokens.", "rotary.")  # state_dict entries a checkpoint leaves out: the target's embedding


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The aux layers vLLM 0.32 takes when a drafter names none (`get_eagle3_default_aux_hidden_state_layers`)."""
    return (2, num_layers // 2, num_layers - 3)


# ----------------------------------------------------------------------------------------------
# The draft vocabulary.


def vocab_maps(token_ids, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a draft vocabulary given as its target ids: d2t [N] int64 offsets (target id = draft id +
    d2t[draft id]), t2d [vocab_size] bool (True where the target id is in the draft vocabulary). The ids must be
    strictly increasing and inside the target vocabulary (t2d then fixes the order, as the speculators format has it)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if ids.numel() < 1 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise DviError(f"a draft vocabulary needs 1 or more ids in 0..{vocab_size - 1}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise DviError("a draft vocabulary's target ids must be strictly increasing (sorted, no repeats)")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id: arange + d2t (what vLLM's `compute_logits` scatters to)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """DviError unless d2t and t2d describe the same draft vocabulary (`vocab_maps` of some sorted ids)."""
    if d2t.ndim != 1 or t2d.ndim != 1 or t2d.dtype != torch.bool or d2t.dtype != torch.long:
        raise DviError(f"d2t must be int64 [N] and t2d bool [vocab], got {d2t.dtype} {tuple(d2t.shape)} and "
                       f"{t2d.dtype} {tuple(t2d.shape)}")
    want, mask = vocab_maps(target_ids(d2t), t2d.numel())
    if not torch.equal(want, d2t) or not torch.equal(mask, t2d):
        raise DviError("d2t and t2d do not describe the same draft vocabulary")


def to_target_logits(logits: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits [..., N] as target logits [..., vocab_size]: -inf outside the draft vocabulary (vLLM's mapping)."""
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., target_ids(d2t)] = logits
    return out


# ----------------------------------------------------------------------------------------------
# The target's features.


@contextmanager
def aux_hidden_states(target: nn.Module, layer_ids):
    """While open, the target's forwards record its aux hidden states (`target_features`' definition); yields a
    function giving those of the last forward, concatenated in ascending layer order: [B, T, len(ids) x hidden]."""
    ids = sorted(set(int(i) for i in layer_ids))
    inner = target.model
    n = len(inner.layers)
    if not ids or ids[0] < 0 or ids[-1] > n:
        raise DviError(f"aux layer ids must be in 0..{n}, got {list(layer_ids)}")
    got: dict[int, torch.Tensor] = {}

    def grab(i):
        def hook(module, args, kwargs):
            got[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    hooks = [(inner.layers[i] if i < n else inner.norm).register_forward_pre_hook(grab(i), with_kwargs=True) for i in ids]
    try:
        yield lambda: torch.cat([got[i] for i in ids], dim=-1)
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def target_features(target: nn.Module, input_ids: torch.Tensor, layer_ids,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The target's aux hidden states for `input_ids` [B, T], as vLLM 0.32 takes them for an EAGLE-3 drafter: for
    layer id i the residual stream entering decoder layer i (hidden states plus residual; id 0 is the embeddings, id
    num_layers the stream entering the final norm), concatenated in ascending layer order -> [B, T, len(ids) x hidden].
    Only the target's decoder runs (not its output layer); `attention_mask` [B, T] as its forward takes it."""
    with aux_hidden_states(target, layer_ids) as features:
        target.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return features()


# ----------------------------------------------------------------------------------------------
# The drafter.


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read `in_features` (2 x hidden in the first EAGLE-3 layer); causal, RoPE."""

    def __init__(self, config: LlamaConfig, in_features: int):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past=(), cached=None) -> tuple[torch.Tensor, tuple]:
        """(output, this step's (k, v)). `past`: the (k, v) of earlier drafting steps over the same T positions, the
        first from the first pass (attended causally), the others from steps that drafted on from each position
        (each position attends to its own only): vLLM's KV cache when each position is the last one drafted from.
        `cached`: instead, (a transformers `Cache` holding this layer's keys and values as layer 0, an additive mask
        [B, 1, T, cached + T]): the step's (k, v) are appended to the cache and attended under the mask."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cached is not None:
            cache, mask = cached
            keys, values = cache.update(k, v, 0)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        elif not past:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        else:
            out = _chained_attention(q, [(pk, pv) for pk, pv in past] + [(k, v)], self.heads // self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


def _chained_attention(q: torch.Tensor, kv: list, group: int) -> torch.Tensor:
    """Attention of q [B, H, T, D] over kv[0] causally and over each of kv[1:] at its own position only."""
    scale = q.shape[-1] ** -0.5
    keys = [k.repeat_interleave(group, 1) for k, _ in kv]
    values = [v.repeat_interleave(group, 1) for _, v in kv]
    t = q.shape[2]
    causal = (q @ keys[0].transpose(-1, -2)) * scale
    causal = causal.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    own = torch.stack([(q * k).sum(-1) * scale for k in keys[1:]], -1)  # [B, H, T, steps]
    weights = torch.cat([causal, own], -1).softmax(-1)
    return weights[..., :t] @ values[0] + sum(weights[..., t + j, None] * v for j, v in enumerate(values[1:]))


class Eagle3Layer(nn.Module):
    """vLLM's first EAGLE-3 decoder layer: embeddings and features normed apart, concatenated into attention."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = Eagle3Attention(config, 2 * h)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, hidden, cos, sin, past=(), cached=None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """(output, residual, this step's (k, v)) as vLLM's layer returns the first two: their sum is the stream after
        the layer. `past`, `cached`: see `Eagle3Attention.forward`."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x, kv = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), cos, sin, past, cached)
        residual = x + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual, kv


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter (see the module docstring). `config`: its one-layer Llama config (vocab_size is the
    target's); `embed`: the target's input embedding [vocab, hidden], held frozen and never saved. Loaded as a
    version (`load_eagle3`, `dvi.swap.load_announced`) it has a `version`; `kind` tells it from a layer
    drafter (`dvi.models.Drafter`) where either may serve."""

    kind = KIND
    version = ""

    def __init__(self, config: LlamaConfig, draft_vocab_size: int, layer_ids, embed: torch.Tensor | None = None,
                 target_hidden_size: int | None = None, norm_before_residual: bool = False):
        super().__init__()
        self.config = config
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.draft_vocab_size = int(draft_vocab_size)
        self.target_hidden_size = int(target_hidden_size or config.hidden_size)
        self.norm_before_residual = bool(norm_before_residual)
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        if embed is not None:
            self.embed_tokens.weight.data.copy_(embed)
        self.fc = nn.Linear(len(self.layer_ids) * self.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(config, self.norm_before_residual)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        if not 0 < self.draft_vocab_size <= config.vocab_size:
            raise DviError(f"draft vocabulary size must be in 1..{config.vocab_size}, got {self.draft_vocab_size}")
        # until set_vocab: the target's first draft_vocab_size ids
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < self.draft_vocab_size)

    def set_vocab(self, token_ids) -> None:
        """The draft vocabulary: the target ids of the head's rows, strictly increasing."""
        d2t, t2d = vocab_maps(token_ids, self.config.vocab_size)
        if d2t.numel() != self.draft_vocab_size:
            raise DviError(f"{d2t.numel()} draft ids for a head of {self.draft_vocab_size} rows")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states [..., len(layer_ids) x target hidden] fused to [..., hidden]."""
        return self.fc(aux)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits [B, T, N], pre-norm output [B, T, hidden]) for features `hidden` [B, T, hidden] (fused target
        features, or the drafter's own pre-norm output one step back) and the next tokens `input_ids` [B, T]."""
        logits, prenorm, _ = self.step(hidden, input_ids, positions)
        return logits, prenorm

    def step(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor | None = None, past=()):
        """`forward` that also takes the (k, v) of earlier drafting steps (`Eagle3Attention.forward`) and returns its
        own: (logits, pre-norm output, (k, v))."""
        prenorm, kv = self.trunk(hidden, input_ids, positions, past)
        return self.head(prenorm), prenorm, kv

    def trunk(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor | None = None, past=(),
              cached=None):
        """`step` without the head: (pre-norm output [B, T, hidden], this step's (k, v)); `cached`: see
        `Eagle3Attention.forward`."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        embeds = self.embed_tokens(input_ids)
        cos, sin = self.rotary(embeds, positions)
        out, residual, kv = self.midlayer(embeds, hidden, cos, sin, past, cached)
        return out + residual, kv

    def decode(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
               cache, keep: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward for a decoding loop that keeps this drafter's KV cache itself (`dvi.engine`): `hidden` [B, T,
        hidden] (fused target features, or the drafter's own pre-norm output where it drafts on), the next tokens
        `input_ids` [B, T] at `positions` [B, T], an additive `attention_mask` [B, 1, T, cached + T] over `cache` (a
        transformers `Cache`, layer 0 this drafter's) and the new slots. (draft logits [B, keep, N], pre-norm output
        [B, keep, hidden]) of the last `keep` positions."""
        prenorm, _ = self.trunk(hidden, input_ids, positions, cached=(cache, attention_mask))
        prenorm = prenorm[:, -keep:]
        return self.head(prenorm), prenorm

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def head(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., N] of pre-norm outputs [..., hidden]."""
        return self.lm_head(self.norm(prenorm))

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return to_target_logits(logits, self.d2t, self.config.vocab_size)

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds (vLLM's names): all but the shared embedding."""
        return {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()
                if not k.startswith(SHARED_PREFIXES)}


# ----------------------------------------------------------------------------------------------
# Training: training-time test (TTT).


def to_draft_ids(ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Target ids as draft ids; -1 where the draft vocabulary lacks the id."""
    draft = t2d.long().cumsum(0) - 1
    return torch.where(t2d[ids], draft[ids], torch.full_like(ids, -1))


def greedy_drafts(drafter: Eagle3Drafter, target: nn.Module, ids: list[int], n: int) -> list[int]:
    """The drafter's n greedy drafts (target ids) after `ids`, as vLLM's drafting loop runs it: its first pass reads the
    target's features of each position beside the next token (the last one predicts the token after `ids`); each further
    step reads its own output at the last position beside the token it drafted (`ttt_logits`' chain). A one-token
    sequence has no feature before its token: zero features."""
    x = torch.tensor([ids])
    dtype = drafter.fc.weight.dtype
    if len(ids) > 1:
        hidden, tokens = drafter.fuse(target_features(target, x[:, :-1], drafter.layer_ids).to(dtype)), x[:, 1:]
    else:
        hidden, tokens = torch.zeros(1, 1, drafter.config.hidden_size, dtype=dtype), x
    positions = torch.arange(tokens.shape[1])[None]
    past, new, vocab = [], [], target_ids(drafter.d2t)
    for k in range(n):
        logits, hidden, kv = drafter.step(hidden, tokens, positions + k, past)
        past.append(kv)
        new.append(int(vocab[logits[0, -1].argmax()]))
        tokens = tokens.clone()
        tokens[0, -1] = new[-1]  # the last position's next step reads the token it drafted
    return new


def ttt_logits(drafter: Eagle3Drafter, features: torch.Tensor, input_ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """Draft logits [B, T - 1, N] of each of `steps` drafting steps, as EAGLE-3 trains them (training-time test).

    `features`: the target's aux hidden states [B, T, n_aux x target hidden] (`target_features`) of `input_ids` [B, T].
    Index i is a draft made after position i: step 0 reads the target's feature of position i and the token at i + 1
    and predicts the token at i + 2; step k reads the drafter's own pre-norm output of step k - 1 and the token at
    i + 1 + k (teacher-forced) at position i + k and predicts the token at i + 2 + k, attending to the first pass
    causally and to its own earlier steps (vLLM's drafting, `Eagle3Attention.forward`). Entries whose token input
    would lie past the end hold a padding token and are to be ignored (`ttt_loss` masks them)."""
    return [drafter.head(prenorm) for prenorm in ttt_prenorms(drafter, features, input_ids, steps)]


def ttt_prenorms(drafter: Eagle3Drafter, features: torch.Tensor, input_ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """The drafter's pre-norm outputs [B, T - 1, hidden] of each drafting step of `ttt_logits` (whose logits are
    `drafter.head` of them): for a caller that needs the head at some positions only."""
    b, t = input_ids.shape
    hidden, past, out = drafter.fuse(features[:, : t - 1]), [], []
    base = torch.arange(t - 1, device=input_ids.device).expand(b, -1)
    for k in range(steps):
        tokens = F.pad(input_ids[:, 1 + k :], (0, k), value=0)  # [B, T - 1]: the token at i + 1 + k
        hidden, kv = drafter.trunk(hidden, tokens, base + k, past)
        past.append(kv)
        out.append(hidden)
    return out


def ttt_prenorms_at(drafter: Eagle3Drafter, features: torch.Tensor, input_ids: torch.Tensor, want: torch.Tensor,
                    steps: int = 3) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`ttt_prenorms` at the draft indices `want` [B, T - 1] (bool) only: (per step, the pre-norm outputs [B, Q,
    hidden] at each row's wanted indices in ascending order, Q the most any row wants; `slots` [B, T - 1], the place
    of a wanted index there, -1 elsewhere). Equal to `ttt_prenorms(...)[k][b, i]` at every wanted (b, i), for a
    fraction of its work where few indices are wanted (the teacher positions of records with long prompts): the
    first pass computes the keys and values of every index, which the wanted ones attend to, but its queries, attention,
    output projection and MLP at the wanted indices alone, and each later step runs at the wanted indices alone (a
    step at index i reads the step before at i only)."""
    b, t = input_ids.shape
    n = t - 1
    layer, attn = drafter.midlayer, drafter.midlayer.self_attn
    heads, kv_heads, dim = attn.heads, attn.kv_heads, attn.head_dim
    device = input_ids.device
    counts = want.sum(1)  # [B]
    q_len = max(int(counts.max()) if b else 0, 1)
    slots = torch.where(want, want.long().cumsum(1) - 1, torch.full_like(want, -1, dtype=torch.long))  # [B, n]
    valid = torch.arange(q_len, device=device)[None, :] < counts[:, None]  # [B, Q]
    index = torch.zeros(b, q_len, dtype=torch.long, device=device)  # [B, Q] the draft index of each slot
    rows, cols = want.nonzero(as_tuple=True)
    index[rows, slots[rows, cols]] = cols

    def pick(x: torch.Tensor) -> torch.Tensor:  # [B, n, ...] at the slots' indices -> [B, Q, ...]
        return x.gather(1, index.view(b, q_len, *([1] * (x.dim() - 2))).expand(b, q_len, *x.shape[2:]))

    # the first pass's keys and values at every index (what every step attends to causally)
    hidden = drafter.fuse(features[:, :n])  # [B, n, hidden]
    normed = layer.hidden_norm(hidden)
    x = torch.cat([layer.input_layernorm(drafter.embed_tokens(input_ids[:, 1:])), normed], dim=-1)  # [B, n, 2 hidden]
    cos, sin = drafter.rotary(x, torch.arange(n, device=device).expand(b, -1))
    k0 = _rope(attn.k_proj(x).view(b, n, kv_heads, dim).transpose(1, 2), cos, sin)  # [B, kvH, n, D]
    v0 = attn.v_proj(x).view(b, n, kv_heads, dim).transpose(1, 2)
    group = heads // kv_heads
    k0, v0 = k0.repeat_interleave(group, 1), v0.repeat_interleave(group, 1)  # [B, H, n, D]
    causal = torch.arange(n, device=device)[None, None, :] <= index[:, :, None]  # [B, Q, n]
    scale = dim ** -0.5

    h = pick(hidden)  # [B, Q, hidden]: step 0 reads the target's features, later steps the step before
    own: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = []
    for k in range(steps):
        tokens = pick(F.pad(input_ids[:, 1 + k :], (0, k), value=0))  # [B, Q] the token at i + 1 + k
        positions = index + k
        normed_k = layer.hidden_norm(h)
        residual = normed_k if layer.norm_before_residual else h
        xk = torch.cat([layer.input_layernorm(drafter.embed_tokens(tokens)), normed_k], dim=-1)  # [B, Q, 2 hidden]
        cos_k, sin_k = drafter.rotary(xk, positions)
        q = _rope(attn.q_proj(xk).view(b, q_len, heads, dim).transpose(1, 2), cos_k, sin_k)  # [B, H, Q, D]
        scores = (q @ k0.transpose(-1, -2)) * scale  # [B, H, Q, n]
        scores = scores.masked_fill(~causal[:, None], float("-inf"))
        if k:  # a later step attends to its own earlier steps' keys at its index, and to its own
            kk = _rope(attn.k_proj(xk).view(b, q_len, kv_heads, dim).transpose(1, 2), cos_k, sin_k)
            vv = attn.v_proj(xk).view(b, q_len, kv_heads, dim).transpose(1, 2)
            own.append((kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)))
            mine = torch.stack([(q * ok).sum(-1) * scale for ok, _ in own], -1)  # [B, H, Q, k]
            weights = torch.cat([scores, mine], -1).softmax(-1)
            mixed = weights[..., :n] @ v0 + sum(weights[..., n + j, None] * ov for j, (_, ov) in enumerate(own))
        else:
            mixed = scores.softmax(-1) @ v0  # [B, H, Q, D]
        o = attn.o_proj(mixed.transpose(1, 2).reshape(b, q_len, heads * dim))
        residual = o + residual
        h = layer.mlp(layer.post_attention_layernorm(residual)) + residual  # the stream after the layer: pre-norm
        out.append(torch.where(valid[..., None], h, torch.zeros_like(h)))
    return out, slots


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, T, D] at the positions of cos, sin [B, T, D] (`apply_rotary_pos_emb`'s)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def ttt_loss(drafter: Eagle3Drafter, features: torch.Tensor, input_ids: torch.Tensor, teacher: torch.Tensor,
             steps: int = 3) -> torch.Tensor:
    """The drafter's loss over `steps` drafting steps (`ttt_logits`), averaged over steps and valid positions.

    `teacher`: the target's logits [B, T, vocab] at each position (soft targets: cross-entropy against the target's
    next-token distribution restricted to the draft vocabulary and renormalised there, a KL divergence up to a
    constant) or its next tokens [B, T] as ids (hard targets, predicted at position i for the token at i + 1;
    positions whose token is outside the draft vocabulary do not count)."""
    b, t = input_ids.shape
    ids = target_ids(drafter.d2t)
    losses = []
    for k, logits in enumerate(ttt_logits(drafter, features, input_ids, steps)):
        n = t - 1 - k  # draft index i predicts the target's distribution at position i + 1 + k, for i < T - 1 - k
        if n <= 0:
            break
        logp = logits[:, :n].log_softmax(-1)
        if teacher.is_floating_point():
            p = teacher[:, 1 + k : 1 + k + n, ids].float().softmax(-1)
            losses.append(-(p * logp).sum(-1).mean())
        else:
            want = to_draft_ids(teacher[:, 1 + k : 1 + k + n], drafter.t2d)
            if bool((want >= 0).any()):
                losses.append(F.nll_loss(logp.reshape(-1, logp.shape[-1]), want.reshape(-1), ignore_index=-1))
    if not losses:
        raise DviError(f"no position to train on: {t} tokens for {steps} drafting steps")
    return torch.stack(losses).mean()


def weight_shapes(config: LlamaConfig, draft_vocab_size: int, n_aux: int, target_hidden_size: int | None = None
                  ) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor an eagle3 checkpoint with this config holds (no weights are made)."""
    with torch.device("meta"):
        model = Eagle3Drafter(config, draft_vocab_size, range(n_aux), target_hidden_size=target_hidden_size)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(SHARED_PREFIXES)}


# ----------------------------------------------------------------------------------------------
# The speculators format.


def layer_config(target_config) -> LlamaConfig:
    """The drafter's one-layer Llama config: the target's shapes, untied, no code to run."""
    raw = {k: v for k, v in target_config.to_dict().items() if not k.startswith("_") and k not in ("auto_map", "architectures")}
    raw.update(num_hidden_layers=1, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"])
    raw.pop("layer_types", None)
    return LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})


def speculators_config(drafter: Eagle3Drafter, verifier: str, verifier_architectures) -> dict:
    """config.json of a drafter in the speculators format (vLLM's `SpeculatorsConfig` reads it)."""
    layer = {k: v for k, v in drafter.config.to_dict().items() if not k.startswith("_")}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": KIND,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": KIND,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS}],
            "verifier": {"name_or_path": str(verifier), "architectures": list(verifier_architectures or [])},
        },
        "draft_vocab_size": drafter.draft_vocab_size,
        "target_hidden_size": drafter.target_hidden_size,
        "norm_before_residual": drafter.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(drafter.layer_ids),
        "transformer_layer_config": layer,
    }


def is_eagle3_config(raw: dict) -> bool:
    return isinstance(raw, dict) and raw.get("speculators_model_type") == KIND


def eagle3_config(raw: dict) -> tuple[LlamaConfig, dict]:
    """(layer config, eagle fields: draft_vocab_size, layer_ids, target_hidden_size, norm_before_residual) of a
    speculators-format config.json; DviError for one that is not an eagle3 drafter's or is malformed. Defaults are
    vLLM's for the speculators format (norm_before_residual true when absent)."""
    if not is_eagle3_config(raw):
        raise DviError("not an eagle3 drafter config (speculators_model_type is not 'eagle3')")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DviError("an eagle3 config needs transformer_layer_config, a JSON object")
    try:
        config = LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"})
        ids = [int(i) for i in raw["eagle_aux_hidden_state_layer_ids"]]
        fields = {"draft_vocab_size": int(raw["draft_vocab_size"]), "layer_ids": ids,
                  "target_hidden_size": int(raw.get("target_hidden_size") or config.hidden_size),
                  "norm_before_residual": bool(raw.get("norm_before_residual", True))}
        verifier = raw["speculators_config"]["verifier"]["name_or_path"]
    except (KeyError, TypeError, ValueError) as e:
        raise DviError(f"malformed eagle3 config: {type(e).__name__}: {e}") from None
    if layer.get("model_type", "llama") != "llama" or config.num_hidden_layers != 1:
        raise DviError("dvi's eagle3 drafters are one Llama layer (transformer_layer_config model_type llama, 1 layer)")
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])):
        raise DviError(f"eagle_aux_hidden_state_layer_ids must be strictly increasing, got {ids}")
    fields["verifier"] = str(verifier)
    return config, fields


def save_eagle3(drafter: Eagle3Drafter, out: Path, target_dir: Path, meta: dict, tokenizer=None) -> Path:
    """Write `drafter` to `out` (replacing it, atomically) in the layout of the module docstring."""
    target_dir = Path(target_dir)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    with staged_dir(out, ".eagle3-") as staging:
        (staging / "config.json").write_text(json.dumps(
            speculators_config(drafter, target_dir.resolve(), target_cfg.get("architectures")), indent=2))
        save_file(drafter.weights(), str(staging / WEIGHTS), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        (staging / DRAFTER_META).write_text(json.dumps({**meta, "kind": KIND}, indent=2))
    return Path(out)


def read_target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's input embedding, read alone from its safetensors files."""
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.embed_tokens.weight" in st.keys():
                return st.get_tensor("model.embed_tokens.weight")
    raise DviError(f"no model.embed_tokens.weight in the safetensors files of {str(target_dir)!r}")


def load_eagle3(path: str | Path, target_dir: str | Path | None = None, dtype: torch.dtype = torch.float32,
                embed: torch.Tensor | None = None) -> Eagle3Drafter:
    """An eagle3 drafter from its directory; the shared embedding `embed` (the target's input embedding [vocab,
    hidden]), or read from `target_dir` (default: its verifier's path)."""
    p = require_model_dir(path, "eagle3 drafter")
    config, fields = eagle3_config(json.loads((p / "config.json").read_text()))
    if embed is None:
        embed = read_target_embedding(Path(target_dir or fields["verifier"]).expanduser())
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise DviError(f"eagle3 drafter at {str(p)!r} has vocabulary x hidden {config.vocab_size} x {config.hidden_size}, "
                       f"the target's embedding is {tuple(embed.shape)}")
    weights = load_file(str(p / WEIGHTS))
    drafter = Eagle3Drafter(config, fields["draft_vocab_size"], fields["layer_ids"], embed,
                            fields["target_hidden_size"], fields["norm_before_residual"])
    expected = weight_shapes(config, fields["draft_vocab_size"], len(fields["layer_ids"]), fields["target_hidden_size"])
    found = {k: tuple(v.shape) for k, v in weights.items()}
    if found != expected:
        bad = sorted(set(found) ^ set(expected)) + sorted(k for k in found.keys() & expected.keys() if found[k] != expected[k])
        raise DviError(f"eagle3 drafter at {str(p)!r}: weights do not fit its config ({bad[:4]})")
    check_vocab_maps(weights["d2t"], weights["t2d"])
    drafter.load_state_dict(weights, strict=False)
    drafter.version = str(read_drafter_meta(p).get("version", p.name))
    return drafter.to(dtype).eval()


def load_for_target(path: str | Path, target: nn.Module, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> Drafter:
    """An eagle3 drafter directory as a `dvi.models.Drafter` of `target` (a loaded target model): `.model` the
    `Eagle3Drafter` (its shared embedding a copy of the target's), `.vocab_map` the target ids of its draft
    vocabulary, `.version` its version. DviError for one that does not fit the target (vocabulary, hidden size, aux
    layers)."""
    p = require_model_dir(path, "eagle3 drafter")
    config, fields = eagle3_config(json.loads((p / "config.json").read_text()))
    tc = target.config
    problems = [f"vocabulary {config.vocab_size}, the target's is {tc.vocab_size}" if config.vocab_size != tc.vocab_size else "",
                f"target_hidden_size {fields['target_hidden_size']}, the target's is {tc.hidden_size}"
                if fields["target_hidden_size"] != tc.hidden_size else "",
                f"aux layers {fields['layer_ids']} outside the target's 0..{tc.num_hidden_layers}"
                if not all(0 <= i <= tc.num_hidden_layers for i in fields["layer_ids"]) else ""]
    if any(problems):
        raise DviError(f"eagle3 drafter at {str(p)!r} does not fit the target: {'; '.join(x for x in problems if x)}")
    model = load_eagle3(p, dtype=dtype, embed=target.get_input_embeddings().weight.detach()).to(device)
    return Drafter(model=model, version=model.version, vocab_map=target_ids(model.d2t))


def build_eagle3(target_dir: str | Path, out_dir: str | Path, vocab_n: int, texts: list[str] | None = None,
                 layer_ids=None, version: str | None = None) -> Path:
    """Build an EAGLE-3 drafter for the target at `target_dir` and save it at `out_dir` (speculators format).

    The draft vocabulary is the target's `vocab_n` most frequent tokens on `texts` (default `corpus_texts()`), its
    special and end-of-sequence ids always in. The aux layers default to vLLM's (2, L/2, L-3). It starts as the
    target's own computation where shapes allow: fc passes the highest aux layer's features through, the midlayer is
    that target layer (its q/k/v read the features half; the embedding half starts at zero), the final norm and the
    head rows are the target's. An untrained drafter so mostly repeats the target's last prediction: training
    (`ttt_loss`) teaches it the token after."""
    target_dir = require_model_dir(target_dir, "target")
    target = load_causal_lm(target_dir, "target")
    tokenizer = load_tokenizer(target_dir, "target")
    n_layers, vocab_size = target.config.num_hidden_layers, int(target.config.vocab_size)
    if not 0 < vocab_n < vocab_size:
        raise DviError(f"an eagle3 drafter's vocabulary must be in 1..{vocab_size - 1} (a reduced head), got {vocab_n}")
    ids = tuple(layer_ids) if layer_ids is not None else default_layer_ids(n_layers)
    if any(not 0 <= i < n_layers for i in ids):
        raise DviError(f"aux layer ids must be in 0..{n_layers - 1} for this target, got {list(ids)}")
    vocab = frequent_token_ids(tokenizer, vocab_n, texts if texts is not None else corpus_texts(),
                               include=end_ids(target, tokenizer))
    config = layer_config(target.config)
    drafter = Eagle3Drafter(config, vocab_n, ids, target.get_input_embeddings().weight.detach())
    init_from_target(drafter, target, vocab)
    meta = {"version": version or f"init-eagle3-v{vocab_n}", "parent": None, "built_from": str(target_dir),
            "layer_ids": list(ids), "draft_vocab": vocab_n}
    return save_eagle3(drafter, Path(out_dir).expanduser(), target_dir, meta, tokenizer)


@torch.no_grad()
def init_from_target(drafter: Eagle3Drafter, target: nn.Module, vocab: torch.Tensor) -> None:
    """Start `drafter` as the target's computation (see `build_eagle3`); `vocab`: the draft ids, sorted."""
    h, n_aux = drafter.config.hidden_size, len(drafter.layer_ids)
    high = max(drafter.layer_ids)
    layer = target.model.layers[high]
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, (n_aux - 1) * h:] = torch.eye(h)
    mid = drafter.midlayer
    mid.input_layernorm.weight.copy_(layer.input_layernorm.weight)
    mid.hidden_norm.weight.copy_(layer.input_layernorm.weight)
    mid.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(mid.self_attn, name).weight
        w.zero_()
        w[:, h:] = getattr(layer.self_attn, name).weight
    mid.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
    mid.mlp.load_state_dict(layer.mlp.state_dict())
    drafter.norm.weight.copy_(target.model.norm.weight)
    drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab])
    drafter.set_vocab(vocab)
