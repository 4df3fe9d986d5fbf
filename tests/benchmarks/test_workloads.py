"""Workloads: four domains of real offline text and one the bootstrap corpus lacks, deterministic from a seed, disjoint splits, tagged bodies."""

from __future__ import annotations

import pytest

from benchmarks import workloads
from dvi import corpus
from dvi.errors import DviError


@pytest.mark.parametrize("domain", workloads.ALL_DOMAINS)
def test_each_domain_is_deterministic_and_its_splits_are_disjoint(domain):
    splits = {name: workloads.prompts(domain, name, seed=3) for name in workloads.SPLITS}
    assert splits["live"] == workloads.prompts(domain, "live", seed=3)  # same seed, same list
    assert splits["live"] != workloads.prompts(domain, "live", seed=4)  # another seed, another order
    texts = [p.text for ps in splits.values() for p in ps]
    assert len(splits["live"]) >= 100 and len(splits["bootstrap"]) >= 48
    assert len(set(texts)) == len(texts)  # no prompt is in two splits (nor twice in one)
    assert all(p.domain == domain and 0 < len(p.text) <= workloads.MAX_PROMPT_CHARS for p in splits["live"])


def test_domains_differ_in_kind_and_bodies_carry_the_domain_tag():
    code, prose, qa, markdown = (workloads.prompts(d)[0] for d in workloads.DOMAINS)
    assert code.text.startswith(("def ", "@")) and '"""' in code.text or "'''" in code.text
    assert not code.chat and not prose.chat and qa.chat and not markdown.chat
    assert all(p.text.startswith("#") and "\n\n" in p.text for p in workloads.prompts("markdown")[:50])  # a README section
    assert code.path == "/v1/completions" and qa.path == "/v1/chat/completions"
    assert code.body(32) == {"prompt": code.text, "max_tokens": 32, "temperature": 0, "dvi": {"domain": "code"}}
    assert qa.body(16)["messages"] == [{"role": "user", "content": qa.text}] and qa.body(16)["dvi"] == {"domain": "qa"}


def test_math_is_outside_the_bootstrap_corpus_and_its_problems_make_sense():
    assert "math" in workloads.UNCOVERED and "math" not in corpus.DOMAINS and set(workloads.DOMAINS) == set(corpus.DOMAINS)
    pencils = [p for p in workloads.prompts("math") if "pencils" in p.text]
    assert pencils and all(p.chat and p.text.endswith("Solve it step by step.") for p in workloads.prompts("math"))
    for p in pencils:  # never more given away than bought
        boxes, per_box, given = (int(w) for w in p.text.split() if w.isdigit())
        assert 0 < given < boxes * per_box


def test_code_prompts_end_where_the_function_body_begins():
    for p in workloads.prompts("code")[:50]:
        last = p.text.rsplit("\n", 1)[1]
        assert last.strip() == "" and len(last) >= 4  # a fresh line at the body's indentation


def test_split_bounds_cover_the_pool_in_order():
    n = 101
    bounds = [workloads.split_bounds(n, s) for s in workloads.SPLITS]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_unknown_domain_or_split_and_an_empty_cycle_are_clear_errors():
    with pytest.raises(DviError, match="unknown workload domain 'poetry'"):
        workloads.prompts("poetry")
    with pytest.raises(DviError, match="unknown workload split"):
        workloads.prompts("code", "test")
    with pytest.raises(DviError, match="empty workload"):
        next(workloads.cycle([]))
