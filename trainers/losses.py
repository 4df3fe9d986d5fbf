"""Distillation losses for the drafter: small pure functions over tensors, every shape written down.

This module owns the maths of one training step's objective: the teacher distribution (from the logged
top-k log-probs or from full target logits), the divergences between teacher p and student q per position,
masking and reduction, the DVI-style reward term from the accept/reject decisions, and the KL-to-reward
schedule. It knows nothing about DeepSpeed, Kafka, record formats, replay buffers or models: callers pass
logits and ids in, and get a scalar loss (with grad) and a dict of float metrics (without) back.

Vocabulary (as in `dvi.speculative`; a round drafts d_1..d_k, n of them are accepted):

- position j = 0..k of a round: the context prompt + accepted output + d_1..d_j. Positions 0..k-1 are the
  drafted positions (the student's distribution there proposed d_{j+1}); position k is the bonus position.
  The teacher (the target's top-k ids / log-probs) is logged at all k + 1 positions. The objective
  (`position_loss`) takes a flat list of P teacher positions: those that produced a generated token
  (j = 0..n; `trainers.data` lays them out, one causal forward per record).
- reward of a drafted position: +1 if its draft was accepted (j < n), -penalty if it was the first rejected
  one (j = n < k); positions after the first rejection and the bonus position were never judged.
- p: the teacher's next-token distribution (temperature 1, unwarped, like the logged log-probs).
  q: the student's (drafter's) distribution, softmax of its logits at temperature 1.
- V: the target vocabulary. N: the student's vocabulary: N = V for a full-vocabulary drafter, or a reduced
  head whose row i is target token `vocab_map[i]` (`vocab_map`: [N] int64 target ids, as in `dvi.models`).
  The student's probability of every target token outside `vocab_map` is 0.
- outside: the teacher's mass on target tokens the student cannot produce (outside `vocab_map`; 0 for a
  full-vocabulary student). A `Teacher` is p restricted to the student's vocabulary plus that scalar, so
  p over the target vocabulary is recoverable exactly and nothing is materialised at width V. A top-k teacher
  is kept sparse (its k probabilities at the student's rows, `Teacher.index`): every divergence, the expected
  acceptance and the argmax then read the student's log-probs at k tokens per position instead of N, with the
  student's mass elsewhere entering in closed form (`teacher_divergence`, tested against the dense form).

Divergences, per position, over the target vocabulary (the choices for zeros and unreachable mass):

- forward KL(p || q) = sum_x p(x) log(p(x) / q(x)). Infinite as soon as the teacher puts mass where the
  student cannot, so for this one divergence the teacher is renormalised over the student's vocabulary (the
  outside mass is dropped; same minimiser: q proportional to p on the student's vocabulary). A position whose
  teacher mass is entirely outside gets 0.
- reverse KL(q || p) = sum_x q(x) log(q(x) / p(x)). Exact: q is 0 outside the student's vocabulary.
- JSD_beta(p || q) = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q (the generalised
  JSD of GKD, Agarwal et al. 2024; beta = 0.5 is the symmetric JSD, bounded by log 2). Exact: the outside
  mass enters as the constant beta * log(1 / beta) * outside.
- TV(p, q) = 0.5 * sum_x |p(x) - q(x)| = 1 - sum_x min(p(x), q(x)) = 1 - `expected_acceptance`(p, q), the
  probability that a draft from q is rejected against p. Exact: the outside mass enters as 0.5 * outside, so
  TV here is 1 - the acceptance the engine measures, reduced vocabulary included.

Zeros: a term whose weight is 0 (p(x) = 0 in p log p, q(x) = 0 in q log q) is 0. Where a log would be
-inf under a positive weight (log q(x) with p(x) > 0 and q(x) = 0 in forward KL; log p(x) with q(x) > 0 and
p(x) = 0 in reverse KL, e.g. outside the teacher's top-k; log q(d) of a drafted token in the reward term),
the log is clamped at LOG_FLOOR = log(1e-8), about -18.4: each unit of misplaced mass costs at most about
18.4 nats more than it would at probability 1e-8, values and gradients stay finite, and the gradient of a
clamped log q is 0. Every function computes in float32 whatever the logits' dtype.

The teacher is a constant: constructors detach it. The reward term has no baseline and no importance
correction for drafts proposed by an older drafter version: it is the plain REINFORCE term of DVI.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dvi.speculative import expected_acceptance, logits_to_probs

PROB_FLOOR = 1e-8
LOG_FLOOR = math.log(PROB_FLOOR)  # about -18.42
DIVERGENCES = ("fkl", "rkl", "jsd", "tv")


class Teacher(NamedTuple):
    """The teacher's distribution as seen from the student's vocabulary, dense or sparse.

    Dense (`index` None): `probs` [..., N] over every student token. Sparse (a top-k teacher, `teacher_from_topk`):
    `probs` [..., k] at the student rows `index` [..., k] (distinct where `inside`), every other student token 0;
    entries not `inside` (target tokens the student cannot produce) have probability 0 here, their mass is in
    `outside`. Both forms describe the same distribution (`dense`); the sparse one costs O(k) per position where
    the dense one costs O(N), and every function below takes either."""

    probs: torch.Tensor  # [..., N] (dense) or [..., k] (sparse) float32 teacher probabilities (no grad)
    outside: torch.Tensor  # [...] float32 teacher mass on target tokens the student cannot produce
    index: torch.Tensor | None = None  # [..., k] int64 student rows of the sparse probs (0 where not inside)
    inside: torch.Tensor | None = None  # [..., k] bool the student has that token

    @property
    def sparse(self) -> bool:
        return self.index is not None

    def select(self, keep: torch.Tensor) -> Teacher:
        """The positions where `keep` [...] (bool) is True."""
        return Teacher(*(None if t is None else t[keep] for t in self))

    def dense(self, width: int) -> Teacher:
        """The dense form over a student vocabulary of `width` tokens (itself when dense)."""
        if not self.sparse:
            return self
        probs = self.probs.new_zeros(self.probs.shape[:-1] + (width,))  # [..., N]
        probs.scatter_add_(-1, self.index, torch.where(self.inside, self.probs, torch.zeros_like(self.probs)))
        return Teacher(probs, self.outside)

    def argmax(self) -> torch.Tensor:
        """The student row of the teacher's most likely student token [...]."""
        if not self.sparse:
            return self.probs.argmax(-1)
        return self.index.gather(-1, torch.where(self.inside, self.probs, -1.0).argmax(-1, keepdim=True)).squeeze(-1)


# ----------------------------------------------------------------------------------------------
# Vocabularies and teachers.


def student_index(ids: torch.Tensor, vocab_map: torch.Tensor | None, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Map target token ids to rows of the student's output.

    ids: [...] target ids (any int; padding such as -1 is fine); vocab_map: [N] distinct target ids, or None for
    a full-vocabulary student of width `vocab_size` (required then).
    Returns index [...] int64 in [0, N) (0 where not inside) and inside [...] bool: the student has that token.
    """
    ids = ids.long()
    if vocab_map is None:
        if vocab_size is None:
            raise ValueError("student_index: give vocab_size for a full-vocabulary student (vocab_map is None)")
        inside = (ids >= 0) & (ids < vocab_size)
        return torch.where(inside, ids, torch.zeros_like(ids)), inside
    sorted_ids, order = vocab_map.long().sort()  # [N]
    pos = torch.searchsorted(sorted_ids, ids.contiguous()).clamp_(max=sorted_ids.numel() - 1)  # [...]
    inside = sorted_ids[pos] == ids
    return torch.where(inside, order[pos], torch.zeros_like(ids)), inside


def teacher_from_topk(
    topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab_size: int, vocab_map: torch.Tensor | None = None,
    dense: bool = False,
) -> Teacher:
    """The teacher from logged top-k log-probs, renormalised over the top-k set.

    topk_ids: [..., topk] distinct target ids; topk_logprobs: [..., topk] their log-probs (any float dtype, any base
    normalisation: only their differences matter); vocab_size: V, the target vocabulary; vocab_map: [N] or None.
    p(x) = exp(lp(x)) / sum_topk exp(lp) for x in the top-k, 0 elsewhere (the tail beyond the top-k is dropped:
    its distribution was not logged). Top-k ids the student cannot produce go to `outside`.
    Returns the sparse Teacher(probs [..., topk], outside [...], index, inside), or with `dense` Teacher(probs
    [..., N], outside [...]) with N = V when vocab_map is None.
    """
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(f"teacher_from_topk: ids {tuple(topk_ids.shape)} and log-probs {tuple(topk_logprobs.shape)} differ in shape")
    top_p = torch.softmax(topk_logprobs.detach().float(), dim=-1)  # [..., topk]
    idx, inside = student_index(topk_ids, vocab_map, vocab_size)  # [..., topk]
    outside = torch.where(inside, torch.zeros_like(top_p), top_p).sum(-1)  # [...]
    sparse = Teacher(torch.where(inside, top_p, torch.zeros_like(top_p)), outside, idx, inside)
    return sparse.dense(vocab_size if vocab_map is None else vocab_map.numel()) if dense else sparse


def teacher_from_logits(logits: torch.Tensor, vocab_map: torch.Tensor | None = None, temperature: float = 1.0) -> Teacher:
    """The teacher from full target logits (records without top-k: the trainer's copy of the target).

    logits: [..., V]; vocab_map: [N] or None; temperature: as in `dvi.speculative.logits_to_probs` (1 matches
    the logged top-k; 0 is one-hot at the argmax). Returns Teacher(probs [..., N], outside [...]).
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])  # [M, V]
    rows = flat.shape[0]
    temp, top_p = torch.full((rows,), float(temperature), device=flat.device), torch.ones(rows, device=flat.device)
    p = logits_to_probs(flat, temp, top_p).reshape(logits.shape)  # [..., V]
    if vocab_map is None:
        return Teacher(p, torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device))
    sub = p[..., vocab_map.long()]  # [..., N]
    return Teacher(sub, (p.sum(-1) - sub.sum(-1)).clamp_(min=0.0))


def student_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log q: float32 log-softmax of the student's logits [..., N] (temperature 1). Returns [..., N]."""
    return torch.log_softmax(logits.float(), dim=-1)


def _finite(log_x: torch.Tensor) -> torch.Tensor:
    """-inf (a probability of exactly 0) becomes the most negative float, so 0 * log 0 is 0, not NaN."""
    return log_x.clamp(min=torch.finfo(log_x.dtype).min)


def _outside(p: torch.Tensor, outside: torch.Tensor | None) -> torch.Tensor:
    return p.new_zeros(p.shape[:-1]) if outside is None else outside.float()


# ----------------------------------------------------------------------------------------------
# Divergences, per position. p: [..., N] teacher probs (a constant); log_q: [..., N] student log-probs
# (normalised, e.g. `student_log_probs`); outside: [...] teacher mass the student cannot produce (None: 0).
# Each returns [...]; the module docstring states how zeros and the outside mass are handled.


def forward_kl(p: torch.Tensor, log_q: torch.Tensor, outside: torch.Tensor | None = None) -> torch.Tensor:
    """KL(p || q) with p renormalised over the student's vocabulary (`outside` dropped); log q >= LOG_FLOOR."""
    p = p.float()
    mass = p.sum(-1, keepdim=True)  # [..., 1] = 1 - outside
    p = torch.where(mass > 0, p / mass.clamp(min=torch.finfo(p.dtype).tiny), torch.zeros_like(p))
    return (torch.xlogy(p, p) - p * log_q.clamp(min=LOG_FLOOR)).sum(-1)


def reverse_kl(p: torch.Tensor, log_q: torch.Tensor, outside: torch.Tensor | None = None) -> torch.Tensor:
    """KL(q || p); log p >= LOG_FLOOR where p is 0 (outside the top-k). `outside` does not enter (q is 0 there)."""
    log_q = _finite(log_q)
    log_p = torch.log(p.float()).clamp(min=LOG_FLOOR)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def jsd(p: torch.Tensor, log_q: torch.Tensor, outside: torch.Tensor | None = None, beta: float = 0.5) -> torch.Tensor:
    """Generalised JSD: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q, 0 < beta < 1."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd: beta must be strictly between 0 and 1, got {beta}")
    p = p.float()
    log_q = _finite(log_q)
    log_m = torch.logaddexp(math.log(beta) + torch.log(p), math.log(1.0 - beta) + log_q)  # [..., N], finite
    kl_pm = (torch.xlogy(p, p) - p * log_m).sum(-1) + _outside(p, outside) * math.log(1.0 / beta)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return beta * kl_pm + (1.0 - beta) * kl_qm


def total_variation(p: torch.Tensor, log_q: torch.Tensor, outside: torch.Tensor | None = None) -> torch.Tensor:
    """TV = 0.5 * (sum |p - q| + outside) = 1 - expected_acceptance(p, q) over the target vocabulary."""
    return 0.5 * ((p.float() - log_q.exp()).abs().sum(-1) + _outside(p, outside))


def divergence(name: str, p: torch.Tensor, log_q: torch.Tensor, outside: torch.Tensor | None = None, beta: float = 0.5) -> torch.Tensor:
    """One of DIVERGENCES by name ("fkl" | "rkl" | "jsd" | "tv"); beta is used by "jsd" only. Returns [...]."""
    if name == "fkl":
        return forward_kl(p, log_q, outside)
    if name == "rkl":
        return reverse_kl(p, log_q, outside)
    if name == "jsd":
        return jsd(p, log_q, outside, beta)
    if name == "tv":
        return total_variation(p, log_q, outside)
    raise ValueError(f"unknown divergence {name!r}: choose one of {', '.join(DIVERGENCES)}")


# The same divergences of a `Teacher` in either form: the sparse one (a top-k teacher) reads the student's log-probs
# at the teacher's k tokens only, and the total of q there (the mass q puts elsewhere enters where it counts).


def teacher_divergence(name: str, teacher: Teacher, log_q: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """`divergence(name, p, log_q, outside, beta)` of the teacher's p, in O(k) per position for a sparse teacher
    (O(N) for reverse KL, which needs q's entropy). log_q: [..., N]. Returns [...]."""
    if not teacher.sparse:
        return divergence(name, teacher.probs, log_q, teacher.outside, beta)
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}: choose one of {', '.join(DIVERGENCES)}")
    p, inside = teacher.probs.float(), teacher.inside  # [..., k]
    log_q_s = _finite(log_q.gather(-1, teacher.index))  # [..., k]
    q_s = torch.where(inside, log_q_s.exp(), torch.zeros_like(p))
    rest = (1.0 - q_s.sum(-1)).clamp(min=0.0)  # [...] student mass off the teacher's support
    if name == "fkl":
        mass = p.sum(-1, keepdim=True)
        p = torch.where(mass > 0, p / mass.clamp(min=torch.finfo(p.dtype).tiny), torch.zeros_like(p))
        return (torch.xlogy(p, p) - p * log_q_s.clamp(min=LOG_FLOOR)).sum(-1)
    if name == "rkl":
        full = _finite(log_q)
        log_p = torch.log(p).clamp(min=LOG_FLOOR)
        return (full.exp() * full).sum(-1) - (q_s * log_p).sum(-1) - rest * LOG_FLOOR
    if name == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd: beta must be strictly between 0 and 1, got {beta}")
        log_m = torch.logaddexp(math.log(beta) + torch.log(p), math.log(1.0 - beta) + log_q_s)  # [..., k]
        kl_pm = (torch.xlogy(p, p) - p * log_m).sum(-1) + teacher.outside.float() * math.log(1.0 / beta)
        kl_qm = (q_s * (log_q_s - log_m)).sum(-1) + rest * math.log(1.0 / (1.0 - beta))
        return beta * kl_pm + (1.0 - beta) * kl_qm
    return 0.5 * ((p - q_s).abs().sum(-1) + rest + teacher.outside.float())  # tv


def teacher_acceptance(teacher: Teacher, log_q: torch.Tensor) -> torch.Tensor:
    """`expected_acceptance` of the teacher's p and the student's q = exp(log_q) [..., N]: sum_x min(p(x), q(x)),
    over the teacher's support only when it is sparse. Returns [...]."""
    if not teacher.sparse:
        return expected_acceptance(teacher.probs.float(), log_q.exp())
    q_s = log_q.gather(-1, teacher.index).exp()
    return torch.where(teacher.inside, torch.minimum(teacher.probs.float(), q_s), torch.zeros_like(q_s)).sum(-1)


def argmax_draft_acceptance(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, temperature: torch.Tensor,
                            top_p: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """The probability that an engine drafting the drafter's most likely token (vLLM's EAGLE-3 and draft-model
    proposers) has `draft_ids` [P] (target ids) accepted, from the target's logged top-k [P, k] (temperature 1): a
    greedy request (temperature 0) accepts it when it is the target's most likely token (1 or 0); a sampled one with
    the probability the request's sampling gives it: the top-k log-probs at `temperature` [P], renormalised over the
    top-k, then cut to the smallest set of most likely tokens whose mass reaches `top_p` [P] (vLLM's rejection sampler
    verifies against the target's distribution after temperature and top-p; the tail beyond the top-k, not logged,
    is taken as 0). Returns [P] in [0, 1]."""
    lp = topk_logprobs.float()
    greedy = temperature <= 0
    best = topk_ids.gather(-1, lp.argmax(-1, keepdim=True)).squeeze(-1)  # [P]
    p = torch.softmax(lp / torch.where(greedy, torch.ones_like(temperature), temperature.float())[:, None], -1)  # [P, k]
    sorted_p, order = p.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
    kept = torch.zeros_like(p).scatter(-1, order, (before < top_p.float()[:, None]).float())  # the nucleus
    p = p * kept
    p = p / p.sum(-1, keepdim=True)
    sampled = (p * (topk_ids == draft_ids[:, None])).sum(-1)
    return torch.where(greedy, (best == draft_ids).float(), sampled)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of values [...] over positions where mask [...] (bool) is True; 0 when none is. Returns a scalar.

    Masked-out values never reach the result, even NaN or inf ones (their inputs should still be finite, or
    their gradients may not be).
    """
    if mask is None:
        return values.mean() if values.numel() else values.sum()
    mask = mask.bool()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# The reward term (DVI: the verifier's accept / reject decisions as a reward for the drafter).


def draft_log_prob(log_q: torch.Tensor, drafted_ids: torch.Tensor, vocab_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log q(d) of each draft, clamped at LOG_FLOOR. log_q: [..., N]; drafted_ids: [...] target ids (any value
    where there is no draft). Returns log q(d) [...] and inside [...] bool (the student can produce d)."""
    idx, inside = student_index(drafted_ids, vocab_map, log_q.shape[-1])
    return log_q.gather(-1, idx.unsqueeze(-1)).squeeze(-1).clamp(min=LOG_FLOOR), inside


def partial_lr(lr: float, positions: int, batch_tokens: int) -> float:
    """The learning rate of a step on a batch of `positions` teacher positions, where a full one holds `batch_tokens`:
    `lr` times the share of a full batch it holds (at most `lr`). AdamW moves every weight by about lr whatever the
    batch, so without it many small steps on a few records each walk a trained drafter away from what it knew."""
    return lr * min(1.0, positions / batch_tokens)


def kl_reward_weights(step: int, warmup: int, total: int, max_reward: float = 0.5) -> tuple[float, float]:
    """The KL-to-reward schedule: (w_kl, w_reward) at a training step, w_kl + w_reward = 1.

    Pure KL (1, 0) up to `warmup`; the reward's weight then grows linearly to `max_reward` at step `total`
    and stays there (total <= warmup: it jumps to max_reward at warmup).
    """
    if not 0.0 <= max_reward <= 1.0:
        raise ValueError(f"kl_reward_weights: max_reward must be in [0, 1], got {max_reward}")
    if warmup < 0:
        raise ValueError(f"kl_reward_weights: warmup must be >= 0, got {warmup}")
    if step < warmup:
        return 1.0, 0.0
    frac = 1.0 if total <= warmup else min(1.0, (step - warmup) / (total - warmup))
    w_reward = max_reward * frac
    return 1.0 - w_reward, w_reward


# ----------------------------------------------------------------------------------------------
# The combined objective.


def weighted_mean(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum(weight * values) / sum(weight) over positions with weight > 0 (others never reach the result, even
    NaN ones); 0 when no weight is positive. values, weight: [...]. Returns a scalar."""
    on = weight > 0
    total = torch.where(on, values * weight, torch.zeros_like(values)).sum()
    return total / torch.where(on, weight, torch.zeros_like(weight)).sum().clamp(min=torch.finfo(values.dtype).tiny)


def position_loss(
    student_logits: torch.Tensor,
    teacher: Teacher,
    drafted_ids: torch.Tensor,
    reward: torch.Tensor,
    judged: torch.Tensor,
    weight: torch.Tensor | None = None,
    divergence_name: str = "fkl",
    w_kl: float = 1.0,
    w_reward: float = 0.0,
    beta: float = 0.5,
    vocab_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective over a flat list of P teacher positions (e.g. every generated token of packed records).

    student_logits: [P, N]; teacher: a `Teacher` at the P positions (dense or sparse); drafted_ids: [P] the draft proposed at
    each position (target ids, -1 for none); reward: [P] float (+1 accepted, -penalty rejected; 0 where not
    judged); judged: [P] bool positions whose draft was accepted or rejected; weight: [P] float
    per-position weight of the divergence term (None: 1; 0 excludes a position).
    loss = w_kl * weighted mean divergence + w_reward * mean over judged positions of -(reward * log q(draft)),
    drafts the student cannot produce excluded. Returns the loss (scalar, with grad) and metrics computed
    without grad over the weighted positions, as floats: fkl, rkl, jsd, tv (each divergence), acceptance
    (expected acceptance, = 1 - tv), reward_loss, outside (teacher mass the student cannot produce).
    """
    weight = torch.ones(student_logits.shape[0], device=student_logits.device) if weight is None else weight.float()
    log_q = student_log_probs(student_logits)  # [P, N]
    kl = weighted_mean(teacher_divergence(divergence_name, teacher, log_q, beta), weight)
    log_q_d, inside = draft_log_prob(log_q, drafted_ids, vocab_map)  # [P]
    rl = masked_mean(-(reward.float() * log_q_d), judged.bool() & inside)
    loss = w_kl * kl + w_reward * rl
    with torch.no_grad():
        lq = log_q.detach()
        values = {name: weighted_mean(teacher_divergence(name, teacher, lq, beta), weight) for name in DIVERGENCES}
        values["acceptance"] = weighted_mean(teacher_acceptance(teacher, lq), weight)
        values["reward_loss"] = rl.detach()
        values["outside"] = weighted_mean(teacher.outside.float(), weight)
        floats = torch.stack(list(values.values())).tolist()  # one host sync
    return loss, dict(zip(values, floats))
