"""The bootstrap corpus (`dvi.corpus`): mined from this Python's own text, split by source, described by its manifest."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dvi import corpus
from dvi.errors import DviError


@pytest.fixture(scope="module")
def every():
    return corpus.bootstrap_prompts()


def test_every_domain_is_mined_and_most_prompts_are_chat(every):
    by_domain = Counter(p.domain for p in every)
    assert set(by_domain) == set(corpus.DOMAINS)
    assert all(n >= 100 for n in by_domain.values()), by_domain
    assert 0.4 < sum(p.chat for p in every) / len(every) < 0.9
    assert len({p.id for p in every}) == len(every)


def test_no_source_is_in_both_splits_and_each_family_holds_out_its_share(every):
    split_of = {}
    for p in every:
        assert split_of.setdefault(p.source, p.split) == p.split, p.source
    for family in ("stdlib", "topic", "pypi"):
        prompts = [p for p in every if p.source.startswith(family + ":")]
        held = sum(p.split == "heldout" for p in prompts) / len(prompts)
        assert corpus.HELDOUT_SHARE <= held < 3 * corpus.HELDOUT_SHARE, (family, held)
    # chat prompts of code and of prose are held out, as the drafter's targets are measured on them
    assert sum(p.split == "heldout" and p.chat for p in every if p.domain == "code") >= 100
    assert sum(p.split == "heldout" and p.chat for p in every if p.domain == "prose") >= 20


def test_heldout_sources_against_a_plain_reference():
    counts = {"a:x": 5, "a:y": 1, "a:z": 4, "b:u": 10, "b:v": 10}

    def reference(share):
        out = set()
        for family in ("a", "b"):
            members = sorted((s for s in counts if s.startswith(family)), key=corpus.source_rank)
            total, held = sum(counts[s] for s in members), 0
            for s in members:
                if held >= share * total:
                    break
                out.add(s)
                held += counts[s]
        return out

    for share in (0.0, 0.1, 0.5, 0.99):
        assert corpus.heldout_sources(counts, share) == reference(share)
    assert corpus.heldout_sources(counts, 0.0) == set()
    assert len(corpus.heldout_sources(counts, 0.01)) == 2  # one source of each family at least


def test_a_smaller_corpus_keeps_the_domain_shares_and_the_same_splits(every):
    some = corpus.bootstrap_prompts(400, seed=0)
    assert len(some) == 400
    by_domain = Counter(p.domain for p in some)
    assert all(n == 100 for n in by_domain.values()), by_domain
    split = {p.id: p.split for p in every}
    assert all(split[p.id] == p.split for p in some)
    assert [p.id for p in corpus.bootstrap_prompts(400, seed=0)] == [p.id for p in some]  # deterministic
    assert [p.id for p in corpus.bootstrap_prompts(400, seed=1)] != [p.id for p in some]


def test_write_read_and_manifest(tmp_path):
    some = corpus.bootstrap_prompts(40)
    path = tmp_path / "corpus.jsonl"
    manifest = corpus.write_corpus(some, path)
    assert corpus.read_corpus(path) == some
    assert manifest["prompts"] == 40
    assert sum(v for d in manifest["by_domain"].values() for v in d.values()) == 40
    assert sum(v["prompts"] for v in manifest["source_sha256"].values()) == 40
    assert len(manifest["file_sha256"]) == 64
    json.dumps(manifest)


def test_a_bad_corpus_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "corpus.jsonl"
    good = corpus.bootstrap_prompts(8)
    lines = [json.dumps(p.to_dict()) for p in good]
    path.write_text("\n".join([lines[0], '{"id": "x", "domain": "poetry", "source": "s", "split": "train", "chat": true, "text": "t"}']))
    with pytest.raises(DviError, match=r"corpus.jsonl:2: .*domain"):
        corpus.read_corpus(path)
    path.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(DviError, match=r"corpus.jsonl:2"):
        corpus.read_corpus(path)
