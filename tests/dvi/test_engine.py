"""dvi.engine on tiny random-weight Llamas: exactness, batching, KV rollback, sampling, adaptive K, errors.

References are plain: the target's own `generate` (greedy), a fresh full forward of the target on the
sequence so far (cache contents), and the target's warped next-token distribution (sampling).
"""

from __future__ import annotations

import threading

import pytest
import torch

from dvi.config import SpecConfig, load_config
from dvi.engine import SpeculativeEngine
from dvi.kv import BatchKV
from dvi.engine_api import Request
from dvi.errors import DviError
from dvi.models import Drafter, end_ids
from stat_checks import chi_square_pvalue, first_two_token_probs

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    [5],
    [1, 2, 3, 4, 5],
    list(range(10, 27)),
    [(7 * i + 3) % 97 for i in range(40)],
]
NEW = 40  # tokens generated per request in the greedy tests

_greedy_cache: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def target_greedy(target, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation (Hugging Face generate, no drafter)."""
    key = (id(target), tuple(prompt), n)
    if key not in _greedy_cache:
        ids = torch.tensor([prompt], device=target.device)
        with torch.inference_mode():
            out = target.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        _greedy_cache[key] = out[0, len(prompt) :].tolist()
    return _greedy_cache[key]


def fixed(k: int, **kw) -> SpecConfig:
    return SpecConfig(k=k, adaptive=False, **kw)


def assert_cache_matches_fresh_forward(target, results, atol: float = 1e-4) -> int:
    """Every round's top-k target log-probs (from the engine's cached forward) equal a fresh full forward.

    At drafted position j of a round the context is prompt + generated-so-far + drafted[:j], rejected drafts
    included: any stale or missing slot in the rolled-back cache shows up as a different distribution.
    Returns the number of positions checked.
    """
    checked = 0
    for res in results:
        for r in res.rounds:
            assert r.topk_logprobs is not None and r.topk_logprobs.shape[0] == r.k + 1
            base = res.prompt_ids + res.token_ids[: r.position]
            contexts = [base + r.drafted[:j] for j in range(r.k + 1)]
            for j, ctx in enumerate(contexts):
                with torch.inference_mode():
                    fresh = torch.log_softmax(target(torch.tensor([ctx], device=target.device)).logits[0, -1].float(), -1).cpu()
                got_ids, got_lp = r.topk_ids[j], r.topk_logprobs[j]
                assert torch.allclose(fresh[got_ids], got_lp, atol=atol), (res.request_id, r.position, j)
                assert torch.allclose(fresh.topk(got_ids.numel()).values, got_lp, atol=atol)
                checked += 1
    return checked


def assert_drafts_are_drafter_greedy(drafter: Drafter, results) -> int:
    """Greedy drafts equal the drafter's argmax on a fresh forward of the context: its rolled-back cache is right.

    Returns the number of drafts checked.
    """
    checked = 0
    for res in results:
        for r in res.rounds:
            base = res.prompt_ids + res.token_ids[: r.position]
            for j, d in enumerate(r.drafted):
                with torch.inference_mode():
                    choice = int(drafter.model(torch.tensor([base + r.drafted[:j]], device=drafter.model.device)).logits[0, -1].argmax())
                if drafter.vocab_map is not None:
                    choice = int(drafter.vocab_map[choice])
                assert d == choice, (res.request_id, r.position, j)
                checked += 1
    return checked


# ----------------------------------------------------------------------------------------------
# Greedy: exactly the target's tokens.


@pytest.mark.parametrize("spec", [fixed(1), fixed(2), fixed(4), SpecConfig()], ids=["k1", "k2", "k4", "adaptive"])
def test_greedy_equals_target_greedy(tiny_target, tiny_drafter, spec):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, spec)
    results = engine.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS[:3]])
    results.append(engine.generate([Request(PROMPTS[3], max_new_tokens=NEW)])[0])
    for prompt, res in zip(PROMPTS, results):
        assert res.token_ids == target_greedy(tiny_target, prompt, NEW)
        assert res.finish_reason == "length" and res.prompt_ids == prompt
        assert sum(r.accepted + 1 for r in res.rounds) == NEW  # every round emits accepted + 1 tokens
    spec_rounds = [r for res in results for r in res.rounds if r.k]
    assert spec_rounds, "the drafter drafted"
    assert any(r.accepted == r.k for r in spec_rounds) and any(r.accepted < r.k for r in spec_rounds)


def test_greedy_without_drafter_equals_target_greedy(tiny_target):
    engine = SpeculativeEngine(tiny_target, None, fixed(4))
    results = engine.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS])
    for prompt, res in zip(PROMPTS, results):
        assert res.token_ids == target_greedy(tiny_target, prompt, NEW)
        assert all(r.k == 0 and r.drafter_version is None for r in res.rounds)
        assert len(res.rounds) == NEW and res.drafter_versions == []
        assert res.stats.mean_accepted_length == 1.0


def test_reduced_vocabulary_drafter_keeps_greedy_exact(tiny_target, reduced_drafter):
    engine = SpeculativeEngine(tiny_target, reduced_drafter, fixed(3))
    results = engine.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS])
    allowed = set(reduced_drafter.vocab_map.tolist())
    for prompt, res in zip(PROMPTS, results):
        assert res.token_ids == target_greedy(tiny_target, prompt, NEW)
        assert all(d in allowed for r in res.rounds for d in r.drafted)  # drafts are target ids from the head's map
    assert 0.1 < sum(r.stats.acceptance_rate for r in results) / len(results) < 0.95
    assert any(t not in allowed for res in results for t in res.token_ids)  # the target still emits any token
    assert assert_drafts_are_drafter_greedy(reduced_drafter, results) > 50


def test_drafter_equal_to_target_accepts_every_draft(tiny_target, self_drafter):
    k, new = 4, 23  # rounds emit 5 tokens: 4 full rounds, then a round truncated to 2 drafts by the budget
    engine = SpeculativeEngine(tiny_target, self_drafter, fixed(k))
    for prompt in PROMPTS:
        res = engine.generate([Request(prompt, max_new_tokens=new)])[0]
        assert res.token_ids == target_greedy(tiny_target, prompt, new)
        assert [r.k for r in res.rounds] == [4, 4, 4, 4, 2]
        assert all(r.accepted == r.k for r in res.rounds)
        assert [r.position for r in res.rounds] == [0, 5, 10, 15, 20]
        assert res.stats.acceptance_rate == 1.0
        assert res.stats.per_position_acceptance == [1.0] * k
        assert res.stats.mean_accepted_length == pytest.approx(new / 5)
        full = res.rounds[:-1]
        assert all(r.accepted + 1 == k + 1 for r in full)  # mean accepted length k + 1 except the last round
        assert res.drafter_versions == ["self"] and all(r.drafter_version == "self" for r in res.rounds)


# ----------------------------------------------------------------------------------------------
# Batching.


def test_batch_equals_one_at_a_time(tiny_target, tiny_drafter):
    spec = fixed(3)
    reqs = [Request(p, max_new_tokens=n) for p, n in zip(PROMPTS, [40, 17, 33, 8])]
    engine = SpeculativeEngine(tiny_target, tiny_drafter, spec)
    batched = engine.generate(reqs)
    alone = [engine.generate([r])[0] for r in reqs]
    for req, b, a in zip(reqs, batched, alone):
        assert b.request_id == req.request_id
        assert b.token_ids == a.token_ids == target_greedy(tiny_target, req.prompt_ids, req.max_new_tokens)
        assert len(b.token_ids) == req.max_new_tokens and b.finish_reason == "length"
        assert [(r.k, r.accepted) for r in b.rounds] == [(r.k, r.accepted) for r in a.rounds]
    # rows of one batch really accepted different numbers of drafts in the same round
    mixed = [
        i
        for i in range(min(len(r.rounds) for r in batched))
        if len({res.rounds[i].accepted for res in batched}) > 1
    ]
    assert len(mixed) >= 2
    # smaller max_batch: split into several batches, same outputs
    split = SpeculativeEngine(tiny_target, tiny_drafter, spec, max_batch=3).generate(reqs)
    assert [r.token_ids for r in split] == [r.token_ids for r in batched]


# ----------------------------------------------------------------------------------------------
# The KV caches: rollback, holes and compaction.


def test_kv_cache_after_rollback_equals_fresh_forward(tiny_target, tiny_drafter):
    """After mixed acceptance across a batch, the target's cached forward equals a fresh full forward."""
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(4))
    reqs = [Request(p, max_new_tokens=n) for p, n in zip(PROMPTS, [30, 30, 12, 30])]
    greedy = engine.generate(reqs)
    sampled = engine.generate([Request(p, max_new_tokens=30, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS[:2])])
    results = greedy + sampled
    assert any(r.accepted < r.k for res in results for r in res.rounds)
    assert assert_cache_matches_fresh_forward(tiny_target, results) > 100
    # the drafter's cache, rolled back to the accepted prefix each round, is right too
    assert assert_drafts_are_drafter_greedy(tiny_drafter, greedy) > 50


def _feed_and_check(model, kv: BatchKV, seqs: list[list[int]], extra: torch.Tensor) -> torch.Tensor:
    t = extra.shape[1]
    logits = kv.forward(model, extra, keep=t + 1)  # [B, T + 1, V]
    for b, seq in enumerate(seqs):
        full = seq + extra[b].tolist()
        with torch.inference_mode():
            fresh = model(torch.tensor([full])).logits[0, -(t + 1) :]
        assert torch.allclose(logits[b], fresh, atol=1e-4), f"row {b}"
    return logits


@pytest.mark.parametrize("slack", [64, 0, 3])
def test_kv_holes_select_and_compact_match_fresh_forward(tiny_target, slack):
    """Drive `BatchKV` like the engine does, with random accept lengths, row removal and compaction."""
    gen = torch.Generator().manual_seed(slack)
    prompts = [PROMPTS[1], PROMPTS[2], [9, 9], PROMPTS[0]]
    kv = BatchKV(prompts)
    seqs = [list(p) for p in prompts]
    squeezed = 0
    with torch.inference_mode():
        for step in range(14):
            t = int(torch.randint(0, 5, (1,), generator=gen))
            extra = torch.randint(0, 97, (len(seqs), t), generator=gen)
            _feed_and_check(tiny_target, kv, seqs, extra)
            n = torch.randint(0, t + 1, (len(seqs),), generator=gen)
            kv.keep_last(torch.arange(1, t + 1).unsqueeze(0) <= n.unsqueeze(1))
            for b in range(len(seqs)):
                seqs[b] += extra[b, : int(n[b])].tolist()
                pending = torch.randint(0, 97, (1 + int(n[b]) % 2,), generator=gen).tolist()  # 1 or 2 tokens
                kv.pending[b] = pending
                seqs[b] += pending
            assert kv.length.tolist() == [len(s) - len(p) for s, p in zip(seqs, kv.pending)]
            if step == 6:  # a request finishes: drop row 1
                keep = torch.tensor([0, 2, 3])
                kv.select(keep)
                seqs = [seqs[i] for i in keep.tolist()]
            width = kv.valid.shape[1]
            kv.compact(slack=slack)
            squeezed += kv.valid.shape[1] < width
            assert kv.cache.get_seq_length() == kv.valid.shape[1]
            assert kv.valid.sum(1).tolist() == kv.length.tolist()
        _feed_and_check(tiny_target, kv, seqs, torch.zeros(len(seqs), 0, dtype=torch.long))
    if slack < 64:
        assert squeezed > 0


@pytest.mark.parametrize("emptied_by", ["compact", "keep_last"])
def test_kv_left_without_slots_takes_rows_joining_after(tiny_target, emptied_by):
    """A cache whose slots all go (the row left holds only pending tokens: it joined while nothing was drafted, and
    the rows that were fed left) starts afresh, so a row joining later is fed beside it: no layer keeps the batch
    size of the rows that left."""
    kv = BatchKV([PROMPTS[2], PROMPTS[1]])
    with torch.inference_mode():
        kv.forward(tiny_target, torch.tensor([[4, 4], [5, 5]]), keep=1)
        kv.add_rows([[7, 8, 9]])
        kv.select([2])  # the fed rows leave: every slot is a hole for the row left
        if emptied_by == "compact":
            kv.compact(slack=0)
        else:  # a round's drafts rolled back
            kv.keep_last(torch.zeros(1, kv.valid.shape[1], dtype=torch.bool))
        assert kv.valid.shape[1] == 0 and kv.cache.get_seq_length() == 0
        kv.add_rows([PROMPTS[0]])
        _feed_and_check(tiny_target, kv, [[7, 8, 9], PROMPTS[0]], torch.tensor([[3], [6]]))


@pytest.fixture
def compact_often(monkeypatch):
    """Make the engine squeeze holes out whenever there are any; count the compactions that happened."""
    original = BatchKV.compact
    count = {"squeezed": 0}

    def compact(self, slack=64):
        width = self.valid.shape[1]
        original(self, slack=1)
        count["squeezed"] += self.valid.shape[1] < width
        assert self.cache.get_seq_length() in (0, self.valid.shape[1])

    monkeypatch.setattr(BatchKV, "compact", compact)
    return count


def test_compaction_keeps_outputs_identical(tiny_target, tiny_drafter, compact_often):
    reqs = [Request(p, max_new_tokens=n) for p, n in zip(PROMPTS, [30, 25, 30, 10])]
    reqs += [Request(p, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7) for p in PROMPTS[:2]]
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3), max_batch=8)
    compacted = engine.generate(reqs)
    assert compact_often["squeezed"] > 5
    for req, res in zip(reqs[:4], compacted):
        assert res.token_ids == target_greedy(tiny_target, req.prompt_ids, req.max_new_tokens)
    assert assert_cache_matches_fresh_forward(tiny_target, compacted) > 50
    with pytest.MonkeyPatch.context() as mp:  # the same batch without compaction
        mp.setattr(BatchKV, "compact", lambda self, slack=64: None)
        plain = engine.generate(reqs)
    assert [r.token_ids for r in compacted] == [r.token_ids for r in plain]
    assert [[(x.k, x.accepted) for x in r.rounds] for r in compacted] == [[(x.k, x.accepted) for x in r.rounds] for r in plain]


# ----------------------------------------------------------------------------------------------
# Sampling.


def test_seeded_sampling_repeats_and_seeds_differ(tiny_target, tiny_drafter):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3))

    def run(seed, prompt=PROMPTS[1]):
        return engine.generate([Request(prompt, max_new_tokens=40, temperature=1.0, top_p=0.95, seed=seed)])[0]

    a, b, c = run(1), run(1), run(2)
    assert a.token_ids == b.token_ids
    assert [(r.k, r.drafted, r.accepted, r.token) for r in a.rounds] == [(r.k, r.drafted, r.accepted, r.token) for r in b.rounds]
    assert a.token_ids != c.token_ids
    assert a.token_ids != target_greedy(tiny_target, PROMPTS[1], 40)  # it really sampled
    for res in (a, c):
        assert len(res.token_ids) == 40 and all(0 <= t < 97 for t in res.token_ids)
    # unseeded requests draw fresh entropy
    x = engine.generate([Request(PROMPTS[1], max_new_tokens=40, temperature=1.0)])[0]
    y = engine.generate([Request(PROMPTS[1], max_new_tokens=40, temperature=1.0)])[0]
    assert x.token_ids != y.token_ids


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_target, tiny_drafter):
    """A seeded request samples the same tokens alone or next to others that draft more or fewer tokens."""
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3))
    differ = 0
    for s in range(6):
        reqs = [
            Request(PROMPTS[s % 4], max_new_tokens=n, temperature=1.0, top_p=0.95, seed=100 * s + i)
            for i, n in enumerate([30, 10 + s, 21, 7])
        ]
        batched = engine.generate(reqs)
        for req, res in zip(reqs, batched):
            alone = engine.generate([req])[0]
            assert res.token_ids == alone.token_ids, (s, req.max_new_tokens)
            assert [(r.k, r.accepted) for r in res.rounds] == [(r.k, r.accepted) for r in alone.rounds]
        # rows are truncated by their budgets at different rounds: in some round, K differs across the batch
        longest = max(len(res.rounds) for res in batched)
        differ += any(len({res.rounds[i].k for res in batched if len(res.rounds) > i}) > 1 for i in range(longest))
    assert differ >= 4


def test_stop_token_ends_request(tiny_target, tiny_drafter):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3))
    req = Request(PROMPTS[2], max_new_tokens=40, temperature=1.0, seed=3)
    free = engine.generate([req])[0].token_ids
    stop = free[12]
    cut = free[: free.index(stop) + 1]
    stopping = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3), stop_ids={stop})
    res, other = stopping.generate([req, Request(PROMPTS[1], max_new_tokens=40)])
    assert res.token_ids == cut and res.token_ids[-1] == stop
    assert res.finish_reason == "stop"
    # the other request of the batch carries on (or stops at its own first stop token)
    greedy = target_greedy(tiny_target, PROMPTS[1], 40)
    want = greedy[: greedy.index(stop) + 1] if stop in greedy else greedy
    assert other.token_ids == want
    assert other.finish_reason == ("stop" if stop in greedy else "length")


def test_ignore_eos_runs_to_the_budget_through_stop_tokens(tiny_target, tiny_drafter):
    greedy = target_greedy(tiny_target, PROMPTS[1], 30)
    stop = greedy[5]
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3), stop_ids={stop})
    res = engine.generate([Request(PROMPTS[1], max_new_tokens=30, ignore_eos=True)])[0]
    assert res.token_ids == greedy and res.finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_keeps_stop_ids_out_of_the_first_tokens_exactly(tiny_target, tiny_drafter, temperature):
    """Before min_tokens the stop ids have probability 0 under the target; the output is what the target with
    those ids banned decodes (greedy: Hugging Face's own min_new_tokens processor), and no drafted stop id is
    accepted there."""
    free = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3)).generate([Request(PROMPTS[2], max_new_tokens=30, temperature=temperature, seed=5)])[0]
    stops = set(free.token_ids[:6])  # ids the free run emits early
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3), stop_ids=stops)
    res = engine.generate([Request(PROMPTS[2], max_new_tokens=30, temperature=temperature, seed=5, min_tokens=12)])[0]
    assert len(res.token_ids) >= 12 and not stops & set(res.token_ids[:12])
    if res.finish_reason == "stop":
        assert res.token_ids[-1] in stops and not stops & set(res.token_ids[12:-1])
    if temperature == 0:
        ids = torch.tensor([PROMPTS[2]])
        with torch.inference_mode():
            want = tiny_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=12,
                                        eos_token_id=sorted(stops), do_sample=False, pad_token_id=0)[0, len(PROMPTS[2]) :].tolist()
        assert res.token_ids == want


def test_min_tokens_out_of_range_is_refused(tiny_target):
    with pytest.raises(DviError, match="min_tokens"):
        SpeculativeEngine(tiny_target, None, fixed(2)).generate([Request(PROMPTS[0], max_new_tokens=4, min_tokens=5)])


def test_cancelled_row_leaves_at_the_next_round_and_the_others_carry_on(tiny_target, tiny_drafter):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(2))
    batch = engine.decoding()
    batch.add(Request(PROMPTS[1], max_new_tokens=30), key="a")
    batch.add(Request(PROMPTS[2], max_new_tokens=30), key="b")
    assert batch.step() == [] and batch.step() == []
    assert batch.cancel("a", "abort") and not batch.cancel("nobody")
    finished = batch.step()
    assert [k for k, _ in finished] == ["a"] and batch.size == 1
    gone = finished[0][1]
    assert gone.finish_reason == "abort" and 2 <= len(gone.token_ids) <= 6  # two rounds of at most K + 1 tokens
    assert gone.token_ids == target_greedy(tiny_target, PROMPTS[1], 30)[: len(gone.token_ids)]
    rest = []
    while batch.size:
        rest += batch.step()
    assert rest[0][0] == "b" and rest[0][1].token_ids == target_greedy(tiny_target, PROMPTS[2], 30)  # unaffected


@pytest.mark.parametrize("max_new", [1, 2, 5, 17])
def test_max_new_tokens_gives_exactly_that_many(tiny_target, tiny_drafter, self_drafter, max_new):
    for drafter in (tiny_drafter, self_drafter):
        engine = SpeculativeEngine(tiny_target, drafter, fixed(4))
        for temperature in (0.0, 1.0):
            res = engine.generate([Request(PROMPTS[1], max_new_tokens=max_new, temperature=temperature, seed=0)])[0]
            assert len(res.token_ids) == max_new and res.finish_reason == "length"
            assert all(r.k <= max_new - r.position - 1 for r in res.rounds)  # never drafts past the budget


def test_context_window_limits_generation(tiny_target, make_tiny_llama):
    small = make_tiny_llama(seed=0, layers=3, window=16)
    small.load_state_dict(tiny_target.state_dict())
    engine = SpeculativeEngine(small, Drafter(small, "self"), fixed(4))
    res = engine.generate([Request(list(range(1, 13)), max_new_tokens=40)])[0]
    assert len(res.token_ids) == 4 and res.finish_reason == "length"  # 12 + 4 = the window of 16
    assert res.token_ids == target_greedy(tiny_target, list(range(1, 13)), 4)
    res = engine.generate([Request(list(range(1, 16)), max_new_tokens=40)])[0]
    assert len(res.token_ids) == 1


@pytest.mark.parametrize("drafter_name", ["tiny_drafter", "random_drafter", "reduced_drafter"])
def test_sampled_tokens_follow_target_distribution(tiny_target, drafter_name, request):
    """Through the whole engine (drafter q, target p, warping, uniforms), emitted tokens follow the target.

    Thousands of seeded copies of one prompt in one batch; the first and second generated tokens are
    compared with the target's warped distributions by a chi-square test (bins with expected count < 5 pooled).
    """
    drafter = request.getfixturevalue(drafter_name)
    prompt, temperature, top_p, rows = PROMPTS[1], 1.3, 0.9, 3000
    engine = SpeculativeEngine(tiny_target, drafter, fixed(2, topk_logprobs=0), max_batch=rows)
    reqs = [Request(prompt, max_new_tokens=2, temperature=temperature, top_p=top_p, seed=s) for s in range(rows)]
    results = engine.generate(reqs)
    first = torch.tensor([r.token_ids[0] for r in results])
    second = torch.tensor([r.token_ids[1] for r in results])
    assert all(r.rounds[0].k == 1 for r in results)  # budget 2: one draft, then the bonus / recovered token
    accepted = sum(r.rounds[0].accepted for r in results)
    assert 0 < accepted < rows or drafter_name == "random_drafter"

    p1, p_second = first_two_token_probs(tiny_target, prompt, temperature, top_p)
    for tokens, probs, what in ((first, p1, "first"), (second, p_second, "second")):
        counts = torch.bincount(tokens, minlength=97).double()
        assert bool((counts[probs == 0] == 0).all()), f"{what}: tokens outside the top-p set were emitted"
        pval = chi_square_pvalue(counts, probs)
        assert pval > 1e-4, f"{what} token: chi-square p-value {pval:.2e}"


# ----------------------------------------------------------------------------------------------
# Adaptive K.


def adaptive(**kw) -> SpecConfig:
    return SpecConfig(k=2, adaptive=True, k_min=1, k_max=6, probe_every=8, cost_ratio=0.25, **kw)


def test_adaptive_k_stays_in_bounds(tiny_target, tiny_drafter, random_drafter, self_drafter):
    spec = adaptive()
    for drafter in (tiny_drafter, random_drafter, self_drafter):
        engine = SpeculativeEngine(tiny_target, drafter, spec)
        for res in engine.generate([Request(p, max_new_tokens=60) for p in PROMPTS]):
            for r in res.rounds:
                truncated = r.k == 60 - r.position - 1
                assert r.k == 0 or spec.k_min <= r.k <= spec.k_max or truncated, (r.position, r.k)
            assert res.token_ids == target_greedy(tiny_target, res.prompt_ids, 60)


def test_adaptive_starts_at_configured_k(tiny_target, tiny_drafter):
    for k in (1, 3, 5):
        engine = SpeculativeEngine(tiny_target, tiny_drafter, SpecConfig(k=k, adaptive=True, k_min=1, k_max=6, cost_ratio=0.25))
        res = engine.generate([Request(PROMPTS[1], max_new_tokens=20)])[0]
        assert res.rounds[0].k == k


def test_adaptive_switches_off_a_useless_drafter_and_probes(tiny_target, random_drafter):
    spec = adaptive()
    engine = SpeculativeEngine(tiny_target, random_drafter, spec)
    res = engine.generate([Request(PROMPTS[1], max_new_tokens=100)])[0]
    ks = [r.k for r in res.rounds]
    assert res.stats.acceptance_rate < 0.1
    off = ks.index(0)  # speculation switched off early ...
    assert off <= 4
    assert ks.count(0) > 0.8 * len(ks)  # ... and stays mostly off
    probes = [r for r in res.rounds[off:] if r.k]
    assert len(probes) >= 8  # ... but probes again
    assert all(r.k == spec.k_min for r in probes)
    gaps = [b.position - a.position for a, b in zip(probes, probes[1:])]
    assert all(g == spec.probe_every for g in gaps), gaps
    assert probes[0].position - res.rounds[off].position == spec.probe_every
    assert res.token_ids == target_greedy(tiny_target, PROMPTS[1], 100)


def test_adaptive_k_grows_to_k_max_for_a_perfect_drafter(tiny_target, self_drafter):
    spec = adaptive()
    res = SpeculativeEngine(tiny_target, self_drafter, spec).generate([Request(PROMPTS[2], max_new_tokens=100)])[0]
    ks = [r.k for r in res.rounds]
    # after the configured start, K never shrinks while every draft is accepted (the last round is truncated)
    assert ks[0] == spec.k and ks[1:-1] == sorted(ks[1:-1])
    assert max(ks) == spec.k_max and ks[-2] == spec.k_max
    assert res.stats.acceptance_rate == 1.0


def test_adaptive_with_measured_costs_is_still_exact(tiny_target, tiny_drafter):
    spec = SpecConfig(cost_ratio=None)  # K follows the measured drafter / target step times
    engine = SpeculativeEngine(tiny_target, tiny_drafter, spec)
    results = engine.generate([Request(p, max_new_tokens=30) for p in PROMPTS])
    assert engine.costs.draft_step is not None and engine.costs.target_step is not None and engine.costs.ratio > 0
    for res in results:
        assert res.token_ids == target_greedy(tiny_target, res.prompt_ids, 30)


# ----------------------------------------------------------------------------------------------
# Errors a user can act on.


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompt_ids=[]), "empty prompt"),
        (dict(prompt_ids=[1, 97]), r"\[0, 97\)"),
        (dict(prompt_ids=[-1, 3]), r"\[0, 97\)"),
        (dict(prompt_ids=[1], temperature=-0.5), "temperature"),
        (dict(prompt_ids=[1], temperature=float("nan")), "temperature"),
        (dict(prompt_ids=[1], top_p=0.0), "top_p"),
        (dict(prompt_ids=[1], top_p=1.5), "top_p"),
        (dict(prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_bad_requests_raise_dvi_error(tiny_target, tiny_drafter, kwargs, match):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(2))
    good = Request([1, 2, 3], max_new_tokens=3)
    with pytest.raises(DviError, match=match):
        engine.generate([good, Request(**kwargs)])  # a bad request in a batch fails before any decoding


def test_prompt_longer_than_window_raises(make_tiny_llama):
    small = make_tiny_llama(seed=0, layers=1, window=16)
    engine = SpeculativeEngine(small, None, fixed(2))
    with pytest.raises(DviError, match="context window of 16"):
        engine.generate([Request(list(range(20)), max_new_tokens=2)])
    with pytest.raises(DviError, match="context window"):
        engine.generate([Request(list(range(16)), max_new_tokens=2)])  # no room for even one token


def test_drafter_with_other_vocabulary_raises(tiny_target, tiny_drafter, make_tiny_llama):
    other = Drafter(make_tiny_llama(seed=5, layers=1, vocab=50), "small-vocab")
    with pytest.raises(DviError, match="vocabulary size 50.*97"):
        SpeculativeEngine(tiny_target, other, fixed(2))
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(2))
    with pytest.raises(DviError, match="small-vocab"):
        engine.swap_drafter(other)
    assert engine.drafter is tiny_drafter  # a refused swap leaves the old drafter in place


def test_bad_spec_config_raises():
    with pytest.raises(DviError, match="serve.spec.k"):
        SpecConfig(k=0)
    with pytest.raises(DviError, match="serve.spec.k"):
        load_config(["serve.spec.k=0"])
    with pytest.raises(DviError):
        SpecConfig(k_min=3, k_max=2)


# ----------------------------------------------------------------------------------------------
# Hot-swapping the drafter between rounds.


def test_swap_drafter_from_another_thread_mid_generation(tiny_target, tiny_drafter, self_drafter):
    """A swap lands between rounds; the request re-feeds its sequence to the new drafter's fresh cache."""
    first = Drafter(tiny_drafter.model, "v1")
    second = Drafter(self_drafter.model, "v2")
    engine = SpeculativeEngine(tiny_target, first, fixed(3))
    calls = {"n": 0}
    swapped = threading.Event()

    def swapper():
        engine.swap_drafter(second)
        swapped.set()

    def hook(module, args, kwargs):  # runs inside the first drafter's forward, on the decoding thread
        calls["n"] += 1
        if calls["n"] == 12:
            threading.Thread(target=swapper).start()
            assert swapped.wait(10), "swap did not happen"

    handle = first.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        reqs = [Request(p, max_new_tokens=NEW) for p in PROMPTS[1:3]]
        results = engine.generate(reqs)
    finally:
        handle.remove()
    assert engine.drafter is second
    for req, res in zip(reqs, results):
        assert res.token_ids == target_greedy(tiny_target, req.prompt_ids, NEW)
        assert res.drafter_versions == ["v1", "v2"]
        versions = [r.drafter_version for r in res.rounds if r.k]
        switch = versions.index("v2")
        assert set(versions[:switch]) == {"v1"} and set(versions[switch:]) == {"v2"}
        assert all(r.accepted == r.k for r in res.rounds if r.drafter_version == "v2")  # v2 is the target itself


def test_swap_drafter_repeatedly_while_generating(tiny_target, tiny_drafter, self_drafter):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(2))
    stop = threading.Event()
    order = [None, self_drafter, tiny_drafter]

    def churn():
        i = 0
        while not stop.is_set():
            engine.swap_drafter(order[i % 3])
            i += 1
            stop.wait(0.002)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        results = engine.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS])
    finally:
        stop.set()
        thread.join()
    for prompt, res in zip(PROMPTS, results):
        assert res.token_ids == target_greedy(tiny_target, prompt, NEW)
        used = {r.drafter_version for r in res.rounds if r.k}
        assert set(res.drafter_versions) == used and used <= {"self", "noisy-v1"}


def test_abort_stops_a_generation_in_progress_at_a_round_boundary(tiny_target, tiny_drafter):
    """Shutdown: abort() from another thread makes the running generate raise DviError between two rounds."""
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3))
    rounds = {"n": 0}

    def on_tokens(i, ids):  # called on the decoding thread after every round
        rounds["n"] += 1
        if rounds["n"] == 5:
            engine.abort()

    with pytest.raises(DviError, match="aborted"):
        engine.generate([Request(PROMPTS[0], max_new_tokens=400)], on_tokens=on_tokens)
    assert rounds["n"] == 5  # not a round more


# ----------------------------------------------------------------------------------------------
# The measured cost table and continuous batching.


def test_cost_table_plans_in_target_steps_and_borrows_across_buckets():
    from dvi.planner import CostTable

    table = CostTable(SpecConfig(k=2, k_max=3))
    assert not table.measured and table.plan(1) == (0.25, pytest.approx([1.0, 1.12, 1.24, 1.36]))  # the prior until measured
    for k, t in enumerate([0.050, 0.120, 0.100, 0.090]):  # non-monotone, as on this CPU
        table.observe_verify(1, k, t)
    table.observe_draft(1, 4, 0.048)  # 4 drafter steps in 48 ms
    c, v = table.plan(1)
    assert c == pytest.approx(0.24) and v == pytest.approx([1.0, 2.4, 2.0, 1.8])
    table.observe_verify(8, 0, 0.200)  # batch 5..8: only the plain step measured; K costs borrowed in steps
    assert table.plan(6)[1] == pytest.approx([1.0, 2.4, 2.0, 1.8]) and table.plan(6)[0] == pytest.approx(0.24)
    table.observe_verify(1, 1, 0.070)  # a live round refreshes the cost: the median of the last samples ...
    assert table.plan(1)[1][1] == pytest.approx((0.120 + 0.070) / 2 / 0.050)
    for _ in range(3):
        table.observe_verify(1, 1, 0.070)
    table.observe_verify(1, 1, 0.170)  # ... which one slow sample among steady ones does not move
    assert table.plan(1)[1][1] == pytest.approx(0.070 / 0.050)
    fixed_costs = CostTable(SpecConfig(k=2, k_max=3, cost_ratio=0.1, verify_slope=0.5))
    fixed_costs.observe_verify(1, 0, 0.05)
    assert fixed_costs.plan(1) == (0.1, pytest.approx([1.0, 1.5, 2.0, 2.5]))  # cost_ratio set: the fixed model, nothing measured


def test_controller_never_plans_a_round_its_table_predicts_slower_than_plain():
    from dvi.planner import KController

    spec = SpecConfig(k=4, k_min=1, k_max=4, probe_every=8)
    slow = [1.0, 2.4, 2.0, 1.9, 1.5]  # c = 0.24: no K pays at the prior acceptance 0.5
    ctrl = KController(spec)
    ks = []
    for generated in range(40):
        k = ctrl.next_k(generated, 0.24, slow, measured=True)
        ks.append(k)
        ctrl.observe(k, 0)
    probes = [g for g, k in enumerate(ks) if k]
    assert ks[0] == spec.k  # the first round (the prefill) drafts k, then the table's plan: plain decoding
    assert probes == [0, 9, 17, 25, 33]  # only the probes draft ...
    assert all(ks[g] == 4 for g in probes[1:])  # ... the cheapest round by the table (4 * 0.24 + 1.5 < 0.24 + 2.4), not k_min
    fast = [1.0, 1.05, 1.1, 1.15, 1.2]
    good = KController(spec)
    for generated in range(10):
        k = good.next_k(generated, 0.05, fast, measured=True)
        good.observe(k, k)
    assert k == 4


def test_warm_up_fills_the_table_and_adaptive_stays_exact(tiny_target, tiny_drafter):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, SpecConfig(k_max=6))
    table = engine.warm_up(reps=2)
    assert set(table["verify_s"]) == {f"b1/k{k}" for k in range(7)} and set(table["draft_step_s"]) == {"b1"}
    assert engine.costs.measured and all(t > 0 for t in engine.costs.verify.values())
    results = engine.generate([Request(p, max_new_tokens=30) for p in PROMPTS])
    for res in results:
        assert res.token_ids == target_greedy(tiny_target, res.prompt_ids, 30)
    assert any(b == 4 for b, _ in engine.costs.verify)  # the batch of 4 was measured live
    # a request alone: each of its steady rounds is timed against target-only decoding at batch 1 (the warm-up's plain
    # step), its first (the prompt's prefill) is not
    alone = engine.generate([Request(PROMPTS[3], max_new_tokens=30)])[0]
    steady = sum(r.accepted + 1 for r in alone.rounds[1:])
    assert alone.timed_tokens == steady and 0 < steady < len(alone.token_ids)
    assert alone.target_only_tokens > 0 and alone.vs_target_only == alone.timed_tokens / alone.target_only_tokens


def test_a_request_joins_a_running_batch_and_leaves_it_when_done(tiny_target, tiny_drafter):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3))
    batch = engine.decoding()
    batch.add(Request(PROMPTS[2], max_new_tokens=NEW), key="long")
    done: dict[str, tuple[int, object]] = {}
    rounds = 0
    while batch.size:
        if rounds == 3:  # mid-way through the long one
            batch.add(Request(PROMPTS[1], max_new_tokens=6), key="short")
            assert batch.size == 2
        for key, res in batch.step():
            done[key] = (rounds, res)
        rounds += 1
    assert done["short"][0] < done["long"][0]  # the short one finished first, and left the batch at once
    assert done["short"][1].token_ids == target_greedy(tiny_target, PROMPTS[1], 6)
    assert done["long"][1].token_ids == target_greedy(tiny_target, PROMPTS[2], NEW)
    assert_cache_matches_fresh_forward(tiny_target, [done["short"][1], done["long"][1]])


def test_generate_refills_free_slots_and_stays_exact(tiny_target, tiny_drafter):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(2), max_batch=2)
    reqs = [Request(p, max_new_tokens=n) for p, n in zip(PROMPTS, (40, 5, 12, 20))]
    results = engine.generate(reqs)
    for req, res in zip(reqs, results):
        assert res.request_id == req.request_id
        assert res.token_ids == target_greedy(tiny_target, req.prompt_ids, req.max_new_tokens)


def test_end_ids_are_the_tokenizers_and_every_one_of_the_generation_config(tiny_target):
    class Tok:
        eos_token_id = 7

    before = tiny_target.generation_config.eos_token_id
    try:
        tiny_target.generation_config.eos_token_id = [3, 9, 10**9]  # an id outside the vocabulary is no end id
        assert end_ids(tiny_target, Tok()) == {3, 7, 9}
        tiny_target.generation_config.eos_token_id = None
        assert end_ids(tiny_target, Tok()) == {7}
    finally:
        tiny_target.generation_config.eos_token_id = before


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_of_emitted_tokens_equal_a_fresh_forward(tiny_target, tiny_drafter, temperature):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, fixed(3))
    res = engine.generate([Request(PROMPTS[2], max_new_tokens=14, temperature=temperature, seed=1, logprobs=3)])[0]
    pairs = [lp for r in res.rounds for lp in r.logprobs][: len(res.token_ids)]
    assert len(pairs) == len(res.token_ids)
    for i, (token, (chosen, top)) in enumerate(zip(res.token_ids, pairs)):
        with torch.inference_mode():
            fresh = torch.log_softmax(tiny_target(torch.tensor([PROMPTS[2] + res.token_ids[:i]])).logits[0, -1].float(), -1)
        assert abs(fresh[token].item() - chosen) < 1e-4
        assert [t for t, _ in top] == fresh.topk(3).indices.tolist() and len(top) == 3
        if temperature == 0:
            assert top[0][0] == token
    plain = engine.generate([Request(PROMPTS[2], max_new_tokens=14, temperature=temperature, seed=1)])[0]
    assert plain.token_ids == res.token_ids and all(r.logprobs is None for r in plain.rounds)
