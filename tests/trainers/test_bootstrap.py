"""`dvi drafter bootstrap`'s answers (`trainers.bootstrap`): the target's own tokens and top-k log-probs, as records serving
would log, in batches that a kill does not lose or repeat. A tiny random Llama with the demo tokenizer stands in for the
target (the shipped drafter's own run on the real pair is recorded in benchmarks/results/bootstrap-gpu-h200.json)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from dvi import corpus
from dvi.models import end_ids, load_causal_lm, load_tokenizer
from dvi.errors import DviError
from dvi.records import from_dict
from trainers import bootstrap


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return load_causal_lm(tiny_dirs[0], "target"), load_tokenizer(tiny_dirs[0], "target")


@pytest.fixture(scope="module")
def prompts():
    some = corpus.bootstrap_prompts(24)
    held = [p for p in corpus.bootstrap_prompts() if p.split == "heldout"][:2]
    return some + held


def test_batches_hold_every_answer_once_and_one_kind_of_sampling_each(tiny, prompts):
    _, tokenizer = tiny
    todo = bootstrap.jobs(prompts, tokenizer, samples=2, max_prompt_tokens=448)
    assert Counter(j.sample for j in todo) == {0: len(todo) - sum(j.sample for j in todo), 1: sum(j.sample for j in todo)}
    assert all(j.sample == 0 for j in todo if j.prompt.split == "heldout")  # held-out prompts: greedy, once
    batches = bootstrap.batches_of(todo, 5, seed=3)
    assert sorted((j.prompt.id, j.sample) for b in batches for j in b) == sorted((j.prompt.id, j.sample) for j in todo)
    assert all(len({j.sample for j in b}) == 1 and len(b) <= 5 for b in batches)
    assert [[j.prompt.id for j in b] for b in bootstrap.batches_of(todo, 5, seed=3)] == [[j.prompt.id for j in b] for b in batches]


def test_answers_are_the_targets_greedy_tokens_with_its_topk_and_valid_records(tiny, prompts):
    target, tokenizer = tiny
    jobs = [j for j in bootstrap.jobs(prompts, tokenizer, samples=1, max_prompt_tokens=448)][:4]
    stops = end_ids(target, tokenizer)
    answers = bootstrap.answer(target, jobs, stops, new_tokens=20, seed=0, pad_id=min(stops))
    for job, (gen, top_ids, top_lps) in zip(jobs, answers):
        ids = torch.tensor([job.ids + tuple(gen)])
        with torch.no_grad():
            log_p = torch.log_softmax(target(ids).logits[0, len(job.ids) - 1 : -1].float(), -1)  # the position before each token
        assert log_p.argmax(-1).tolist() == gen  # greedy: the target's own choice at every position, alone as in a batch
        ref = log_p.topk(bootstrap.TOPK, -1)
        assert (torch.tensor(top_ids) == ref.indices).float().mean() > 0.95  # ties may order differently
        assert torch.allclose(torch.tensor(top_lps), ref.values, atol=1e-3)
        records = bootstrap.target_records(job, gen, top_ids, top_lps, "tiny", int(target.config.vocab_size), seed=0)
        assert [len(r.rounds) for r in records] == [len(gen)]  # 20 tokens: one record of CHUNK_ROUNDS
        back = [from_dict(json.loads(json.dumps(r.to_dict())), int(target.config.vocab_size)) for r in records]  # validated
        assert back[0].generated_ids == gen and back[0].domain == job.prompt.domain and back[0].drafted == 0
        assert back[0].record_id == bootstrap.target_records(job, gen, top_ids, top_lps, "tiny", 49152, 0)[0].record_id


def test_answering_killed_midway_resumes_without_losing_or_repeating_a_record(tiny, prompts, tmp_path, monkeypatch):
    target, tokenizer = tiny
    plan = bootstrap.Plan(work=tmp_path, out=tmp_path / "out", samples=2, new_tokens=6, batch=8)
    real, calls = bootstrap.answer, []

    def killed_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # a kill between batches' records
        return real(*args, **kwargs)

    monkeypatch.setattr(bootstrap, "answer", killed_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        bootstrap.answers_stage(plan, target, tokenizer, prompts, "tiny")
    with open(tmp_path / "records-train.jsonl", "a") as f:
        f.write('{"half a record')  # what a kill during a write leaves
    with open(tmp_path / "answers.progress", "a") as f:
        f.write('{"batches": 9')  # and in the progress file: a cut line, which the next one would be appended to
    with pytest.raises(DviError, match="begun with"):  # other settings number the batches otherwise: refused
        bootstrap.answers_stage(bootstrap.Plan(work=tmp_path, out=tmp_path / "out", samples=2, new_tokens=6, batch=4),
                                target, tokenizer, prompts, "tiny")
    monkeypatch.setattr(bootstrap, "answer", real)
    done = bootstrap.answers_stage(plan, target, tokenizer, prompts, "tiny")

    todo = bootstrap.jobs(prompts, tokenizer, plan.samples, plan.max_prompt_tokens)
    assert done["answers"] == len(todo) and done["left_out"] == 0
    records = [json.loads(line) for s in corpus.SPLITS for line in open(tmp_path / f"records-{s}.jsonl")]
    requests = Counter(r["request_id"] for r in records)
    assert len(requests) == len(todo) and set(requests.values()) == {1}  # every answer once (6 tokens: one record each)
    heldout = {p.id for p in prompts if p.split == "heldout"}
    assert sum(1 for _ in open(tmp_path / "records-heldout.jsonl")) == len(heldout)


def test_answering_stops_when_its_time_is_up_and_says_what_it_left_out(tiny, prompts, tmp_path):
    target, tokenizer = tiny
    plan = bootstrap.Plan(work=tmp_path, out=tmp_path / "out", samples=1, new_tokens=4, batch=4, answer_minutes=0.0)
    done = bootstrap.answers_stage(plan, target, tokenizer, prompts, "tiny")
    assert done["answers"] == 0 and done["left_out"] == len(bootstrap.jobs(prompts, tokenizer, 1, plan.max_prompt_tokens))


def test_a_long_answer_is_records_of_64_rounds_each_one_carrying_what_came_before(tiny, prompts):
    target, tokenizer = tiny
    job = bootstrap.jobs(prompts, tokenizer, samples=1, max_prompt_tokens=448)[0]
    gen = [int(t) for t in torch.randint(3, 1000, (130,), generator=torch.Generator().manual_seed(0))]
    ids = torch.randint(0, 1000, (130, bootstrap.TOPK), generator=torch.Generator().manual_seed(1)).numpy()
    lps = torch.log_softmax(torch.randn(130, 50), -1).topk(bootstrap.TOPK, -1).values.numpy()
    records = bootstrap.target_records(job, gen, ids, lps, "tiny", 49152, seed=0)
    assert [len(r.rounds) for r in records] == [64, 64, 2] and [r.final for r in records] == [False, False, True]
    for c, r in enumerate(records):
        back = from_dict(json.loads(json.dumps(r.to_dict())), 49152)  # validated: positions, emitted tokens, teacher
        assert back.chunk_index == c and back.prefix_ids == gen[: 64 * c] and back.generated_ids == gen[64 * c : 64 * c + len(r.rounds)]
        assert [x.position for x in back.rounds] == list(range(64 * c, 64 * c + len(r.rounds)))
