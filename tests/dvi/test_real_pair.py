"""The real demo pair (SmolLM2-135M-Instruct and drafters built from it): exactness and model-pair checks.

Greedy speculative decoding must return exactly `target.generate(do_sample=False)`, alone, batched, with
the full-vocabulary and the reduced-vocabulary drafter. Runs on CPU in well under a minute once the demo
target is in the model cache (the first fetch downloads and converts it, about 40 s).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dvi.config import SpecConfig
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.errors import DviError
from dvi.models import Drafter, build_drafter, check_same_tokenizer, load_causal_lm, load_drafter, load_tokenizer

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of numbers.",
    "List three colors of the rainbow.",
    "Explain in one sentence what gravity is.",
]
NEW = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread_module():
    """One torch thread for the module: on a busy 2-core machine, two threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chat_ids(tokenizer, text: str) -> list[int]:
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)  # transformers 5: a BatchEncoding


@pytest.fixture(scope="module")
def prompts(demo_pair) -> list[list[int]]:
    _, tokenizer, _ = demo_pair
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(demo_pair, prompts) -> list[list[int]]:
    """The target's own greedy continuations (stopping at its end-of-sequence token, like the engine)."""
    target, _, _ = demo_pair
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False)
            out.append(gen[0, len(ids) :].tolist())
    return out


def engine_for(demo_pair, drafter, spec: SpecConfig | None = None) -> SpeculativeEngine:
    target, tokenizer, _ = demo_pair
    return SpeculativeEngine(target, drafter, spec or SpecConfig(k=3, adaptive=False), stop_ids={tokenizer.eos_token_id})


def check_against_reference(results, reference, eos: int = 2) -> None:
    for res, want in zip(results, reference, strict=True):
        assert res.token_ids == want
        assert res.finish_reason == ("stop" if want[-1] == eos else "length")


def test_demo_pair_is_what_the_tests_assume(demo_pair, prompts, reference):
    target, tokenizer, drafter = demo_pair
    assert drafter.vocab_map is None and drafter.model.config.num_hidden_layers == 2
    assert int(drafter.model.config.vocab_size) == int(target.config.vocab_size)
    assert tokenizer.eos_token_id == 2  # check_against_reference's eos
    assert all(len(p) > 20 for p in prompts)
    # real text: at least one answer stops on its own, at least one runs to the limit
    assert any(r[-1] == 2 for r in reference) and any(r[-1] != 2 for r in reference)
    assert "Paris" in tokenizer.decode(reference[0])


def test_greedy_speculative_equals_target_generate(demo_pair, prompts, reference):
    _, _, drafter = demo_pair
    engine = engine_for(demo_pair, drafter, SpecConfig())  # the default, adaptive K
    check_against_reference([engine.generate([Request(p, max_new_tokens=NEW)])[0] for p in prompts], reference)


def test_batch_equals_target_generate(demo_pair, prompts, reference):
    _, _, drafter = demo_pair
    results = engine_for(demo_pair, drafter).generate([Request(p, max_new_tokens=NEW) for p in prompts])
    check_against_reference(results, reference)
    # the drafter's cache stays right through the rounds: each greedy draft is its argmax on a fresh forward
    contexts = [
        (res.prompt_ids + res.token_ids[: r.position] + r.drafted[:j], d)
        for res in results[:2]
        for r in res.rounds
        for j, d in enumerate(r.drafted)
    ]
    assert len(contexts) > 20
    with torch.inference_mode():
        for ctx, d in contexts[::3]:
            assert d == int(drafter.model(torch.tensor([ctx])).logits[0, -1].argmax())


def test_target_as_its_own_drafter_accepts_everything(demo_pair, prompts, reference):
    target, _, _ = demo_pair
    engine = engine_for(demo_pair, Drafter(target, "self"))
    res = engine.generate([Request(prompts[2], max_new_tokens=NEW)])[0]
    check_against_reference([res], reference[2:3])
    assert res.stats.acceptance_rate == 1.0 and res.stats.drafted > 0


def test_reduced_vocabulary_drafter(demo_pair, demo_target_dir, prompts, reference, tmp_path_factory):
    target, tokenizer, _ = demo_pair
    out = build_drafter(demo_target_dir, tmp_path_factory.mktemp("drafters") / "L2-v4096", layers=2, vocab=4096)
    check_same_tokenizer(tokenizer, load_tokenizer(out, "drafter"))
    drafter = load_drafter(out, int(target.config.vocab_size))
    assert drafter.vocab_map is not None and drafter.vocab_size == 4096
    assert drafter.model.lm_head.weight.shape == (4096, target.config.hidden_size)
    assert tokenizer.eos_token_id in drafter.vocab_map.tolist()  # special tokens are always kept
    # two requests, one that stops and one that runs to the limit, keep the file quick
    results = engine_for(demo_pair, drafter).generate([Request(p, max_new_tokens=NEW) for p in prompts[:2]])
    check_against_reference(results, reference[:2])
    allowed = set(drafter.vocab_map.tolist())
    drafted = [d for res in results for r in res.rounds for d in r.drafted]
    assert drafted and all(d in allowed for d in drafted)


def test_tokenizer_mismatch_raises(demo_pair):
    _, tokenizer, _ = demo_pair
    check_same_tokenizer(tokenizer, copy.deepcopy(tokenizer))  # an identical copy passes
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<zzz>"])
    with pytest.raises(DviError, match="tokenizers differ.*1 only in drafter"):
        check_same_tokenizer(tokenizer, other)


def test_loading_missing_or_incomplete_models_raises(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(DviError, match="no-such-model.*config.json"):
        load_causal_lm(missing, "target")
    with pytest.raises(DviError, match="drafter"):
        load_drafter(missing, 49152)
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text("{}")
    with pytest.raises(DviError, match="no safetensors"):
        load_causal_lm(tmp_path / "config-only", "target")
