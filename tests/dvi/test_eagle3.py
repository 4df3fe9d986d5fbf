"""EAGLE-3 drafters (`dvi.eagle3`): the draft-vocabulary maps, the target's features, and the drafter's forward
against a hand-written one; all on tiny random Llamas."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig

from dvi.eagle3 import (Eagle3Drafter, check_vocab_maps, default_layer_ids, target_features, target_ids, to_draft_ids,
                        to_target_logits, ttt_logits, ttt_loss, vocab_maps, weight_shapes)
from dvi.errors import DviError

VOCAB = 97


def tiny_config(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw)


def random_drafter(seed: int = 0, norm_before_residual: bool = False, draft: int = 40) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(tiny_config(), draft, (1, 2, 3), torch.randn(VOCAB, 32), norm_before_residual=norm_before_residual)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)  # norms too: a test of where each norm sits must see non-unit weights
    drafter.set_vocab(torch.randperm(VOCAB)[:draft].sort().values)
    return drafter.eval()


def test_vocab_maps_round_trip():
    ids = torch.tensor([0, 3, 4, 50, 96])
    d2t, t2d = vocab_maps(ids, VOCAB)
    assert torch.equal(target_ids(d2t), ids)
    assert torch.equal(t2d.nonzero().flatten(), ids) and t2d.sum() == 5
    assert torch.equal(d2t, torch.tensor([0, 2, 2, 47, 92]))
    check_vocab_maps(d2t, t2d)
    with pytest.raises(DviError, match="same draft vocabulary"):
        check_vocab_maps(d2t, t2d.roll(1))
    for bad in ([3, 3], [4, 2], [0, VOCAB], [-1]):
        with pytest.raises(DviError):
            vocab_maps(bad, VOCAB)


def test_draft_logits_map_to_target_ids():
    d2t, _ = vocab_maps([1, 5, 9], VOCAB)
    logits = torch.tensor([[0.5, 2.0, -1.0]])
    full = to_target_logits(logits, d2t, VOCAB)
    assert full.shape == (1, VOCAB) and int(full.argmax()) == 5
    assert full[0, 9] == -1.0 and torch.isinf(full[0, 0]) and full[0].isfinite().sum() == 3


def test_target_features_are_the_stream_entering_each_layer(make_tiny_llama):
    target = make_tiny_llama(seed=0, layers=4)
    x = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        hs = target(input_ids=x, output_hidden_states=True).hidden_states  # [embeddings, after layer 0, ...]
        feats = target_features(target, x, (3, 0, 2))
    assert feats.shape == (2, 7, 3 * 32)
    assert torch.allclose(feats, torch.cat([hs[0], hs[2], hs[3]], -1))  # ascending layer order, as vLLM collects them
    assert default_layer_ids(30) == (2, 15, 27)


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_forward(d: Eagle3Drafter, hidden: torch.Tensor, ids: torch.Tensor):
    """vLLM's LlamaForCausalLMEagle3 for one sequence, written out: [T, N] logits and [T, hidden] pre-norm output."""
    c, m, a = d.config, d.midlayer, d.midlayer.self_attn
    eps, t = c.rms_norm_eps, ids.shape[0]
    embeds = rms(d.embed_tokens.weight[ids], m.input_layernorm.weight, eps)
    normed = rms(hidden, m.hidden_norm.weight, eps)
    residual = normed if d.norm_before_residual else hidden
    x = torch.cat([embeds, normed], -1)
    hd = a.head_dim
    q = (x @ a.q_proj.weight.T).view(t, a.heads, hd)
    k = (x @ a.k_proj.weight.T).view(t, a.kv_heads, hd)
    v = (x @ a.v_proj.weight.T).view(t, a.kv_heads, hd)
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(t).float()[:, None] * inv[None]  # [T, hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]

    def rope(z):
        half = torch.cat([-z[..., hd // 2:], z[..., : hd // 2]], -1)
        return z * cos + half * sin

    q, k = rope(q), rope(k)
    group = a.heads // a.kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1) @ a.o_proj.weight.T
    residual = attn + residual
    y = rms(residual, m.post_attention_layernorm.weight, eps)
    mlp = m.mlp
    y = (torch.nn.functional.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    prenorm = y + residual
    return rms(prenorm, d.norm.weight, eps) @ d.lm_head.weight.T, prenorm


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_drafter_forward_equals_a_hand_written_one(norm_before_residual):
    d = random_drafter(seed=1, norm_before_residual=norm_before_residual)
    aux = torch.randn(2, 9, 3 * 32)
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        logits, prenorm = d(d.fuse(aux), ids)
        for b in range(2):
            ref_logits, ref_prenorm = reference_forward(d, aux[b] @ d.fc.weight.T, ids[b])
            assert torch.allclose(prenorm[b], ref_prenorm, atol=1e-4)
            assert torch.allclose(logits[b], ref_logits, atol=1e-4)
            drafted = target_ids(d.d2t)[ref_logits.argmax(-1)]
            assert torch.equal(d.target_logits(logits[b]).argmax(-1), drafted)


def test_checkpoint_names_and_shapes_are_vllms():
    shapes = weight_shapes(tiny_config(), 40, 3)
    assert shapes == {
        "fc.weight": (32, 96), "norm.weight": (32,), "lm_head.weight": (40, 32), "d2t": (40,), "t2d": (VOCAB,),
        "midlayer.input_layernorm.weight": (32,), "midlayer.hidden_norm.weight": (32,),
        "midlayer.post_attention_layernorm.weight": (32,),
        "midlayer.self_attn.q_proj.weight": (32, 64), "midlayer.self_attn.k_proj.weight": (16, 64),
        "midlayer.self_attn.v_proj.weight": (16, 64), "midlayer.self_attn.o_proj.weight": (32, 32),
        "midlayer.mlp.gate_proj.weight": (64, 32), "midlayer.mlp.up_proj.weight": (64, 32),
        "midlayer.mlp.down_proj.weight": (32, 64),
    }
    assert set(random_drafter().weights()) == set(shapes)


def test_to_draft_ids():
    _, t2d = vocab_maps([2, 5, 9], VOCAB)
    assert to_draft_ids(torch.tensor([[5, 2, 3, 9]]), t2d).tolist() == [[1, 0, -1, 2]]


def test_training_steps_are_vllms_drafting_chain():
    """Step k of `ttt_logits` at index i is what the drafter drafts k steps after position i when run as vLLM does:
    one causal forward over the first pass up to i and its own outputs after it (tokens teacher-forced here)."""
    d = random_drafter(seed=2)
    feats, ids = torch.randn(1, 10, 3 * 32), torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        steps = ttt_logits(d, feats, ids, steps=3)
        first, _ = d(d.fuse(feats[:, :9]), ids[:, 1:])
        assert torch.allclose(steps[0], first, atol=1e-5)
        for i in (0, 3, 6):
            hidden, tokens = d.fuse(feats[:, : i + 1]), ids[:, 1 : i + 2]
            for k in range(3):
                logits, prenorm = d(hidden, tokens)
                assert torch.allclose(steps[k][0, i], logits[0, -1], atol=1e-4), (i, k)
                hidden = torch.cat([hidden, prenorm[:, -1:]], 1)
                tokens = torch.cat([tokens, ids[:, i + 2 + k : i + 3 + k]], 1)


@pytest.mark.parametrize("soft", [True, False])
def test_a_few_optimizer_steps_lower_the_ttt_loss(soft):
    d = random_drafter(seed=3)
    torch.manual_seed(4)
    feats, ids = torch.randn(4, 12, 3 * 32), torch.randint(0, VOCAB, (4, 12))
    teacher_logits = torch.randn(4, 12, VOCAB) * 3
    teacher_logits[..., target_ids(d.d2t)] += 2.0  # the target's mass mostly on the draft vocabulary
    teacher = teacher_logits if soft else teacher_logits.argmax(-1)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(25):
        loss = ttt_loss(d, feats, ids, teacher, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert d.embed_tokens.weight.grad is None  # the target's embedding stays the target's
    assert losses[-1] < 0.8 * losses[0] and min(losses[-5:]) < min(losses[:5]), losses
