"""The bootstrap's held-out slice (`trainers.anchor`): which records it keeps, its file, which slice a config picks, the
rule a candidate must hold to, and the slice that ships beside the bootstrap drafter. Its use by the trainer's gate is
tested end to end in tests/trainers/test_eagle3_trainer.py."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from dvi import drafters
from dvi.config import DviConfig, ModelConfig, TrainerConfig
from dvi.corpus import DOMAINS
from dvi.errors import DviError
from dvi.records import DecisionRecord, RoundRecord, Sampling, Target
from trainers import anchor

VOCAB = 49152


def record(n: int, domain: str, chunk: int = 0, temperature: float = 0.0) -> DecisionRecord:
    rounds = [RoundRecord(t, 0, [], 0, 7 + t, np.array([[7 + t, 3]]), np.array([[-0.1, -2.5]], np.float32)) for t in range(3)]
    return DecisionRecord(request_id=f"{n:032x}", replica_id="bootstrap", chunk_index=chunk, final=True,
                          target=Target("t", VOCAB), drafter_version=None, sampling=Sampling(temperature, 1.0, None),
                          prompt_ids=[1, 2, 3 + n], prefix_ids=[], generated_ids=[7, 8, 9], rounds=rounds, topk=2,
                          domain=domain, record_id=f"{n * 16 + chunk:032x}")


def test_a_slice_is_the_first_greedy_record_of_a_few_answers_a_domain_the_same_every_time():
    records = [record(n, d) for d in ("code", "prose") for n in range(10 * (d == "prose"), 10 * (d == "prose") + 10)]
    records += [record(n, "code", chunk=1) for n in range(10)] + [record(100 + n, "code", temperature=0.8) for n in range(10)]
    picked = anchor.pick(records, per_domain=4, seed=3)
    assert [r.domain for r in picked] == ["code"] * 4 + ["prose"] * 4
    assert all(r.chunk_index == 0 and r.sampling.temperature == 0.0 for r in picked)
    assert len({r.record_id for r in picked}) == 8
    assert [r.record_id for r in anchor.pick(list(reversed(records)), per_domain=4, seed=3)] == [r.record_id for r in picked]
    assert [r.record_id for r in anchor.pick(records, per_domain=4, seed=4)] != [r.record_id for r in picked]
    assert len(anchor.pick(records, per_domain=50)) == 20  # a domain with fewer answers gives them all


def test_a_slice_file_reads_back_as_written_and_the_same_records_make_the_same_bytes(tmp_path):
    records = [record(n, "qa") for n in range(3)]
    first = anchor.write(records, tmp_path / "a.heldout.jsonl.gz")
    again = anchor.write(records, tmp_path / "b.heldout.jsonl.gz")
    assert first == again and first["records"] == 3
    back = anchor.read(tmp_path / "a.heldout.jsonl.gz", VOCAB)
    assert [r.to_dict() for r in back] == [r.to_dict() for r in records]


def test_a_slice_that_does_not_read_is_refused_naming_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.heldout.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(DviError, match="bad.heldout.jsonl.gz: the held-out slice does not read"):
        anchor.read(bad)
    good = anchor.write([record(0, "qa")], tmp_path / "good.heldout.jsonl.gz")
    assert good["records"] == 1
    with gzip.open(bad, "wt") as f:
        f.write(gzip.open(tmp_path / "good.heldout.jsonl.gz", "rt").read() + '{"record_id": 3}\n')
    with pytest.raises(DviError, match=r"bad.heldout.jsonl.gz:2: not a record of the held-out slice"):
        anchor.read(bad)
    with pytest.raises(DviError, match="target.vocab_size"):  # a slice for another target
        anchor.read(tmp_path / "good.heldout.jsonl.gz", VOCAB + 1)
    with gzip.open(bad, "wt") as f:
        f.write("\n")
    with pytest.raises(DviError, match="holds no record"):
        anchor.read(bad)


def test_the_config_picks_the_shipped_slice_for_the_shipped_drafter_a_named_file_or_none(tmp_path):
    def cfg(name: str, **model) -> DviConfig:
        return DviConfig(model=ModelConfig(**model), trainer=TrainerConfig(anchor=name))

    shipped = anchor.slice_path(drafters.SHIPPED)
    assert anchor.resolve(cfg("auto")) == shipped and shipped.is_file()
    assert anchor.resolve(cfg("auto", drafter="init")) is None  # the untrained start has no bootstrap to keep
    assert anchor.resolve(cfg("auto", drafter_kind="layers")) is None
    assert anchor.resolve(cfg("none")) is None
    assert anchor.resolve(cfg(str(shipped), drafter="init")) == shipped
    with pytest.raises(DviError, match=r"trainer.anchor: '.*missing.jsonl.gz' is not a file"):
        anchor.resolve(cfg(str(tmp_path / "missing.jsonl.gz")))
    with pytest.raises(DviError, match="trainer.anchor_max_drop"):
        TrainerConfig(anchor_max_drop=-0.1)


def test_a_candidate_holds_when_it_is_at_most_max_drop_below_the_start():
    assert anchor.holds(0.60, 0.62, 0.03) and anchor.holds(0.59, 0.62, 0.03) and anchor.holds(0.9, 0.62, 0.0)
    assert not anchor.holds(0.58, 0.62, 0.03) and not anchor.holds(0.619, 0.62, 0.0)


def test_the_shipped_slice_holds_every_domain_of_the_bootstrap_corpus_answered_by_the_demo_target():
    records = anchor.read(anchor.slice_path(drafters.SHIPPED), VOCAB)
    by_domain = {d: sum(r.domain == d for r in records) for d in DOMAINS}
    assert by_domain == {d: anchor.PER_DOMAIN for d in DOMAINS}
    assert all(r.chunk_index == 0 and r.sampling.temperature == 0.0 and r.topk == 8 and r.generated_ids for r in records)
    assert len({tuple(r.prompt_ids) for r in records}) == len(records)


def test_the_gates_figures_on_the_slice_name_each_domain():
    figures = {"all": {"realized": 0.5, "acceptance": 0.45}, "code": {"realized": 0.6}, "prose": {"realized": 0.4}}
    assert anchor.gate_figures(figures, {"all": {"realized": 0.55}}) == {
        "anchor_acceptance": 0.5, "anchor_expected": 0.45, "anchor_start": 0.55, "anchor_code": 0.6, "anchor_prose": 0.4}


def test_per_domain_figures_leave_records_without_a_domain_in_all_only():
    kept = anchor.Anchor(Path("s"), [], ["code", "", "code"])
    assert kept.by_domain([1, 2, 3]) == {"all": [1, 2, 3], "code": [1, 3]}
