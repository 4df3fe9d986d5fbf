"""dvi.speculative (and the SpecStats counters of dvi.engine): the maths against plain references.

The vectorised rejection sampler is checked against a per-token Python loop with the same uniforms, and
statistically: whatever the drafter proposes, the emitted tokens must follow the target's distribution.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch
from stat_checks import chi_square_pvalue

from dvi.engine_api import SpecStats
from dvi.speculative import (
    acceptance_estimate,
    ban_tokens,
    batch_bucket,
    cheapest_k,
    choose_k,
    choose_k_from_costs,
    expand_draft_probs,
    expected_acceptance,
    expected_tokens_per_round,
    position_acceptance,
    ideal_speedup,
    linear_verify_costs,
    logits_to_probs,
    moving_average,
    moving_variance,
    rejection_sample,
    sample_from,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# ----------------------------------------------------------------------------------------------
# Plain references.


def ref_inverse_cdf(weights: list[float], u: float) -> int:
    """First index whose running mass exceeds u * total (weights need not be normalised)."""
    total = sum(weights)
    running = 0.0
    for i, w in enumerate(weights):
        running += w
        if running > u * total:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)


def ref_rejection_round(draft, q, p, k, u_accept, u_sample) -> tuple[int, int]:
    """One row, token by token (Leviathan et al. 2023, algorithm 1).

    draft: [Kmax] ids; q: [Kmax][V]; p: [Kmax + 1][V]; k drafts count; u_accept: [Kmax]; u_sample: float.
    """
    for j in range(k):
        d = draft[j]
        if u_accept[j] < p[j][d] / q[j][d]:
            continue  # accepted
        residual = [max(0.0, a - b) for a, b in zip(p[j], q[j])]
        return j, ref_inverse_cdf(residual, u_sample)  # recovered token
    return k, ref_inverse_cdf(p[k], u_sample)  # bonus token


def ref_greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification, the readable special case: accept while the draft equals the target's argmax.

    draft_ids: [B, Kmax]; target_logits: [B, Kmax + 1, V]; k: [B]. Returns n_accepted [B], next_token [B].
    """
    choice = target_logits.argmax(-1)  # [B, Kmax + 1]
    kmax = draft_ids.shape[1]
    ok = (draft_ids == choice[:, :kmax]) & (torch.arange(kmax, device=draft_ids.device) < k.unsqueeze(-1))
    n = ok.long().cumprod(-1).sum(-1)
    return n, choice.gather(-1, n.unsqueeze(-1)).squeeze(-1)


def random_probs(gen: torch.Generator, shape: tuple[int, ...], zero_frac: float = 0.3) -> torch.Tensor:
    """Random distributions over the last dim, some entries exactly zero (never all of them)."""
    logits = torch.randn(shape, generator=gen) * 2.0
    zero = torch.rand(shape, generator=gen) < zero_frac
    zero[..., 0] &= ~zero.all(-1)  # keep at least one token
    probs = torch.softmax(logits, -1).masked_fill(zero, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Independent draws from probs [..., V] (torch.multinomial, not the code under test)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).view(probs.shape[:-1])


def emitted_at(j: int, draft_ids: torch.Tensor, n: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token each row emitted at position j of its round (d_1..d_n then the next token), and which rows did."""
    has = n >= j
    if j < draft_ids.shape[1]:
        tok = torch.where(n > j, draft_ids[:, j], token)
    else:
        tok = token
    return tok[has], has


def tv_bound(m: int, vocab: int, delta: float = 1e-4) -> float:
    """An upper bound on the TV distance between p and the empirical distribution of m draws from p.

    E[TV] <= 0.5 * sum_i sqrt(p_i (1 - p_i) / m) <= 0.5 * sqrt((V - 1) / m) (Cauchy-Schwarz), and TV moves by
    at most 1/m per draw, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 m t^2): the bound below fails with
    probability below delta.
    """
    return 0.5 * math.sqrt((vocab - 1) / m) + math.sqrt(math.log(1 / delta) / (2 * m))


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    vocab = probs.numel()
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts.numel() == vocab, f"{what}: a token outside the vocabulary was emitted"
    tv = 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()
    bound = tv_bound(int(counts.sum()), vocab)
    assert tv < bound, f"{what}: TV {tv:.4f} from the target distribution over {int(counts.sum())} draws, bound {bound:.4f}"
    pval = chi_square_pvalue(counts, probs)
    assert pval > 1e-4, f"{what}: chi-square p-value {pval:.2e} (TV {tv:.4f})"


# ----------------------------------------------------------------------------------------------
# rejection_sample against the references.


@pytest.mark.parametrize("kmax,vocab", [(0, 5), (1, 2), (3, 7), (5, 11), (4, 3)])
def test_rejection_sample_matches_reference_loop(kmax, vocab):
    gen = torch.Generator().manual_seed(100 * kmax + vocab)
    batch = 400
    q = random_probs(gen, (batch, kmax, vocab))
    p = random_probs(gen, (batch, kmax + 1, vocab))
    # some rows where the drafter is the target (all accepted) or one-hot (accept / reject decided by p alone)
    q[: batch // 8] = p[: batch // 8, :kmax]
    hot = torch.randint(vocab, (batch // 8, kmax), generator=gen)
    q[batch // 8 : batch // 4] = torch.nn.functional.one_hot(hot, vocab).float()
    draft_ids = draw(q, gen) if kmax else torch.zeros(batch, 0, dtype=torch.long)
    k = torch.randint(0, kmax + 1, (batch,), generator=gen)
    k[:10] = kmax
    k[10:20] = 0
    u_accept = torch.rand(batch, kmax, generator=gen)
    u_sample = torch.rand(batch, generator=gen)

    n, token = rejection_sample(draft_ids, q, p, k, u_accept, u_sample)

    assert n.shape == (batch,) and token.shape == (batch,)
    for b in range(batch):
        want = ref_rejection_round(
            draft_ids[b].tolist(), q[b].tolist(), p[b].tolist(), int(k[b]), u_accept[b].tolist(), float(u_sample[b])
        )
        assert (int(n[b]), int(token[b])) == want, f"row {b}: k={int(k[b])}"
    assert bool((n <= k).all())
    if kmax:
        # the test exercises accepts, rejections and full acceptance
        assert bool((n < k).any()) and bool(((n == k) & (k > 0)).any()) and bool((n > 0).any())


def test_rejection_sample_ignores_drafts_past_k():
    gen = torch.Generator().manual_seed(7)
    batch, kmax, vocab = 200, 4, 6
    q = random_probs(gen, (batch, kmax, vocab))
    p = random_probs(gen, (batch, kmax + 1, vocab))
    draft_ids = draw(q, gen)
    k = torch.randint(0, kmax + 1, (batch,), generator=gen)
    u_accept, u_sample = torch.rand(batch, kmax, generator=gen), torch.rand(batch, generator=gen)
    n, token = rejection_sample(draft_ids, q, p, k, u_accept, u_sample)

    past = torch.arange(kmax) >= k.unsqueeze(1)  # [B, Kmax] drafts that do not count
    draft2 = torch.where(past, draw(random_probs(gen, (batch, kmax, vocab)), gen), draft_ids)
    q2 = torch.where(past.unsqueeze(-1), random_probs(gen, (batch, kmax, vocab)), q)
    u2 = torch.where(past, torch.zeros_like(u_accept), u_accept)
    p2 = p.clone()
    after = (torch.arange(kmax + 1) > k.unsqueeze(1)).unsqueeze(-1)  # target positions after the bonus
    p2 = torch.where(after, random_probs(gen, (batch, kmax + 1, vocab)), p2)
    n2, token2 = rejection_sample(draft2, q2, p2, k, u2, u_sample)
    assert torch.equal(n, n2) and torch.equal(token, token2)


def test_rejection_sample_with_one_hot_probs_is_greedy_acceptance():
    gen = torch.Generator().manual_seed(3)
    batch, kmax, vocab = 500, 5, 13
    target_logits = torch.randn(batch, kmax + 1, vocab, generator=gen)
    # a drafter that agrees with the target's argmax at most positions but not all
    draft_logits = target_logits[:, :kmax] + 0.8 * torch.randn(batch, kmax, vocab, generator=gen)
    zeros, ones = torch.zeros(batch), torch.ones(batch)
    p = logits_to_probs(target_logits, zeros, ones)
    q = logits_to_probs(draft_logits, zeros, ones)
    draft_ids = q.argmax(-1)
    k = torch.randint(0, kmax + 1, (batch,), generator=gen)

    n_greedy, tok_greedy = ref_greedy_accept(draft_ids, target_logits, k)
    for _ in range(3):  # any uniforms: one-hot p and q leave nothing to chance
        n, tok = rejection_sample(draft_ids, q, p, k, torch.rand(batch, kmax, generator=gen), torch.rand(batch, generator=gen))
        assert torch.equal(n, n_greedy) and torch.equal(tok, tok_greedy)

    # and both say: accept while the draft is the target's argmax, then emit the target's argmax
    choice = target_logits.argmax(-1)
    for b in range(batch):
        m = 0
        while m < int(k[b]) and int(draft_ids[b, m]) == int(choice[b, m]):
            m += 1
        assert (int(n_greedy[b]), int(tok_greedy[b])) == (m, int(choice[b, m]))
    assert len(set(n_greedy.tolist())) > 3  # mixed acceptance lengths


# ----------------------------------------------------------------------------------------------
# Statistical: the emitted tokens follow the target's distribution whatever the drafter proposes.

# a context-free but position-dependent target and a very different drafter, over 6 tokens
P = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
        [0.05, 0.10, 0.05, 0.30, 0.20, 0.30],
        [0.17, 0.17, 0.16, 0.17, 0.16, 0.17],
        [0.02, 0.50, 0.02, 0.02, 0.42, 0.02],
    ]
)  # [Kmax + 1, V]
Q = torch.tensor(
    [
        [0.02, 0.03, 0.05, 0.10, 0.30, 0.50],
        [0.50, 0.05, 0.30, 0.05, 0.05, 0.05],
        [0.70, 0.02, 0.02, 0.02, 0.02, 0.22],
    ]
)  # [Kmax, V]


def run_rounds(q_row: torch.Tensor, p_row: torch.Tensor, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    kmax = q_row.shape[0]
    q = q_row.expand(rows, -1, -1)
    p = p_row.expand(rows, -1, -1)
    draft_ids = draw(q, gen)
    k = torch.full((rows,), kmax)
    n, token = rejection_sample(draft_ids, q, p, k, torch.rand(rows, kmax, generator=gen), torch.rand(rows, generator=gen))
    return draft_ids, n, token


def test_statistical_power_of_the_check():
    """The drafter's own distribution is far from the target's: the check below would catch emitting q."""
    for j in range(Q.shape[0]):
        assert 0.5 * (P[j] - Q[j]).abs().sum() > 0.3
    with pytest.raises(AssertionError):
        assert_follows(draw(Q[0].expand(50_000, -1), torch.Generator().manual_seed(0)), P[0], "drafter")
    # a wrong rule (accept every draft) fails too
    gen = torch.Generator().manual_seed(1)
    coin = torch.rand(50_000, generator=gen) < 0.5
    mixed = torch.where(coin, draw(P[0].expand(50_000, -1), gen), draw(Q[0].expand(50_000, -1), gen))
    with pytest.raises(AssertionError):
        assert_follows(mixed, P[0], "half drafter")


def test_emitted_tokens_follow_target_distribution():
    rows = 100_000
    draft_ids, n, token = run_rounds(Q, P, rows, seed=11)
    # every position mixes accepted drafts and recovered / bonus tokens
    assert 0.05 < (n == 0).float().mean() < 0.95 and bool((n == Q.shape[0]).any())
    for j in range(P.shape[0]):
        tokens, has = emitted_at(j, draft_ids, n, token)
        assert int(has.sum()) > 2_000
        assert_follows(tokens, P[j], f"emitted position {j}")


def test_second_token_is_independent_of_the_first():
    """Among rows that accepted d_1, the next emitted token follows p_2 whatever d_1 was."""
    draft_ids, n, token = run_rounds(Q, P, 100_000, seed=12)
    second, has = emitted_at(1, draft_ids, n, token)
    first = draft_ids[has, 0]
    checked = 0
    for t in first.unique():
        sel = second[first == t]
        if sel.numel() >= 1_500:
            assert_follows(sel, P[1], f"second token after first {int(t)}")
            checked += 1
    assert checked >= 4


def test_reduced_vocabulary_drafter_keeps_target_distribution():
    """A drafter over a subset of the vocabulary (q = 0 elsewhere) still yields exactly p."""
    vocab = P.shape[1]
    vocab_map = torch.tensor([1, 3, 4])  # the drafter can only propose these target ids
    q_sub = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]])  # [Kmax, N]
    q = expand_draft_probs(q_sub, vocab_map, vocab)
    assert q.shape == (3, vocab)
    assert torch.equal(q[:, [0, 2, 5]], torch.zeros(3, 3)) and torch.allclose(q.sum(-1), torch.ones(3))
    assert torch.equal(q[:, vocab_map], q_sub)
    assert expand_draft_probs(q_sub, None, vocab) is q_sub

    draft_ids, n, token = run_rounds(q, P, 60_000, seed=13)
    assert set(draft_ids.unique().tolist()) <= {1, 3, 4}
    for j in range(P.shape[0]):
        tokens, _ = emitted_at(j, draft_ids, n, token)
        assert_follows(tokens, P[j], f"reduced drafter, emitted position {j}")
    # tokens the drafter cannot propose are still emitted, through the residual
    first, _ = emitted_at(0, draft_ids, n, token)
    assert bool((first == 0).any()) and bool((first == 5).any())


@pytest.mark.parametrize("seed", range(4))
def test_every_head_a_replica_accepts_keeps_the_target_distribution(seed):
    """Property: a reduced head is accepted at load only with distinct target ids (dvi.models.load_drafter); for
    random such heads (any size, any order, any draft distribution) the emitted tokens follow p exactly."""
    g = torch.Generator().manual_seed(seed)
    vocab = P.shape[1]
    size = int(torch.randint(1, vocab + 1, (1,), generator=g))
    vocab_map = torch.randperm(vocab, generator=g)[:size]  # distinct ids, as load_drafter requires
    kmax = P.shape[0] - 1  # P: [Kmax + 1, V], the bonus position last
    q_sub = torch.softmax(torch.randn(kmax, size, generator=g) * 2, -1)  # [Kmax, N]
    q = expand_draft_probs(q_sub, vocab_map, vocab)
    assert torch.allclose(q.sum(-1), torch.ones(kmax))  # no draft mass lost in the scatter
    draft_ids, n, token = run_rounds(q, P, 40_000, seed=100 + seed)
    for j in range(P.shape[0]):
        tokens, _ = emitted_at(j, draft_ids, n, token)
        assert_follows(tokens, P[j], f"head {vocab_map.tolist()}, emitted position {j}")


def test_expected_acceptance_matches_observed_rate():
    draft_ids, n, token = run_rounds(Q, P, 60_000, seed=14)
    a = expected_acceptance(P[0], Q[0]).item()
    assert a == pytest.approx(1 - 0.5 * (P[0] - Q[0]).abs().sum().item())
    observed = (n >= 1).float().mean().item()
    assert abs(observed - a) < 4 * math.sqrt(a * (1 - a) / 60_000) + 1e-3


# ----------------------------------------------------------------------------------------------
# logits_to_probs and sample_from.


def ref_warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One distribution [V], plainly: temperature softmax, then the smallest top set reaching top_p."""
    if temperature == 0:
        out = torch.zeros_like(logits)
        out[logits.argmax()] = 1.0
        return out
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += float(probs[i])
        if mass >= top_p:
            break
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return (out / out.sum()).float()


def test_logits_to_probs_greedy_is_one_hot_at_argmax():
    logits = torch.randn(4, 3, 10, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, torch.zeros(4), torch.ones(4))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 10).float())
    # top_p < 1 does not change greedy
    assert torch.equal(logits_to_probs(logits, torch.zeros(4), torch.full((4,), 0.3)), probs)


def test_logits_to_probs_top_p_keeps_smallest_prefix():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    cases = {0.3: [1], 0.7: [1, 3], 0.79: [1, 3], 0.81: [1, 3, 2], 0.96: [0, 1, 2, 3], 1.0: [0, 1, 2, 3]}
    for top_p, kept in cases.items():
        probs = logits_to_probs(logits, torch.ones(1), torch.tensor([top_p]))[0]
        assert sorted(probs.nonzero().view(-1).tolist()) == sorted(kept), top_p
        assert probs.sum().item() == pytest.approx(1.0)
        base = torch.tensor([0.05, 0.5, 0.15, 0.3])
        assert torch.allclose(probs[kept], base[kept] / base[kept].sum())


def test_logits_to_probs_mixed_rows_match_reference():
    gen = torch.Generator().manual_seed(5)
    temps = [0.0, 0.5, 1.0, 2.0, 1.0, 0.7, 0.0, 1.3]
    top_ps = [1.0, 0.9, 1.0, 0.5, 0.2, 0.95, 0.4, 1.0]
    logits = torch.randn(len(temps), 3, 20, generator=gen) * 2  # [B, K, V]
    probs = logits_to_probs(logits, torch.tensor(temps), torch.tensor(top_ps))
    assert probs.shape == logits.shape
    for b, (t, tp) in enumerate(zip(temps, top_ps)):
        alone = logits_to_probs(logits[b : b + 1], torch.tensor([t]), torch.tensor([tp]))[0]
        assert torch.allclose(probs[b], alone, atol=1e-6)
        for j in range(3):
            assert torch.allclose(probs[b, j], ref_warp(logits[b, j], t, tp), atol=1e-5), (b, j)
    # top_p < 1 drops tokens
    assert bool((probs[4] == 0).sum(-1).gt(0).all())
    # 2D logits (one position per row) work too
    flat = logits_to_probs(logits[:, 0], torch.tensor(temps), torch.tensor(top_ps))
    assert torch.allclose(flat, probs[:, 0])


def test_sample_from_never_returns_zero_probability_tokens():
    gen = torch.Generator().manual_seed(9)
    probs = random_probs(gen, (2000, 12), zero_frac=0.6)
    probs[:100, -3:] = 0.0  # trailing zeros: u close to 1 must not run past the last nonzero token
    probs[:100, 0] += 0.1
    for u in (torch.zeros(2000), torch.full((2000,), 0.999999), torch.rand(2000, generator=gen)):
        idx = sample_from(probs, u)
        assert idx.dtype == torch.int64 and idx.shape == (2000,)
        assert bool((probs.gather(-1, idx.unsqueeze(-1)) > 0).all())
    # unnormalised weights: u = 0 gives the first nonzero token, u -> 1 the last
    w = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0]])
    assert sample_from(w, torch.tensor([0.0])).item() == 1
    assert sample_from(w, torch.tensor([0.999999])).item() == 3


def test_sample_from_one_hot_and_inverse_cdf():
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 3, 6, 2]), 7).float()
    for u in (0.0, 0.5, 0.999999):
        assert sample_from(one_hot, torch.full((4,), u)).tolist() == [0, 3, 6, 2]
    # a uniform grid of u lands on each token in proportion to its weight
    w = torch.tensor([1.0, 0.0, 3.0, 4.0, 2.0])
    m = 10_000
    u = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    counts = torch.bincount(sample_from(w.expand(m, -1), u.float()), minlength=5)
    assert (counts - w / w.sum() * m).abs().max() <= 2
    # leading batch dims
    probs = random_probs(torch.Generator().manual_seed(1), (3, 4, 5))
    assert sample_from(probs, torch.rand(3, 4)).shape == (3, 4)


# ----------------------------------------------------------------------------------------------
# The cost model.


def test_expected_tokens_per_round():
    for k in range(0, 9):
        assert expected_tokens_per_round(0.0, k) == 1.0
        assert expected_tokens_per_round(1.0, k) == float(k + 1)
        for a in (0.1, 0.5, 0.8, 0.99):
            series = sum(a**i for i in range(k + 1))  # 1 + a + ... + a^k
            assert expected_tokens_per_round(a, k) == pytest.approx(series)
    assert expected_tokens_per_round(0.7, 3) < expected_tokens_per_round(0.7, 4) < expected_tokens_per_round(0.8, 4)


def test_expected_tokens_per_round_by_position_matches_the_rounds_it_describes():
    rng = random.Random(3)
    for _ in range(20):
        rates = [rng.random() for _ in range(rng.randint(1, 5))]
        for k in range(0, 7):
            # plain reference: sum over every outcome (accepted n of k) of its probability times its n + 1 tokens
            expected = 0.0
            for n in range(k + 1):
                p = math.prod(rates[min(i, len(rates) - 1)] for i in range(n))
                if n < k:
                    p *= 1 - rates[min(n, len(rates) - 1)]
                expected += p * (n + 1)
            assert expected_tokens_per_round(rates, k) == pytest.approx(expected)
        assert expected_tokens_per_round([rates[0]], 4) == pytest.approx(expected_tokens_per_round(rates[0], 4))


def test_position_acceptance_is_each_positions_rate_shrunk_to_the_one_before():
    assert position_acceptance([], [], 0.5, 4.0) == []
    a = position_acceptance([50.0, 45.0, 0.0], [100.0, 50.0, 0.0], 0.5, 4.0)
    assert a[0] == pytest.approx(52 / 104)
    assert a[1] == pytest.approx((45 + 4 * a[0]) / 54)
    assert a[2] == pytest.approx(a[1])  # never tested: its neighbour's rate


def test_ideal_speedup():
    assert ideal_speedup(0.0, 0, 0.5, 1.0) == 1.0  # plain decoding
    assert ideal_speedup(1.0, 4, 0.0, 1.0) == 5.0  # free perfect drafter
    assert ideal_speedup(0.8, 4, 0.1, 1.2) == pytest.approx(expected_tokens_per_round(0.8, 4) / (0.4 + 1.2))
    assert ideal_speedup(0.0, 3, 0.2, 1.0) < 1.0  # a useless drafter only costs


def test_choose_k():
    # nothing beats min_speedup: decode plainly
    assert choose_k(0.05, draft_cost=0.5, verify_slope=0.1, k_min=1, k_max=8) == 0
    assert choose_k(0.9, draft_cost=0.05, verify_slope=0.0, k_min=1, k_max=8, min_speedup=100.0) == 0
    # a good, cheap drafter: long drafts; a costlier one: shorter
    assert choose_k(0.95, draft_cost=0.02, verify_slope=0.0, k_min=1, k_max=8) == 8
    assert 1 <= choose_k(0.6, draft_cost=0.3, verify_slope=0.1, k_min=1, k_max=8) < 8
    for a in (0.0, 0.2, 0.5, 0.7, 0.9, 0.99):
        for c in (0.01, 0.1, 0.5, 1.0):
            for k_min, k_max in ((1, 8), (2, 5), (3, 3)):
                k = choose_k(a, c, 0.12, k_min, k_max, 1.0)
                assert k == 0 or k_min <= k <= k_max
                speedups = {j: ideal_speedup(a, j, c, 1.0 + 0.12 * j) for j in range(k_min, k_max + 1)}
                if k == 0:
                    assert max(speedups.values()) <= 1.0
                else:
                    assert speedups[k] == max(speedups.values()) and speedups[k] > 1.0


def test_acceptance_estimate():
    assert acceptance_estimate(0, 0, prior=0.5, prior_weight=4) == 0.5  # no data: the prior
    assert acceptance_estimate(30, 40, prior=0.5, prior_weight=4) == pytest.approx(32 / 44)
    assert acceptance_estimate(9000, 10000, prior=0.5, prior_weight=4) == pytest.approx(0.9, abs=1e-3)
    assert acceptance_estimate(0, 1000, prior=0.5, prior_weight=4) == pytest.approx(2 / 1004)
    assert acceptance_estimate(1000, 1000, prior=0.5, prior_weight=4) < 1.0  # clamped below 1: finite series
    assert acceptance_estimate(1e17, 1e17, prior=0.99, prior_weight=1) < 1.0  # (1e17 + .99) / (1e17 + 1) rounds to 1


# ----------------------------------------------------------------------------------------------
# SpecStats.


def stats_of(rounds: list[tuple[int, int]]) -> SpecStats:
    s = SpecStats()
    for k, n in rounds:
        s.add(k, n)
    return s


def test_spec_stats_counts():
    s = stats_of([(4, 2), (4, 4), (0, 0), (2, 0)])
    assert (s.rounds, s.spec_rounds, s.drafted, s.accepted) == (4, 3, 10, 6)
    assert s.acceptance_rate == pytest.approx(0.6)
    assert s.mean_accepted_length == pytest.approx((6 + 4) / 4)  # the recovered / bonus token counts
    assert s.position_drafted == [3, 3, 2, 2]
    assert s.position_accepted == [2, 2, 1, 1]
    assert s.per_position_acceptance == pytest.approx([2 / 3, 2 / 3, 0.5, 0.5])
    d = s.to_dict()
    assert d["acceptance_rate"] == 0.6 and d["mean_accepted_length"] == 2.5 and d["drafted"] == 10
    assert d["per_position_acceptance"] == [round(2 / 3, 6), round(2 / 3, 6), 0.5, 0.5]


def test_spec_stats_edge_cases():
    empty = SpecStats()
    assert empty.acceptance_rate == 0.0 and empty.mean_accepted_length == 0.0 and empty.per_position_acceptance == []
    plain = stats_of([(0, 0)] * 5)  # plain decoding: one token per round
    assert plain.mean_accepted_length == 1.0 and plain.acceptance_rate == 0.0 and plain.spec_rounds == 0
    perfect = stats_of([(3, 3)] * 4)
    assert perfect.mean_accepted_length == 4.0 and perfect.acceptance_rate == 1.0
    assert perfect.per_position_acceptance == [1.0, 1.0, 1.0]


def test_spec_stats_merge_equals_counting_all_rounds():
    a_rounds = [(2, 1), (2, 2), (0, 0)]
    b_rounds = [(5, 3), (1, 0), (5, 5), (3, 1)]
    merged = stats_of(a_rounds)
    merged.merge(stats_of(b_rounds))  # the other is longer: positions grow
    assert merged == stats_of(a_rounds + b_rounds)
    merged2 = stats_of(b_rounds)
    merged2.merge(stats_of(a_rounds))
    assert merged2 == stats_of(b_rounds + a_rounds)
    before = stats_of(a_rounds)
    before.merge(SpecStats())
    assert before == stats_of(a_rounds)


def test_choose_k_from_costs_matches_a_plain_search():
    """Against the plain reference: every K's predicted speedup from the table, the best one if it beats min_speedup."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        k_max = int(torch.randint(1, 9, (1,), generator=g))
        k_min = int(torch.randint(1, k_max + 1, (1,), generator=g))
        a, c = float(torch.rand(1, generator=g)), float(torch.rand(1, generator=g)) * 0.5
        v = [1.0] + (1.0 + 2.0 * torch.rand(k_max, generator=g)).tolist()  # non-monotone, like this CPU's
        floor = float(torch.rand(1, generator=g)) * 2
        ref_k, ref_s = 0, floor
        for k in range(k_min, k_max + 1):
            tokens = sum(a**i for i in range(k + 1))  # E[tokens per round], the geometric series written out
            if tokens / (k * c + v[k]) > ref_s:
                ref_k, ref_s = k, tokens / (k * c + v[k])
        assert choose_k_from_costs(a, c, v, k_min, k_max, floor) == ref_k


def test_choose_k_is_the_linear_table():
    for a in (0.1, 0.5, 0.8):
        for slope in (0.0, 0.12, 0.5):
            assert choose_k(a, 0.2, slope, 1, 8) == choose_k_from_costs(a, 0.2, linear_verify_costs(slope, 8), 1, 8)
    assert linear_verify_costs(0.5, 3) == [1.0, 1.5, 2.0, 2.5]


def test_batch_bucket_and_moving_average():
    assert [batch_bucket(b) for b in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert moving_average(None, 3.0, 0.2) == 3.0
    assert moving_average(1.0, 3.0, 0.25) == pytest.approx(1.5)
    x = None
    for _ in range(200):
        x = moving_average(x, 2.0, 0.2)
    assert x == pytest.approx(2.0)


def test_moving_variance_follows_the_spread_of_what_the_moving_average_averages():
    assert moving_variance(None, None, 5.0, 0.05) == 0.0  # the first value: no spread yet
    mean = var = None
    for i in range(2000):
        x = (10.0, 20.0, 30.0)[i % 3]
        var, mean = moving_variance(var, mean, x, 0.05), moving_average(mean, x, 0.05)
    assert var == pytest.approx(statistics.pvariance([10.0, 20.0, 30.0]), rel=0.1)
    for _ in range(2000):
        var, mean = moving_variance(var, mean, 7.0, 0.05), moving_average(mean, 7.0, 0.05)
    assert var == pytest.approx(0.0, abs=1e-9)  # a steady value: the spread decays away


def test_cheapest_k():
    assert cheapest_k(0.24, [1.0, 2.4, 2.0, 1.9, 1.5], 1, 4) == 4  # 2.46 < 2.64 (K = 1)
    assert cheapest_k(0.24, [1.0, 1.1, 1.2, 1.3, 1.4], 1, 4) == 1
    assert cheapest_k(0.0, [1.0, 1.0, 1.0], 1, 2) == 1  # ties: the smaller K
    assert cheapest_k(0.5, [1.0, 1.0, 1.0, 1.0], 2, 3) == 2


def test_ban_tokens_bans_exactly_the_early_positions_of_each_row():
    logits = torch.randn(2, 3, 7)
    out = ban_tokens(logits, [1, 4], [2, 0])
    for b, first in enumerate([2, 0]):
        for j in range(3):
            for t in range(7):
                banned = t in (1, 4) and j < first
                assert (out[b, j, t] == float("-inf")) if banned else (out[b, j, t] == logits[b, j, t])
    assert not torch.isinf(logits).any()  # the input is untouched
