"""`dvi drafter bootstrap`'s answers by vLLM's engine in the process (`dvi.cli.vllm.answers`): the demo target's greedy
answers, each cut after its stop token, with the top-8 log-probs the target's own `generate` gives (`trainers.bootstrap.
answer`; both in fp32), sampled answers that a seed repeats, and records made of them that read back."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dvi import corpus
from dvi.cli.vllm.answers import VllmAnswers
from dvi.config import VllmConfig
from dvi.models import end_ids, load_causal_lm, load_tokenizer
from dvi.records import from_dict
from trainers import bootstrap

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

NEW_TOKENS = 24


def test_vllm_answers_are_the_targets_own_tokens_and_log_probs(demo_target_dir):
    tokenizer, target = load_tokenizer(demo_target_dir, "target"), load_causal_lm(demo_target_dir, "target")
    text = "What is the capital of France?"  # answered in 8 tokens, the last one its stop token
    short = corpus.CorpusPrompt(corpus.prompt_id("qa", True, text), "qa", "test", "train", True, text)
    prompts = [short] + [p for p in corpus.bootstrap_prompts(40) if p.chat][:3]
    todo = bootstrap.jobs(prompts, tokenizer, 1, 448)
    stops = end_ids(target, tokenizer)
    reference = bootstrap.answer(target, todo, stops, NEW_TOKENS, 0, tokenizer.pad_token_id)
    engine = VllmAnswers(demo_target_dir, VllmConfig(cpu_kv_cache_gb=1, enforce_eager=True), "float32", len(todo),
                         512)
    try:
        greedy = engine(todo, stops, NEW_TOKENS, 0)
        sampled_jobs = [replace(j, sample=1) for j in todo]
        sampled, again = engine(sampled_jobs, stops, NEW_TOKENS, 7), engine(sampled_jobs, stops, NEW_TOKENS, 7)
    finally:
        engine.close()

    assert any(len(g) < NEW_TOKENS and g[-1] in stops for g, _, _ in reference)  # one answer stopped, its stop kept
    overlap = []
    for (want, want_ids, want_lps), (got, ids, lps) in zip(reference, greedy, strict=True):
        assert got == want and ids.shape == lps.shape == (len(got), bootstrap.TOPK)
        assert (ids[:, 0] == np.asarray(got)).all() and (ids[:, 0] == want_ids[:, 0]).all()
        np.testing.assert_allclose(lps[:, 0], want_lps[:, 0], atol=2e-3)
        assert (np.diff(lps, axis=1) <= 0).all()  # best first
        overlap += [len(set(a) & set(b)) / bootstrap.TOPK for a, b in zip(ids.tolist(), want_ids.tolist())]
    assert np.mean(overlap) > 0.95, np.mean(overlap)  # the same top 8, but where two near-equal ones trade places

    assert [g for g, _, _ in sampled] == [g for g, _, _ in again]  # a seed repeats a sampled answer
    assert [g for g, _, _ in sampled] != [g for g, _, _ in greedy]
    for job, (gen, ids, lps) in zip(sampled_jobs, sampled, strict=True):
        for r in bootstrap.target_records(job, gen, ids, lps, demo_target_dir.name, int(target.config.vocab_size), 7):
            assert from_dict(json.loads(json.dumps(r.to_dict())), int(target.config.vocab_size)).to_dict() == r.to_dict()
