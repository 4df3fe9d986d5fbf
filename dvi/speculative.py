"""Speculative decoding maths: small pure functions over tensors, random numbers passed in.

Vocabulary (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

- p_j, q_j: the target's and the drafter's next-token distributions at drafted position j, after the
  same temperature / top-p warping. Greedy decoding is temperature 0: both become one-hot at the argmax.
- drafted tokens d_1..d_K: proposed by the drafter, d_j ~ q_j.
- accepted tokens: the longest prefix d_1..d_n whose every token passes u_j < p_j(d_j) / q_j(d_j).
- recovered token: at the first rejection (n < K) a token drawn from the residual
  norm(max(0, p_{n+1} - q_{n+1})).
- bonus token: when all K drafts are accepted, one more token drawn from the target's p_{K+1}.

Every round therefore emits n + 1 tokens. "Mean accepted length" counts that +1 (the recovered or bonus
token), so a drafter that is never right still scores 1.0; "acceptance rate" is accepted / drafted.
With this rule the emitted tokens follow the target's distribution exactly, whatever q is; with
one-hot p and q it reduces to "accept while the draft equals the target's argmax".

Nothing here knows about models, caches, tokenizers or batching policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def logits_to_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Warp logits into the distribution that decoding samples from.

    logits: [B, ..., V]; temperature, top_p: [B]. Temperature 0 gives one-hot at the argmax (greedy).
    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (the top token always).
    Returns float32 probabilities [B, ..., V].
    """
    logits = logits.float()
    shape = (-1,) + (1,) * (logits.ndim - 1)
    greedy = (temperature <= 0).view(shape)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(shape).float()
    probs = torch.softmax(logits / t, dim=-1)
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p.view(shape).float()
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def ban_tokens(logits: torch.Tensor, ids: list[int], first: list[int]) -> torch.Tensor:
    """Logits [B, J, V] with the tokens `ids` made impossible (-inf) at positions j < first[b] of row b (a
    request's min_tokens: its end ids cannot come before). Verifying against the banned distribution keeps
    speculative sampling exact for it: a drafted banned token has target probability 0 and is never accepted."""
    j = torch.arange(logits.shape[1], device=logits.device)
    early = j.unsqueeze(0) < torch.tensor(first, device=logits.device).unsqueeze(1)  # [B, J]
    index = torch.tensor(ids, device=logits.device)
    out = logits.clone()
    out[..., index] = out[..., index].masked_fill(early.unsqueeze(-1), float("-inf"))
    return out


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first index whose cumulative mass exceeds u * total.

    probs: [..., V] (need not be normalised); u: [...] uniform in [0, 1). Returns int64 [...].
    Zero-probability tokens are never returned; one-hot probs return their hot index for any u.
    """
    cdf = probs.cumsum(-1)
    target = (u.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def expand_draft_probs(q_sub: torch.Tensor, vocab_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Place a reduced-vocabulary drafter's probabilities into the target's vocabulary (zero elsewhere).

    q_sub: [..., N]; vocab_map: [N] target ids (None: q_sub is already over the full vocabulary).
    Returns [..., vocab_size].
    """
    if vocab_map is None:
        return q_sub
    full = q_sub.new_zeros(q_sub.shape[:-1] + (vocab_size,))
    return full.scatter_(-1, vocab_map.expand(q_sub.shape), q_sub)


def rejection_sample(
    draft_ids: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    k: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one round of drafts: how many are accepted, and the token the target emits after them.

    draft_ids: [B, Kmax] drafted target ids; q: [B, Kmax, V] drafter probs; p: [B, Kmax + 1, V] target probs;
    k: [B] drafts that count for each row (k <= Kmax; drafts past k are ignored, k = 0 is plain decoding);
    u_accept: [B, Kmax] and u_sample: [B], uniform in [0, 1).
    Returns n_accepted [B] (0..k) and next_token [B] (recovered token if n < k, bonus token if n == k).
    """
    batch, kmax = draft_ids.shape
    rows = torch.arange(batch, device=p.device)
    if kmax:
        p_d = p[:, :kmax].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)  # [B, Kmax]
        q_d = q.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)  # [B, Kmax]
        # u < min(1, p/q) written without the division; q_d > 0 for a token drafted from q
        ok = u_accept * q_d < p_d
        ok &= torch.arange(kmax, device=p.device) < k.unsqueeze(-1)
        n = ok.long().cumprod(-1).sum(-1)  # [B] length of the accepted prefix
    else:
        n = torch.zeros(batch, dtype=torch.long, device=p.device)
    p_n = p[rows, n]  # [B, V]
    if kmax:
        q_n = q[rows, n.clamp(max=kmax - 1)]
        residual = (p_n - q_n).clamp_(min=0.0)
        # rows that stopped at a rejection draw from the residual; rows that took all k draws a bonus from p
        rejected = (n < k).unsqueeze(-1) & (residual.sum(-1, keepdim=True) > 0)
        p_n = torch.where(rejected, residual, p_n)
    return n, sample_from(p_n, u_sample)


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Probability that a draft from q is accepted against p: sum_x min(p(x), q(x)) = 1 - TV(p, q).

    p, q: [..., V] probabilities. Returns [...].
    """
    return torch.minimum(p, q).sum(-1)


# ----------------------------------------------------------------------------------------------
# The cost model (Leviathan et al. 2023, section 3.4), in units of one target decoding step.


Acceptance = float | Sequence[float]
"""Per-token acceptance: one rate for every draft position, or the rate at each position given the drafts before it
were accepted (`position_acceptance`; positions past its end take its last)."""


def expected_tokens_per_round(a: Acceptance, k: int) -> float:
    """E[tokens emitted per round] for k drafts: 1 + sum over j <= k of P(the first j drafts accepted); for one rate
    a, (1 - a^(k+1)) / (1 - a)."""
    if k <= 0:
        return 1.0
    if isinstance(a, Sequence):
        tokens = run = 1.0
        for j in range(k):
            run *= a[min(j, len(a) - 1)]
            tokens += run
        return tokens
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def position_acceptance(accepted: Sequence[float], trials: Sequence[float], prior: float, prior_weight: float) -> list[float]:
    """The acceptance at each draft position given the drafts before it were accepted, from counts per position
    (`accepted[i]`: rounds that accepted draft i + 1; `trials[i]`: rounds that tested it, i.e. drafted it and accepted
    the i before). Acceptance is bursty (a context the drafter has right stays right for a few tokens), so one rate
    over all positions mispredicts what each K returns (over at some K, under at others). Position 1 shrinks to `prior`, each later position to the
    estimate of the one before (a position rarely tested takes its neighbour's rate), `prior_weight` trials each."""
    out, anchor = [], prior
    for acc, tr in zip(accepted, trials):
        anchor = acceptance_estimate(acc, tr, anchor, prior_weight)
        out.append(anchor)
    return out


def ideal_speedup(a: Acceptance, k: int, draft_cost: float, verify_cost: float) -> float:
    """Speedup over plain decoding: tokens per round over the round's cost (k drafts plus one verify).

    draft_cost: one drafter step / one target step (the cost ratio c); verify_cost: one verification of
    k + 1 tokens / one target step (1 for an ideal verifier).
    """
    return expected_tokens_per_round(a, k) / (k * draft_cost + verify_cost)


def choose_k(a: float, draft_cost: float, verify_slope: float, k_min: int, k_max: int, min_speedup: float = 1.0) -> int:
    """`choose_k_from_costs` with the linear verify model: verifying k + 1 tokens costs 1 + verify_slope * k steps."""
    return choose_k_from_costs(a, draft_cost, linear_verify_costs(verify_slope, k_max), k_min, k_max, min_speedup)


def choose_k_from_costs(a: Acceptance, draft_cost: float, verify_cost: list[float], k_min: int, k_max: int,
                        min_speedup: float = 1.0) -> int:
    """The K in [k_min, k_max] with the best predicted speedup, or 0 when none beats `min_speedup`.

    verify_cost: [k_max + 1] cost of verifying k + 1 tokens, in target steps (verify_cost[0] = 1: plain decoding);
    draft_cost: one drafter step in target steps. Predicted speedup = `ideal_speedup(a, k, draft_cost, verify_cost[k])`.
    """
    best_k, best = 0, min_speedup
    for k in range(k_min, k_max + 1):
        s = ideal_speedup(a, k, draft_cost, verify_cost[k])
        if s > best:
            best_k, best = k, s
    return best_k


def cheapest_k(draft_cost: float, verify_cost: list[float], k_min: int, k_max: int) -> int:
    """The K in [k_min, k_max] whose round costs least, k * draft_cost + verify_cost[k] (target steps): the
    cheapest probe of a drafter that is not paying (on a CPU, verifying 2 tokens can cost more than 5)."""
    return min(range(k_min, k_max + 1), key=lambda k: (k * draft_cost + verify_cost[k], k))


def linear_verify_costs(verify_slope: float, k_max: int) -> list[float]:
    """[k_max + 1] verify costs of the linear model, 1 + verify_slope * k target steps."""
    return [1.0 + verify_slope * k for k in range(k_max + 1)]


def batch_bucket(batch: int) -> int:
    """The batch-size bucket whose costs a batch of `batch` rows shares: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch - 1).bit_length()


def moving_average(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average: `new` weighs `weight`, the past 1 - weight; the first value is taken as is."""
    return new if old is None else (1.0 - weight) * old + weight * new


def moving_variance(old: float | None, mean: float | None, new: float, weight: float) -> float:
    """The exponentially weighted variance beside `moving_average`: `old` the variance so far and `mean` the average
    before `new` moves it (None before the first value, whose variance is 0)."""
    if mean is None:
        return 0.0
    d = new - mean
    return (1.0 - weight) * ((old or 0.0) + weight * d * d)


def acceptance_estimate(accepted: float, trials: float, prior: float, prior_weight: float) -> float:
    """Per-token acceptance estimate from counts, shrunk towards a prior (a Beta posterior mean).

    A round with n accepted of k drafts contributes n successes and n + (1 if n < k else 0) trials: the
    drafts after the first rejection were never tested.
    """
    a = (accepted + prior * prior_weight) / (trials + prior_weight)
    return min(max(a, 0.0), 1.0 - 1e-9) if not math.isnan(a) else prior
