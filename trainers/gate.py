"""The gate's figures: how well a drafter (a candidate, or the one serving) would do on held-out records.

Per record, the sums over its teacher positions of the drafter's expected acceptance (sum min(p, q), a draft sampled
from it), its greedy match (its argmax is the target's) and its acceptance as the serving engine realizes it
(`realized_acceptance` under `gate_rule`: vLLM's proposers draft the argmax, dvi's engine samples), in `Figures`;
`evaluate_each` per record, `pooled` and `evaluate` over all; `judge` says whether a candidate beats the serving
drafter, over all held-out records or on one domain's (`by_domain`). The teacher is the records' top-k, or the trainer's copy
of the target (`teacher_for`). Records are batched by `batch_key` (`chunks`).

This module knows drafters as `trainers.students` modules and the batch layout; it does not know the trainer's loop,
what it publishes or where.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dvi.config import DviConfig
from dvi.errors import DviError
from dvi.hardware import pick_engine
from trainers.data import Batch, Example, batch_key, collate
from trainers.losses import Teacher, argmax_draft_acceptance, student_log_probs, teacher_acceptance, teacher_from_logits, teacher_from_topk
from trainers.students import PositionLM, autocast


class Figures(NamedTuple):
    """One held-out record's gate figures for one drafter: sums over its teacher positions, and their number."""

    acceptance: float  # expected acceptance of a draft sampled from the drafter: sum min(p, q)
    greedy: float  # the drafter's argmax is the target's
    positions: int
    realized: float = 0.0  # acceptance as the serving engine realizes it (`realized_acceptance`)


GATE_RULES = ("argmax", "sampled")


def gate_rule(cfg: DviConfig) -> str:
    """`trainer.gate_rule`: auto is the rule of the engine `serve.engine` picks here (dvi's samples its drafts; vLLM's
    proposers draft the argmax)."""
    if cfg.trainer.gate_rule != "auto":
        return cfg.trainer.gate_rule
    return "sampled" if pick_engine(cfg.serve.engine).value == "dvi" else "argmax"


def realized_acceptance(rule: str, batch: Batch, teacher: Teacher, log_q: torch.Tensor, best: torch.Tensor,
                        teacher_best: torch.Tensor) -> torch.Tensor:
    """Per teacher position [P], the acceptance of the drafter's draft as the engine realizes it: a greedy request's
    draft is accepted when it is the target's argmax (`best` == `teacher_best`, target ids), whichever the rule; a
    sampled request's with the probability `argmax_draft_acceptance` gives the drafter's argmax (rule argmax: vLLM) or
    sum min(p, q) (rule sampled: dvi's engine, drafts sampled from q)."""
    greedy = (best == teacher_best).float()
    if rule == "sampled":
        sampled = teacher_acceptance(teacher, log_q)
    elif batch.topk_ids is not None:
        sampled = argmax_draft_acceptance(batch.topk_ids, batch.topk_logprobs, batch.temperature, batch.top_p, best)
    else:  # a teacher from the target's logits: the draft's probability at temperature 1
        sampled = log_q.new_zeros(best.shape)
    temperature = batch.temperature if batch.temperature is not None else torch.zeros_like(greedy)
    return torch.where(temperature > 0, sampled, greedy)


def teacher_for(batch: Batch, vocab_size: int, vocab_map: torch.Tensor | None, teacher_lm: PositionLM | None) -> Teacher:
    """The batch's teacher: the logged top-k, or the full distribution of `teacher_lm` (the trainer's copy of
    the target)."""
    if batch.topk_ids is not None:
        return teacher_from_topk(batch.topk_ids, batch.topk_logprobs, vocab_size, vocab_map)
    if teacher_lm is None:
        raise DviError("records without teacher log-probs need the target: set trainer.teacher=auto or logits")
    with torch.no_grad():
        return teacher_from_logits(teacher_lm(batch.input_ids, batch.attention_mask, batch.rows, batch.cols), vocab_map)


def evaluate_each(student: PositionLM, examples: list[Example], vocab_size: int, vocab_map, teacher_lm: PositionLM | None,
                  batch_tokens: int, rule: str = "argmax", precision: str = "fp32") -> list[Figures]:
    """Per example, in their order: the sums over its teacher positions of `student`'s expected acceptance (sum over
    tokens of min(p, q)), greedy match (argmax q = argmax p) and acceptance as the engine realizes it under `rule`
    (`realized_acceptance`), and the number of positions; `teacher_lm` as in `teacher_for`; the forward in
    `precision` (`autocast`). An example's figures do not depend on the examples batched with it (up to float
    rounding), so they can be kept while its student is."""
    each: list[Figures | None] = [None] * len(examples)  # every index is filled: chunks cover every example
    device = next(student.parameters()).device
    with torch.no_grad():
        for at in chunk_indices(examples, batch_tokens):
            group = [examples[i] for i in at]
            batch = collate(group).to(device)
            teacher = teacher_for(batch, vocab_size, vocab_map, teacher_lm)
            with autocast(device, precision):
                logits = student(batch.input_ids, batch.attention_mask, batch.rows, batch.cols, features=batch.features)
            log_q = student_log_probs(logits)
            accepted = teacher_acceptance(teacher, log_q)  # [P]
            best = logits.argmax(-1) if vocab_map is None else vocab_map[logits.argmax(-1)]
            teacher_best = batch.topk_ids[:, 0] if batch.topk_ids is not None else (
                teacher.argmax() if vocab_map is None else vocab_map[teacher.argmax()])
            realized = realized_acceptance(rule, batch, teacher, log_q, best, teacher_best)
            per_row = torch.zeros(3, len(group), dtype=torch.float64, device=accepted.device)
            per_row[0].index_add_(0, batch.rows, accepted.double())
            per_row[1].index_add_(0, batch.rows, (best == teacher_best).double())
            per_row[2].index_add_(0, batch.rows, realized.double())
            for i, (acceptance, greedy, real) in zip(at, per_row.T.tolist(), strict=True):  # one host sync per batch
                each[i] = Figures(acceptance, greedy, examples[i].positions, real)
    return each


def pooled(figures) -> dict[str, float]:
    """Expected acceptance, greedy match rate and realized acceptance averaged over every teacher position of
    `figures` (`Figures`)."""
    figures = list(figures)
    positions = max(sum(f.positions for f in figures), 1)
    return {"acceptance": sum(f.acceptance for f in figures) / positions,
            "greedy": sum(f.greedy for f in figures) / positions,
            "realized": sum(f.realized for f in figures) / positions}


def group_by_domain(domains, items) -> dict[str, list]:
    """`items` grouped by their domain tags (`domains`, in the same order), each group in that order; an item without
    a tag (None or empty) is in no group."""
    groups: dict[str, list] = {}
    for domain, item in zip(domains, items, strict=True):
        if domain:
            groups.setdefault(domain, []).append(item)
    return groups


def by_domain(candidate: list[Figures], serving: list[Figures], domains: list[str | None]) -> dict[str, tuple[float, float, int]]:
    """Per domain tag of the held-out records (`domains`, in their order; untagged ones in none): the realized acceptance
    of the candidate and of the serving drafter pooled over that domain's records, and how many there are."""
    groups = group_by_domain(domains, range(len(domains)))
    return {d: (pooled(candidate[i] for i in at)["realized"], pooled(serving[i] for i in at)["realized"], len(at))
            for d, at in sorted(groups.items())}


class Verdict(NamedTuple):
    """What `judge` found: whether the candidate passes, the domain it passed on where it did not pass over all the
    held-out records (else None), and the figures per domain (`by_domain`)."""

    passes: bool
    domain: str | None
    domains: dict[str, tuple[float, float, int]]


def judge(candidate: list[Figures], serving: list[Figures], domains: list[str | None], min_gain: float, min_records: int,
          per_domain: bool = True) -> Verdict:
    """Whether a candidate beats the serving drafter on the held-out records (their figures in the same order, their
    domain tags in `domains`): by more than `min_gain` in realized acceptance pooled over all of them, or, with
    `per_domain`, by more than `min_gain` on the records of one domain that has at least `min_records` of them while
    pooled over all it is no lower. After traffic drifts to a new domain, most held-out records are the old domains'
    (the held-out set keeps the latest `trainer.holdout_size`), and what the candidate learnt of the new one is a small
    share of the pooled figure; judged on that domain's own records it shows. Where several domains gain, the largest
    gain names the verdict's domain."""
    cand, base = pooled(candidate)["realized"], pooled(serving)["realized"]
    groups = by_domain(candidate, serving, domains)
    if cand > base + min_gain:
        return Verdict(True, None, groups)
    if per_domain and cand >= base:
        wins = [(c - b, d) for d, (c, b, n) in groups.items() if n >= min_records and c > b + min_gain]
        if wins:
            return Verdict(True, max(wins)[1], groups)
    return Verdict(False, None, groups)


def evaluate(student: PositionLM, examples: list[Example], vocab_size: int, vocab_map, teacher_lm: PositionLM | None,
             batch_tokens: int, rule: str = "argmax", precision: str = "fp32") -> dict[str, float]:
    """Expected acceptance, greedy match rate and realized acceptance of `student` (a candidate or the baseline) on
    `examples`, averaged over their teacher positions (`evaluate_each`, pooled)."""
    return pooled(evaluate_each(student, examples, vocab_size, vocab_map, teacher_lm, batch_tokens, rule, precision))


def chunks(examples: list[Example], tokens: int):
    """Groups of examples with the same `batch_key` and at most about `tokens` positions each."""
    for at in chunk_indices(examples, tokens):
        yield [examples[i] for i in at]


def chunk_indices(examples: list[Example], tokens: int):
    """`chunks` as the indices of its examples in `examples`."""
    by_width: dict[tuple, list[int]] = {}
    for i, e in enumerate(examples):
        by_width.setdefault(batch_key(e), []).append(i)
    for group in by_width.values():
        chunk, used = [], 0
        for i in group:
            if chunk and used + examples[i].positions > tokens:
                yield chunk
                chunk, used = [], 0
            chunk.append(i)
            used += examples[i].positions
        if chunk:
            yield chunk


