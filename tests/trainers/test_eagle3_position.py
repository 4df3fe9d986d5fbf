"""The trainer's EAGLE-3 parts on tiny random models: `Eagle3PositionLM` (where its logits sit against the teacher
positions of `PositionLM`), its unrolled drafting steps and their loss, loading an EAGLE-3 drafter directory as a
`Drafter`, and publishing one into the model store in the speculators format the servers' checks accept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dvi import store
from dvi.control import DrafterPublished
from dvi.eagle3 import (Eagle3Drafter, init_from_target, layer_config, save_eagle3, target_features, target_ids,
                        ttt_logits, weight_shapes)
from dvi.errors import DviError
from dvi.models import drafter_kind, load_drafter
from dvi.pairs import load_any_drafter
from dvi.swap import load_announced
from trainers.data import Batch
from trainers.losses import position_loss, teacher_from_logits
from trainers.students import Eagle3PositionLM, PositionLM, ttt_position_loss

VOCAB = 97
DRAFT = 40
LAYER_IDS = (0, 1, 2)  # of the 3-layer tiny target: the highest is its last layer


def draft_vocab(seed: int = 5) -> torch.Tensor:
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT].sort().values


def random_eagle3(target, seed: int = 0) -> Eagle3Drafter:
    """An EAGLE-3 drafter of `target` with random weights everywhere (its embedding half included)."""
    torch.manual_seed(seed)
    d = Eagle3Drafter(layer_config(target.config), DRAFT, LAYER_IDS, target.get_input_embeddings().weight.detach())
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    d.set_vocab(draft_vocab())
    return d.eval()


def target_started_eagle3(target) -> Eagle3Drafter:
    d = Eagle3Drafter(layer_config(target.config), DRAFT, LAYER_IDS, target.get_input_embeddings().weight.detach())
    init_from_target(d, target, draft_vocab())
    return d.eval()


def packed_batch():
    """Two right-padded rows (9 and 6 tokens) and every teacher position of each, as `trainers.data.collate` lays
    them out: (row, col) for col in 0..len - 2, predicting the token at col + 1."""
    g = torch.Generator().manual_seed(7)
    lengths = (9, 6)
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(0, VOCAB, (n,), generator=g)
        mask[b, :n] = 1
    rows = torch.cat([torch.full((n - 1,), b) for b, n in enumerate(lengths)])
    cols = torch.cat([torch.arange(n - 1) for n in lengths])
    return ids, mask, rows, cols, lengths


def test_logits_at_a_teacher_position_are_the_first_draft_after_the_target_verified_up_to_it(tiny_target):
    """(row, col) predicts the token at col + 1 (as `PositionLM`): the drafter's first pass as vLLM runs it after
    the target verified tokens 0..col: the target's features of positions 0..col - 1 beside tokens 1..col, its last
    output; at col 0 (no feature before it) the drafter alone on token 0 over zero features."""
    d = random_eagle3(tiny_target)
    lm = Eagle3PositionLM(d, tiny_target)
    ids, mask, rows, cols, lengths = packed_batch()
    with torch.no_grad():
        got = lm(ids, mask, rows, cols)
        assert got.shape == (rows.numel(), DRAFT)
        for p, (r, c) in enumerate(zip(rows.tolist(), cols.tolist())):
            seq = ids[r, : lengths[r]][None]
            if c == 0:
                ref, _ = d(torch.zeros(1, 1, 32), seq[:, :1])
            else:
                ref, _ = d(d.fuse(target_features(tiny_target, seq[:, :c], LAYER_IDS)), seq[:, 1 : c + 1])
            assert torch.allclose(got[p], ref[0, -1], atol=1e-4), (r, c)


def test_a_drafter_started_as_the_targets_last_layer_lags_the_teacher_by_one_token(tiny_target):
    """Pinned against a plain reference: a drafter whose fc passes the last layer's input through and whose layer is
    the target's last (`init_from_target`) computes, at (row, col), the target's own logits at col - 1 (over the
    draft vocabulary): it reads the feature of col - 1, so it predicts the token at col, one behind the teacher's
    token col + 1 that training teaches it."""
    d = target_started_eagle3(tiny_target)
    lm = Eagle3PositionLM(d, tiny_target)
    ids, mask, rows, cols, _ = packed_batch()
    on = cols >= 1
    with torch.no_grad():
        got = lm(ids, mask, rows[on], cols[on])
        target_at = PositionLM(tiny_target)(ids, mask, rows[on], cols[on] - 1)
    assert torch.allclose(got, target_at[:, target_ids(d.d2t)], atol=1e-4)
    with torch.no_grad():  # and not the teacher's own position: col, predicting col + 1
        teacher_at = PositionLM(tiny_target)(ids, mask, rows[on], cols[on])
    assert not torch.allclose(got, teacher_at[:, target_ids(d.d2t)], atol=1e-2)


def test_unrolled_steps_are_ttt_logits_at_the_positions_they_reach(tiny_target):
    """Step k at (row, col) is `ttt_logits` step k at index col - 1 - k: the k-th own draft after the target verified
    up to col - k, predicting the same token col + 1; positions with col - 1 - k < 0 are not reached."""
    d = random_eagle3(tiny_target, seed=1)
    lm = Eagle3PositionLM(d, tiny_target)
    ids, mask, rows, cols, _ = packed_batch()
    with torch.no_grad():
        steps = lm(ids, mask, rows, cols, steps=3)
        ref = ttt_logits(d, target_features(tiny_target, ids, LAYER_IDS), ids, steps=3)
        assert torch.equal(steps[0][0], lm(ids, mask, rows, cols))
    assert len(steps) == 3 and bool(steps[0][1].all())
    for k, (logits, keep) in enumerate(steps):
        if k:
            assert torch.equal(keep, cols - 1 - k >= 0)
        on = keep & (cols >= 1)
        expect = ref[k][rows[on], cols[on] - 1 - k]
        assert torch.allclose(logits[on[keep]], expect, atol=1e-4), k


def test_a_few_teacher_positions_after_a_long_prompt_are_computed_alone_and_equal_the_full_unroll(tiny_target):
    """The teacher positions of records with long prompts: only the last few columns of each row. The drafter's layer
    runs there alone (`ttt_prenorms_at`), attending to every earlier position's keys; its logits and gradients are the
    full unroll's (`ttt_logits`) at those positions, and features given with the batch (serving's) stand in for the
    target's."""
    d = random_eagle3(tiny_target, seed=6)
    ids, mask, _, _, lengths = packed_batch()
    rows = torch.tensor([0, 0, 0, 1, 1])
    cols = torch.tensor([5, 6, 7, 3, 4])  # the last generated tokens of each row
    features = target_features(tiny_target, ids, LAYER_IDS)
    lm = Eagle3PositionLM(d, None)  # no target: the batch's features only
    steps = lm(ids, mask, rows, cols, steps=3, features=features)
    ref = ttt_logits(d, features, ids, steps=3)
    for k, (logits, keep) in enumerate(steps):
        assert torch.equal(keep, cols - 1 - k >= 0)
        assert torch.allclose(logits, ref[k][rows[keep], (cols - 1 - k)[keep]], atol=1e-5), k
    sum(x.sum() for x, _ in steps).backward()
    got = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    d.zero_grad()
    sum(ref[k][rows[keep], (cols - 1 - k)[keep]].sum() for k, (_, keep) in enumerate(steps)).backward()
    for n, p in d.named_parameters():
        if p.grad is not None:
            assert torch.allclose(got[n], p.grad, atol=1e-4, rtol=1e-4), n
    with pytest.raises(DviError, match="without the target's features"):
        lm(ids, mask, rows, cols)


def test_the_target_is_no_part_of_the_module(tiny_target):
    d = random_eagle3(tiny_target)
    lm = Eagle3PositionLM(d, tiny_target)
    assert lm.target is tiny_target
    assert all(k.startswith("model.") for k in lm.state_dict())
    assert sum(p.numel() for p in lm.parameters()) == sum(p.numel() for p in d.parameters())
    assert not any(m is tiny_target for m in lm.modules())


def test_the_ttt_loss_is_the_position_loss_averaged_over_steps(tiny_target):
    d = random_eagle3(tiny_target, seed=2)
    d.train()
    lm = Eagle3PositionLM(d, tiny_target)
    ids, mask, rows, cols, _ = packed_batch()
    vocab_map = target_ids(d.d2t)
    with torch.no_grad():
        teacher = teacher_from_logits(PositionLM(tiny_target)(ids, mask, rows, cols), vocab_map)
    p = rows.numel()
    batch = Batch([], ids, mask, rows, cols, ids[rows, cols + 1], None, None, torch.full((p,), -1), torch.zeros(p),
                  torch.zeros(p, dtype=torch.bool), torch.ones(p))
    loss, metrics = ttt_position_loss(lm, batch, teacher, 3, "fkl", 1.0, 0.0, 0.5, vocab_map)
    with torch.no_grad():
        parts = []
        for logits, keep in lm(ids, mask, rows, cols, steps=3):
            parts.append(position_loss(logits, teacher.select(keep), batch.drafted[keep],
                                       batch.reward[keep], batch.judged[keep], batch.weight[keep], vocab_map=vocab_map)[0])
    assert torch.allclose(loss.detach(), torch.stack(parts).mean(), atol=1e-6)
    assert {"acceptance", "fkl", "acceptance_step1", "acceptance_step2"} <= set(metrics)
    loss.backward()
    assert d.embed_tokens.weight.grad is None and d.fc.weight.grad is not None
    assert all(p.grad is None for p in tiny_target.parameters())


def test_a_one_token_batch_answers_with_the_drafter_alone(tiny_target):
    """What a rank without records feeds the engine to join a step (`Trainer.step`): one token, column 0."""
    lm = Eagle3PositionLM(random_eagle3(tiny_target), tiny_target)
    one = torch.zeros(1, 1, dtype=torch.long)
    out = lm(one, torch.ones_like(one), one[0], one[0])
    assert out.shape == (1, DRAFT) and out.requires_grad
    steps = lm(one, torch.ones_like(one), one[0], one[0], steps=3)
    assert [tuple(x.shape) for x, _ in steps] == [(1, DRAFT), (0, DRAFT), (0, DRAFT)]


# ----------------------------------------------------------------------------------------------
# Loading and publishing.


@pytest.fixture
def saved(tiny_target, tmp_path) -> tuple[Path, Path, Eagle3Drafter]:
    """(target dir, EAGLE-3 drafter dir, the drafter): the tiny target saved, and a random drafter of it."""
    target_dir = tmp_path / "target"
    tiny_target.save_pretrained(target_dir)
    d = random_eagle3(tiny_target, seed=3)
    drafter_dir = save_eagle3(d, tmp_path / "e3", target_dir, {"version": "e3-init", "parent": None})
    return target_dir, drafter_dir, d


def test_an_eagle3_directory_loads_as_a_drafter_given_the_target(saved, tiny_target):
    target_dir, drafter_dir, d = saved
    assert drafter_kind(drafter_dir) == "eagle3" and drafter_kind(target_dir) == "layers"
    loaded = load_any_drafter(drafter_dir, VOCAB, target=tiny_target)
    assert isinstance(loaded.model, Eagle3Drafter) and loaded.version == "e3-init"
    assert torch.equal(loaded.vocab_map, draft_vocab()) and loaded.vocab_size == DRAFT
    assert torch.equal(loaded.model.embed_tokens.weight, tiny_target.get_input_embeddings().weight)
    assert all(torch.equal(v, d.weights()[k]) for k, v in loaded.model.weights().items())
    with pytest.raises(DviError):  # without the target: as before, not a causal LM
        load_drafter(drafter_dir, VOCAB)
    other = tiny_target.__class__(tiny_target.config.__class__(**{**tiny_target.config.to_dict(), "hidden_size": 64}))
    with pytest.raises(DviError, match="does not fit the target"):
        load_any_drafter(drafter_dir, VOCAB, target=other)


def test_a_published_eagle3_version_is_the_speculators_format_the_servers_accept(saved, tiny_target, tmp_path):
    target_dir, drafter_dir, d = saved
    root = tmp_path / "store"
    with torch.no_grad():
        d.fc.weight.add_(0.1)  # trained since
    weights = Eagle3PositionLM(d, tiny_target).model.state_dict()  # what the trainer publishes: the embedding too
    published = store.publish(root, "d0001", weights, drafter_dir, {"parent": "e3-init"}, target_ids(d.d2t))
    files = sorted(f.name for f in published.path.iterdir())
    assert files == ["SHA256SUMS", "config.json", "dvi_drafter.json", "model.safetensors"]
    assert json.loads((published.path / "config.json").read_text()) == json.loads((drafter_dir / "config.json").read_text())
    assert json.loads((published.path / "dvi_drafter.json").read_text())["kind"] == "eagle3"
    tensors = load_file(str(published.path / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == weight_shapes(d.config, DRAFT, len(LAYER_IDS))
    served = load_announced(DrafterPublished("d0001", str(published.path), published.sha256), root, tiny_target, kind="eagle3")
    assert all(torch.equal(v, d.weights()[k]) for k, v in served.weights().items())
    again = load_any_drafter(published.path, VOCAB, target=tiny_target)  # the gate's next baseline
    assert again.version == "d0001" and torch.equal(again.model.fc.weight, d.fc.weight)


def test_the_registrys_pyfunc_model_of_an_eagle3_version_drafts_as_vllms_loop(saved, tiny_target):
    """`dvi.registry_model` loads an EAGLE-3 directory with the target its config names; its continuation is the
    drafter's chain after the prompt: the first draft is `Eagle3PositionLM`'s at the prompt's last column, each next
    one `ttt_logits`' next step there, its tokens the drafts before it."""
    from dvi.registry_model import DrafterModel

    target_dir, drafter_dir, d = saved
    model = DrafterModel(drafter_dir)
    prompt = [5, 17, 60, 2, 33]
    got = model.predict([prompt, [9]], params={"max_new_tokens": 4})
    drafts = got[0]["token_ids"]
    vocab = target_ids(d.d2t)
    assert len(drafts) == 4 and set(drafts) <= set(vocab.tolist()) and len(got[1]["token_ids"]) == 4
    seq = torch.tensor([prompt + drafts])
    with torch.no_grad():
        first = Eagle3PositionLM(d, tiny_target)(seq, torch.ones_like(seq), torch.tensor([0]), torch.tensor([len(prompt) - 1]))
        chain = ttt_logits(d, target_features(tiny_target, seq, LAYER_IDS), seq, steps=4)
        alone = Eagle3PositionLM(d, tiny_target)(torch.tensor([[9]]), torch.ones(1, 1), torch.tensor([0]), torch.tensor([0]))
    assert drafts[0] == int(vocab[first.argmax()])
    assert drafts == [int(vocab[chain[k][0, len(prompt) - 2].argmax()]) for k in range(4)]
    assert got[1]["token_ids"][0] == int(vocab[alone.argmax()])


def test_lora_adapters_on_an_eagle3_drafter_merge_into_the_speculators_names(tiny_target):
    """trainer.finetune=lora: adapters on the drafter's layer; what is published has vLLM's names, adapters merged."""
    from dvi.config import TrainerConfig
    from trainers import ds

    d = random_eagle3(tiny_target, seed=4)
    plain = d.weights()
    model = ds.apply_lora(d, TrainerConfig(finetune="lora"))
    lm = Eagle3PositionLM(model, tiny_target)
    ids, mask, rows, cols, _ = packed_batch()
    steps = lm(ids, mask, rows, cols, steps=2)
    assert [tuple(x.shape) for x, _ in steps] == [(rows.numel(), DRAFT), (int((cols >= 2).sum()), DRAFT)]
    merged = ds.merged_state_dict(model)
    assert {k for k in merged if not k.startswith("embed_tokens.")} == set(weight_shapes(d.config, DRAFT, len(LAYER_IDS)))
    assert all(torch.equal(merged[k], v) for k, v in plain.items())  # fresh adapters add nothing
