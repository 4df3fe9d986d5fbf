"""trainers.losses: each divergence against a plain reference, teachers, masks, the reward term, the schedule.

References are float64 loops over the target vocabulary (numpy), written from the definitions in the
module docstring: a term with zero weight is 0, a log that would be -inf under a positive weight is
clamped at log(1e-8), forward KL renormalises the teacher over the student's vocabulary.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dvi.speculative import expand_draft_probs, expected_acceptance
from trainers.losses import (
    DIVERGENCES,
    argmax_draft_acceptance,
    PROB_FLOOR,
    Teacher,
    divergence,
    forward_kl,
    jsd,
    kl_reward_weights,
    partial_lr,
    masked_mean,
    position_loss,
    reverse_kl,
    student_index,
    student_log_probs,
    teacher_from_logits,
    teacher_acceptance,
    teacher_divergence,
    teacher_from_topk,
    total_variation,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# ----------------------------------------------------------------------------------------------
# Plain references over the target vocabulary; p, q: 1-D float64 arrays summing to 1.


def ref_fkl(p: np.ndarray, q: np.ndarray, student_has: np.ndarray | None = None) -> float:
    if student_has is not None:  # drop the teacher's mass the student cannot produce, renormalise
        p = np.where(student_has, p, 0.0)
        if p.sum() == 0:
            return 0.0
        p = p / p.sum()
    total = 0.0
    for px, qx in zip(p, q):
        if px > 0:
            total += px * (math.log(px) - math.log(max(qx, PROB_FLOOR)))
    return total


def ref_rkl(p: np.ndarray, q: np.ndarray) -> float:
    total = 0.0
    for px, qx in zip(p, q):
        if qx > 0:
            total += qx * (math.log(qx) - math.log(max(px, PROB_FLOOR)))
    return total


def ref_jsd(p: np.ndarray, q: np.ndarray, beta: float) -> float:
    kl_pm = kl_qm = 0.0
    for px, qx in zip(p, q):
        mx = beta * px + (1 - beta) * qx
        if px > 0:
            kl_pm += px * math.log(px / mx)
        if qx > 0:
            kl_qm += qx * math.log(qx / mx)
    return beta * kl_pm + (1 - beta) * kl_qm


def ref_tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * sum(abs(px - qx) for px, qx in zip(p, q))


def random_case(seed: int, rows: int = 6, vocab: int = 12, zeros: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher probs [rows, V] and student logits [rows, V], both with zeros (student: -inf logits)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(rows, vocab, generator=g) ** 3
    p = p.masked_fill(torch.rand(rows, vocab, generator=g) < zeros, 0.0)
    p[:, 0] += 0.1  # never an all-zero row
    p = p / p.sum(-1, keepdim=True)
    logits = 3 * torch.randn(rows, vocab, generator=g)
    logits = logits.masked_fill(torch.rand(rows, vocab, generator=g) < zeros, float("-inf"))
    logits[:, 1] = 0.0  # never an all -inf row
    return p, logits


def f64(x: torch.Tensor) -> np.ndarray:
    return x.detach().double().numpy()


REFS = {"fkl": ref_fkl, "rkl": ref_rkl, "jsd": lambda p, q: ref_jsd(p, q, 0.5), "tv": ref_tv}

# ----------------------------------------------------------------------------------------------
# Divergences against the references.


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_divergence_matches_reference_with_zeros(name, seed):
    p, logits = random_case(seed)
    assert (p == 0).any() and torch.isinf(logits).any()
    log_q = student_log_probs(logits)
    got = divergence(name, p, log_q)  # [rows]
    assert torch.isfinite(got).all()
    q = f64(log_q.exp())
    want = [REFS[name](f64(p[i]), q[i]) for i in range(p.shape[0])]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalised_jsd_matches_reference(beta):
    p, logits = random_case(3)
    log_q = student_log_probs(logits)
    got = jsd(p, log_q, beta=beta)
    q = f64(log_q.exp())
    want = [ref_jsd(f64(p[i]), q[i], beta) for i in range(p.shape[0])]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    assert (got >= -1e-6).all()
    if beta == 0.5:  # symmetric, and bounded by log 2
        assert (got <= math.log(2) + 1e-6).all()
        q_t = log_q.exp()
        np.testing.assert_allclose(got.numpy(), jsd(q_t, torch.log(p), beta=0.5).numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="beta"):
        jsd(p, log_q, beta=1.0)


def test_kl_matches_torch_on_positive_distributions():
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(5, 9, generator=g), -1)
    log_q = student_log_probs(torch.randn(5, 9, generator=g))
    torch_fkl = torch.nn.functional.kl_div(log_q, p, reduction="none").sum(-1)
    torch_rkl = torch.nn.functional.kl_div(torch.log(p), log_q, reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(forward_kl(p, log_q), torch_fkl)
    torch.testing.assert_close(reverse_kl(p, log_q), torch_rkl)


def test_zero_handling_is_large_but_finite():
    p = torch.tensor([[1.0, 0.0, 0.0]])
    log_q = torch.log(torch.tensor([[0.0, 0.5, 0.5]]))  # q is 0 exactly where p has all its mass
    fkl, rkl = forward_kl(p, log_q), reverse_kl(p, log_q)
    assert torch.isfinite(fkl).all() and torch.isfinite(rkl).all()
    assert fkl.item() == pytest.approx(-math.log(PROB_FLOOR), rel=1e-5)
    assert rkl.item() == pytest.approx(math.log(0.5) - math.log(PROB_FLOOR), rel=1e-5)
    assert jsd(p, log_q).item() == pytest.approx(math.log(2), rel=1e-5)  # disjoint supports
    assert total_variation(p, log_q).item() == pytest.approx(1.0)


def test_tv_is_one_minus_expected_acceptance():
    p, logits = random_case(5)
    log_q = student_log_probs(logits)
    tv = total_variation(p, log_q)
    torch.testing.assert_close(tv, 1 - expected_acceptance(p, log_q.exp()), rtol=0, atol=1e-6)
    # the top-k teacher against a student: the same identity
    ids = torch.tensor([[2, 7, 0], [11, 3, 5]])
    teacher = teacher_from_topk(ids, torch.randn(2, 3), vocab_size=12, dense=True)
    tv = total_variation(teacher.probs, log_q[:2], teacher.outside)
    torch.testing.assert_close(tv, 1 - expected_acceptance(teacher.probs, log_q[:2].exp()), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Teachers and reduced vocabularies.


def test_student_index():
    vocab_map = torch.tensor([5, 0, 2])
    idx, inside = student_index(torch.tensor([[0, 3, 2, -1, 5]]), vocab_map)
    assert inside.tolist() == [[True, False, True, False, True]]
    assert idx[inside].tolist() == [1, 2, 0]
    idx, inside = student_index(torch.tensor([4, -1, 6]), None, vocab_size=6)
    assert inside.tolist() == [True, False, False] and idx.tolist() == [4, 0, 0]


def test_topk_renormalisation_by_hand():
    ids = torch.tensor([[3, 0, 5]])  # [1, topk]
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.1]])).half()  # 0.2 of the mass lies beyond the top-k
    t = teacher_from_topk(ids, lp, vocab_size=6, dense=True)
    want = torch.tensor([[2 / 8, 0, 0, 5 / 8, 0, 1 / 8]])
    torch.testing.assert_close(t.probs, want, rtol=1e-3, atol=1e-4)  # f16 log-probs
    assert t.outside.tolist() == [0.0]
    # reduced student vocabulary: target ids 5, 0, 2 (id 3 is not there)
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.1]]))
    t = teacher_from_topk(ids, lp, vocab_size=6, vocab_map=torch.tensor([5, 0, 2]), dense=True)
    torch.testing.assert_close(t.probs, torch.tensor([[1 / 8, 2 / 8, 0.0]]))
    torch.testing.assert_close(t.outside, torch.tensor([5 / 8]))


def test_teacher_from_logits():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 10, generator=g)  # [B, K + 1, V]
    t = teacher_from_logits(logits)
    torch.testing.assert_close(t.probs, torch.softmax(logits, -1))
    assert (t.outside == 0).all()
    greedy = teacher_from_logits(logits, temperature=0.0)
    assert (greedy.probs.argmax(-1) == logits.argmax(-1)).all() and (greedy.probs.sum(-1) == 1).all()
    vocab_map = torch.tensor([9, 1, 4, 0])
    t = teacher_from_logits(logits, vocab_map)
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(t.probs, full[..., vocab_map])
    torch.testing.assert_close(t.outside, 1 - full[..., vocab_map].sum(-1))


@pytest.mark.parametrize("name", DIVERGENCES)
def test_reduced_vocab_student_against_full_vocab_reference(name):
    """A reduced-head student scored over the target vocabulary: q is 0 outside vocab_map."""
    g = torch.Generator().manual_seed(7)
    vocab, vocab_map = 12, torch.tensor([7, 2, 9, 0, 4])  # N = 5
    t_logits = 2 * torch.randn(4, vocab, generator=g)
    t_logits[3, vocab_map] = -30.0  # one position whose teacher mass is all but entirely outside
    teacher = teacher_from_logits(t_logits, vocab_map)
    p_full = torch.softmax(t_logits, -1)
    log_q = student_log_probs(torch.randn(4, 5, generator=g))  # [4, N]
    q_full = expand_draft_probs(log_q.exp(), vocab_map, vocab)  # [4, V]
    got = divergence(name, teacher.probs, log_q, teacher.outside)
    has = np.zeros(vocab, dtype=bool)
    has[vocab_map.numpy()] = True
    refs = {"fkl": lambda p, q: ref_fkl(p, q, has), **{k: v for k, v in REFS.items() if k != "fkl"}}
    want = [refs[name](f64(p_full[i]), f64(q_full[i])) for i in range(4)]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    if name == "tv":  # the unreachable mass counts against acceptance, as in the engine
        torch.testing.assert_close(got, 1 - expected_acceptance(p_full, q_full), rtol=0, atol=1e-6)
        assert (got >= 0.5 * teacher.outside - 1e-6).all()


def test_reduced_vocab_topk_teacher_all_outside_gives_zero_fkl():
    t = teacher_from_topk(torch.tensor([[1, 3]]), torch.tensor([[-0.1, -2.0]]), 6, vocab_map=torch.tensor([0, 2]), dense=True)
    assert t.probs.sum().item() == 0 and t.outside.item() == pytest.approx(1.0)
    log_q = student_log_probs(torch.zeros(1, 2))
    assert forward_kl(t.probs, log_q, t.outside).item() == 0.0
    assert total_variation(t.probs, log_q, t.outside).item() == pytest.approx(1.0)
    assert jsd(t.probs, log_q, t.outside).item() == pytest.approx(math.log(2), rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Masks.


def test_masked_mean():
    v = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[True, True, False], [True, False, True]])
    assert masked_mean(v, m).item() == pytest.approx(13 / 4)
    assert masked_mean(v, torch.zeros_like(m)).item() == 0.0
    assert masked_mean(torch.tensor([1.0, 3.0])).item() == 2.0


def ref_reward_loss(log_q: torch.Tensor, drafted: torch.Tensor, reward: torch.Tensor, judged: torch.Tensor) -> float:
    """The reward term by its definition: the mean over judged positions of -(reward * max(log q(draft), log 1e-8))."""
    log_q = log_q.detach()
    terms = [-float(reward[i]) * max(float(log_q[i, drafted[i]]), math.log(PROB_FLOOR))
             for i in range(len(drafted)) if judged[i]]
    return sum(terms) / len(terms) if terms else 0.0


def flat_positions(seed: int = 8, vocab: int = 10, topk: int = 4):
    """Seven teacher positions laid out flat, as `trainers.data` does: a round with k = 3, n = 1 (its draft accepted
    +1, its first rejected draft -1), a round of a replayed record (weight 0.5) with k = 1, n = 1 (+1, then the
    bonus position, not judged), a plain round (k = 0, not judged); then two positions of weight 0, never judged,
    which `position_loss` must ignore."""
    g = torch.Generator().manual_seed(seed)
    lp, ids = torch.log_softmax(torch.randn(7, vocab, generator=g), -1).topk(topk, -1)  # [P, topk]
    teacher = teacher_from_topk(ids, lp, vocab, dense=True)
    drafted = torch.tensor([4, 1, 7, -1, -1, -1, -1])  # [P]
    reward = torch.tensor([1.0, -1.0, 1.0, 0, 0, 0, 0])
    judged = torch.tensor([True, True, True, False, False, False, False])
    weight = torch.tensor([1.0, 1.0, 0.5, 0.5, 1.0, 0.0, 0.0])
    logits = torch.randn(7, vocab, generator=g)
    return logits, teacher, drafted, reward, judged, weight


@pytest.mark.parametrize("name", DIVERGENCES)
def test_position_loss_ignores_positions_of_weight_zero(name):
    logits, teacher, drafted, reward, judged, weight = flat_positions()
    logits = logits.requires_grad_()
    loss, metrics = position_loss(logits, teacher, drafted, reward, judged, weight, name, w_kl=1.0, w_reward=0.5)
    loss.backward()
    off = weight == 0  # [P]
    assert (logits.grad[off] == 0).all() and (logits.grad[~off] != 0).any()
    # garbage there changes nothing
    junk = logits.detach().clone()
    junk[off] = 1e3 * torch.randn(int(off.sum()), junk.shape[-1])
    probs = teacher.probs.clone()
    probs[off] = 1.0
    loss2, metrics2 = position_loss(junk, Teacher(probs, teacher.outside), drafted, reward, judged, weight, name,
                                    w_kl=1.0, w_reward=0.5)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
    assert metrics2 == pytest.approx(metrics, rel=1e-6)


def test_position_loss_metrics_and_weights():
    logits, teacher, drafted, reward, judged, weight = flat_positions()
    log_q = student_log_probs(logits)
    w = f64(weight)
    want = {d: float((w * f64(divergence(d, teacher.probs, log_q, teacher.outside))).sum() / w.sum()) for d in DIVERGENCES}
    rl = ref_reward_loss(log_q, drafted, reward, judged)
    loss, metrics = position_loss(logits.clone().requires_grad_(), teacher, drafted, reward, judged, weight, "jsd",
                                  w_kl=0.7, w_reward=0.3)
    assert set(metrics) == {*DIVERGENCES, "acceptance", "reward_loss", "outside"}
    assert all(isinstance(v, float) for v in metrics.values())
    for d in DIVERGENCES:
        assert metrics[d] == pytest.approx(want[d], rel=1e-5)
    assert metrics["acceptance"] == pytest.approx(1 - metrics["tv"], abs=1e-6)
    assert metrics["reward_loss"] == pytest.approx(rl, rel=1e-5)
    assert metrics["outside"] == 0.0
    assert loss.requires_grad and loss.item() == pytest.approx(0.7 * want["jsd"] + 0.3 * rl, rel=1e-5)
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        position_loss(logits, teacher, drafted, reward, judged, weight, "kl")


def test_position_loss_reduced_vocab_and_no_drafts():
    vocab, vocab_map = 10, torch.tensor([3, 1, 8, 0, 6, 5])
    g = torch.Generator().manual_seed(9)
    lp, ids = torch.log_softmax(torch.randn(4, vocab, generator=g), -1).topk(5, -1)
    teacher = teacher_from_topk(ids, lp, vocab, vocab_map)
    drafted = torch.tensor([3, 8, 6, 2])  # target id 2 is not in the student's vocabulary
    reward, judged = torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.ones(4, dtype=torch.bool)
    logits = torch.randn(4, 6, generator=g, requires_grad=True)
    loss, metrics = position_loss(logits, teacher, drafted, reward, judged, None, "tv", w_reward=0.5, vocab_map=vocab_map)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and metrics["outside"] > 0
    rows = torch.tensor([0, 2, 4])  # the student's rows of target ids 3, 8, 6; the draft outside (2) is excluded
    assert metrics["reward_loss"] == pytest.approx(ref_reward_loss(student_log_probs(logits), rows, reward[:3], judged[:3]),
                                                   rel=1e-5)
    # positions that drafted nothing (plain rounds) still train on the teacher
    none = torch.full((4,), -1)
    loss, metrics = position_loss(logits, teacher, none, torch.zeros(4), torch.zeros(4, dtype=torch.bool), None, "fkl",
                                  w_reward=0.5, vocab_map=vocab_map)
    assert torch.isfinite(loss) and loss.item() > 0 and metrics["reward_loss"] == 0.0


# ----------------------------------------------------------------------------------------------
# The sparse (top-k) teacher against its dense form.


def sparse_case(seed: int, vocab: int = 12, topk: int = 4, vocab_map=None, positions: int = 6):
    g = torch.Generator().manual_seed(seed)
    lp, ids = torch.log_softmax(3 * torch.randn(positions, vocab, generator=g), -1).topk(topk, -1)  # [P, topk]
    width = vocab if vocab_map is None else vocab_map.numel()
    logits = 2 * torch.randn(positions, width, generator=g)
    logits[0, :] = 0.0
    logits[1, 0] = 40.0  # a student all but certain of one token
    return teacher_from_topk(ids, lp, vocab, vocab_map), teacher_from_topk(ids, lp, vocab, vocab_map, dense=True), logits


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("name", DIVERGENCES)
def test_sparse_teacher_divergences_equal_the_dense_ones(name, reduced):
    vocab_map = torch.tensor([7, 2, 9, 0, 4, 11, 5]) if reduced else None
    for seed in range(4):
        sparse, dense, logits = sparse_case(seed, vocab_map=vocab_map)
        assert sparse.sparse and not dense.sparse and sparse.probs.shape[-1] == 4
        torch.testing.assert_close(sparse.dense(dense.probs.shape[-1]).probs, dense.probs)
        for req in (False, True):  # values, and gradients through log q
            a = logits.clone().requires_grad_(req)
            b = logits.clone().requires_grad_(req)
            got = teacher_divergence(name, sparse, student_log_probs(a))
            want = divergence(name, dense.probs, student_log_probs(b), dense.outside)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if req:
                got.sum().backward()
                want.sum().backward()
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
        log_q = student_log_probs(logits)
        torch.testing.assert_close(teacher_acceptance(sparse, log_q), expected_acceptance(dense.probs, log_q.exp()),
                                   rtol=1e-5, atol=1e-6)
        assert torch.equal(sparse.argmax(), dense.probs.argmax(-1)) or reduced  # ties aside, the same row


def test_sparse_teacher_all_outside_and_select():
    t = teacher_from_topk(torch.tensor([[1, 3], [0, 1]]), torch.tensor([[-0.1, -2.0], [-0.5, -1.0]]), 6,
                          vocab_map=torch.tensor([0, 2]))
    log_q = student_log_probs(torch.zeros(2, 2))
    assert teacher_divergence("fkl", t, log_q)[0].item() == 0.0
    assert teacher_divergence("tv", t, log_q)[0].item() == pytest.approx(1.0)
    one = t.select(torch.tensor([False, True]))
    assert one.probs.shape == (1, 2) and one.index.tolist() == [[0, 0]] and one.inside.tolist() == [[True, False]]
    assert one.argmax().tolist() == [0]


def test_position_loss_takes_either_teacher_form():
    logits, dense, drafted, reward, judged, weight = flat_positions()
    g = torch.Generator().manual_seed(8)
    lp, ids = torch.log_softmax(torch.randn(7, 10, generator=g), -1).topk(4, -1)
    sparse = teacher_from_topk(ids, lp, 10)
    for name in DIVERGENCES:
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        la, ma = position_loss(a, sparse, drafted, reward, judged, weight, name, w_kl=0.8, w_reward=0.2)
        lb, mb = position_loss(b, dense, drafted, reward, judged, weight, name, w_kl=0.8, w_reward=0.2)
        la.backward()
        lb.backward()
        assert la.item() == pytest.approx(lb.item(), rel=1e-5) and ma == pytest.approx(mb, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_argmax_draft_acceptance_against_a_plain_reference():
    """Per position: greedy, 1 when the draft is the target's argmax; sampled, the draft's probability under the
    request's temperature and top-p, over the logged top-k (a plain loop over sorted tokens)."""
    g = torch.Generator().manual_seed(13)
    lp, ids = torch.log_softmax(2 * torch.randn(40, 30, generator=g), -1).topk(6, -1)
    perm = torch.randperm(6, generator=g)  # the top-k need not come sorted
    lp, ids = lp[:, perm], ids[:, perm]
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.5] * 10)
    top_p = torch.tensor([1.0] * 20 + [0.6] * 20)
    draft = torch.where(torch.rand(40, generator=g) < 0.5, ids[:, 0], torch.randint(0, 30, (40,), generator=g))
    got = argmax_draft_acceptance(ids, lp, temperature, top_p, draft)
    for i in range(40):
        row = sorted(zip(lp[i].tolist(), ids[i].tolist()), reverse=True)
        if temperature[i] == 0:
            want = float(row[0][1] == draft[i])
        else:
            w = np.exp(np.array([x for x, _ in row], dtype=np.float64) / float(temperature[i]))
            w /= w.sum()
            keep, mass = [], 0.0
            for pj, (_, t) in zip(w, row):
                if mass < float(top_p[i]):
                    keep.append((pj, t))
                mass += pj
            total = sum(pj for pj, _ in keep)
            want = sum(pj for pj, t in keep if t == int(draft[i])) / total
        assert got[i].item() == pytest.approx(want, abs=1e-5), i


# ----------------------------------------------------------------------------------------------
# The reward term.


def test_reward_term_value_and_signs():
    # three rounds laid out flat: k = 3, n = 1 | k = 3, n = 3 | k = 2, n = 0; penalty 2
    drafted = torch.tensor([4, 1, 0, 0, 5, 3])
    reward = torch.tensor([1.0, -2.0, 1.0, 1.0, 1.0, -2.0])
    judged = torch.ones(6, dtype=torch.bool)
    unjudged = torch.tensor([-1, -1])  # the second round's bonus position and a plain round's position
    drafted, reward = torch.cat([drafted, unjudged]), torch.cat([reward, torch.zeros(2)])
    judged = torch.cat([judged, torch.zeros(2, dtype=torch.bool)])
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(8, 6, generator=g, requires_grad=True)
    log_q = student_log_probs(logits)
    teacher = teacher_from_logits(torch.zeros(8, 6))  # any teacher: w_kl = 0
    loss, _ = position_loss(logits, teacher, drafted, reward, judged, None, "fkl", w_kl=0.0, w_reward=1.0)
    want = sum(-float(reward[i]) * log_q[i, drafted[i]].item() for i in range(6)) / 6
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    assert (logits.grad[6:] == 0).all()  # not judged: no gradient
    # one SGD step raises accepted drafts' probabilities and lowers the rejected ones'
    with torch.no_grad():
        after = student_log_probs(logits - 1.0 * logits.grad)
    for i in range(6):
        d = drafted[i]
        assert (after[i, d] > log_q[i, d]) == (reward[i] > 0)


def test_reward_term_is_bounded_below_for_rejected_drafts():
    logits = torch.tensor([[0.0, -1e4, 0.0]], requires_grad=True)  # q(d) = 0 for the rejected draft d = 1
    teacher = teacher_from_logits(torch.zeros(1, 3))
    loss, _ = position_loss(logits, teacher, torch.tensor([1]), torch.tensor([-1.0]), torch.tensor([True]), None, "fkl",
                            w_kl=0.0, w_reward=1.0)
    assert loss.item() == pytest.approx(math.log(PROB_FLOOR), rel=1e-5)
    loss.backward()
    assert (logits.grad == 0).all()


# ----------------------------------------------------------------------------------------------
# Gradients and training.


@pytest.mark.parametrize("name", DIVERGENCES)
def test_gradients_finite_with_zeros_and_extreme_logits(name):
    p, logits = random_case(11)
    logits[0, 2:4] = torch.tensor([80.0, -80.0])
    logits = logits.requires_grad_()
    divergence(name, p, student_log_probs(logits)).sum().backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("name", DIVERGENCES)
def test_training_toward_a_fixed_teacher_decreases_the_divergence(name, reduced):
    g = torch.Generator().manual_seed(12)
    vocab = 16
    vocab_map = torch.tensor([0, 2, 3, 5, 7, 8, 11, 12, 13, 15]) if reduced else None
    lp, ids = torch.log_softmax(3 * torch.randn(4, vocab, generator=g), -1).topk(5, -1)  # teacher zeros past top-5
    teacher = teacher_from_topk(ids, lp, vocab, vocab_map, dense=True)
    assert (teacher.outside > 0.1).any() == reduced
    width = vocab if vocab_map is None else vocab_map.numel()
    logits = torch.nn.Parameter(torch.randn(4, width, generator=g))
    opt = torch.optim.SGD([logits], lr=1.0)

    def value(log_q: torch.Tensor) -> torch.Tensor:
        return divergence(name, teacher.probs, log_q, teacher.outside).sum()

    # the student's best: the teacher renormalised over the student's vocabulary (> 0 when mass is outside)
    best = value(torch.log(teacher.probs / teacher.probs.sum(-1, keepdim=True))).item()
    first = value(student_log_probs(logits)).item()
    for _ in range(50):
        opt.zero_grad()
        loss = value(student_log_probs(logits))
        loss.backward()
        assert torch.isfinite(logits.grad).all()
        opt.step()
    last = value(student_log_probs(logits)).item()
    assert last < first and last - best < 0.5 * (first - best), (first, last, best)


# ----------------------------------------------------------------------------------------------
# The KL-to-reward schedule.


def test_a_partial_batch_steps_at_its_share_of_the_learning_rate():
    assert partial_lr(1e-4, 512, 512) == 1e-4 and partial_lr(1e-4, 600, 512) == 1e-4  # full (or over, by a record)
    assert partial_lr(1e-4, 64, 512) == pytest.approx(1.25e-5)


def test_kl_reward_schedule_endpoints():
    assert kl_reward_weights(0, warmup=100, total=300, max_reward=0.4) == (1.0, 0.0)
    assert kl_reward_weights(99, warmup=100, total=300, max_reward=0.4) == (1.0, 0.0)
    assert kl_reward_weights(100, warmup=100, total=300, max_reward=0.4) == (1.0, 0.0)
    assert kl_reward_weights(200, warmup=100, total=300, max_reward=0.4) == pytest.approx((0.8, 0.2))
    assert kl_reward_weights(300, warmup=100, total=300, max_reward=0.4) == pytest.approx((0.6, 0.4))
    assert kl_reward_weights(10_000, warmup=100, total=300, max_reward=0.4) == pytest.approx((0.6, 0.4))
    assert kl_reward_weights(50, warmup=50, total=50, max_reward=1.0) == (0.0, 1.0)  # no ramp: a jump
    assert kl_reward_weights(7, warmup=0, total=10, max_reward=0.0) == (1.0, 0.0)  # reward off
    with pytest.raises(ValueError, match="max_reward"):
        kl_reward_weights(0, 0, 10, max_reward=1.5)
