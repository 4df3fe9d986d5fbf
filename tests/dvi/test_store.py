"""The model store: a published version loads back exactly (reduced head included) and any tampering is caught."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dvi.errors import DviError
from dvi.models import DRAFT_HEAD, load_drafter
from dvi.store import SUMS, check_version_name, next_version, publish, verify, versions

VOCAB = 97


@pytest.fixture(scope="module")
def parent_dirs(tmp_path_factory, make_tiny_llama) -> tuple[Path, Path]:
    """A full-head and a reduced-head drafter directory (config and weights; load_drafter needs no tokenizer)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("parents")
    model = make_tiny_llama(seed=3, layers=1, vocab=VOCAB)
    model.save_pretrained(root / "full")
    model.save_pretrained(root / "reduced")
    ids = torch.arange(0, VOCAB, 3)
    save_file({"token_ids": ids, "weight": model.lm_head.weight[ids].detach().clone()}, str(root / "reduced" / DRAFT_HEAD))
    return root / "full", root / "reduced"


@pytest.mark.parametrize("reduced", [False, True])
def test_published_version_loads_back_exactly(tmp_path, parent_dirs, reduced):
    parent = parent_dirs[1] if reduced else parent_dirs[0]
    drafter = load_drafter(parent, VOCAB)
    with torch.no_grad():
        for p in drafter.model.parameters():
            p.add_(0.01)  # "trained"
    pub = publish(tmp_path, "d0001", drafter.model.state_dict(), parent, {"parent": "init"}, drafter.vocab_map)
    verify(pub.path, pub.sha256)
    loaded = load_drafter(pub.path, VOCAB)
    assert loaded.version == "d0001"
    if reduced:
        assert torch.equal(loaded.vocab_map, drafter.vocab_map)
    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded.model(x).logits, drafter.model(x).logits)
    assert versions(tmp_path) == ["d0001"] and next_version(tmp_path) == "d0002"


def test_verify_catches_tampering(tmp_path, parent_dirs):
    drafter = load_drafter(parent_dirs[0], VOCAB)
    pub = publish(tmp_path, "d0001", drafter.model.state_dict(), parent_dirs[0], {})
    with pytest.raises(DviError, match="expected digest"):
        verify(pub.path, "0" * 64)
    weights = pub.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(DviError, match="model.safetensors does not match"):
        verify(pub.path)
    weights.unlink()
    with pytest.raises(DviError, match="missing"):
        verify(pub.path)


def test_pickles_and_unlisted_files_are_refused(tmp_path, parent_dirs):
    drafter = load_drafter(parent_dirs[0], VOCAB)
    pub = publish(tmp_path, "v1", drafter.model.state_dict(), parent_dirs[0], {})
    (pub.path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(DviError, match="pickle-capable"):
        verify(pub.path)
    (pub.path / "pytorch_model.bin").unlink()
    (pub.path / "notes.txt").write_text("x")
    with pytest.raises(DviError, match="not listed"):
        verify(pub.path)
    (pub.path / SUMS).unlink()
    with pytest.raises(DviError, match="no SHA256SUMS"):
        verify(pub.path)


def test_bad_names_existing_versions_and_crashed_publishes(tmp_path, parent_dirs):
    for bad in ("..", "a/b", "", "x y", ".tmp-d1"):
        with pytest.raises(DviError, match="invalid drafter version"):
            check_version_name(bad)
    drafter = load_drafter(parent_dirs[0], VOCAB)
    publish(tmp_path, "d0001", drafter.model.state_dict(), parent_dirs[0], {})
    with pytest.raises(DviError, match="already exists"):
        publish(tmp_path, "d0001", drafter.model.state_dict(), parent_dirs[0], {})
    (tmp_path / ".tmp-d0002-abcd").mkdir()  # a publish that crashed mid-write
    assert versions(tmp_path) == ["d0001"]
    assert next_version(tmp_path) == "d0003"


def test_verdicts_decide_what_a_restarting_replica_serves(tmp_path, parent_dirs):
    from dvi.store import PRODUCTION, REJECTED, VERDICTS, record_verdict, serving_candidates, serving_version, verdicts

    weights = load_drafter(parent_dirs[0], VOCAB).model.state_dict()
    assert serving_version(tmp_path) is None
    for v in ("d0001", "d0002", "d0003"):
        publish(tmp_path, v, weights, parent_dirs[0], {"parent": "init"})
    assert serving_version(tmp_path) == "d0003"  # nothing judged yet: the newest
    record_verdict(tmp_path, "d0001", PRODUCTION, replica_id="r1")
    record_verdict(tmp_path, "d0003", REJECTED, replica_id="r1", reason="acceptance 0.1 < 0.5")
    with open(tmp_path / VERDICTS, "a") as f:
        f.write("not json\n")  # a torn or foreign line is skipped, not fatal
    assert verdicts(tmp_path) == {"d0001": PRODUCTION, "d0003": REJECTED}
    assert serving_version(tmp_path) == "d0001"  # the version live traffic kept, not the unjudged d0002
    assert serving_version(tmp_path, prefer_production=False) == "d0002"  # latest: newest never rejected
    # what a replica tries in turn when one fails its checks: kept ones newest first, then the never rejected
    assert serving_candidates(tmp_path) == ["d0001", "d0002"] and serving_candidates(tmp_path, False) == ["d0002", "d0001"]
    record_verdict(tmp_path, "d0001", REJECTED)  # the latest verdict counts
    assert serving_version(tmp_path) == "d0002"
    assert versions(tmp_path) == ["d0001", "d0002", "d0003"] and next_version(tmp_path) == "d0004"
    with pytest.raises(DviError, match="unknown verdict"):
        record_verdict(tmp_path, "d0002", "great")
    for bad in ("../d0002", "d0002/x", "v" * 65):  # a name from a message is checked before it is written anywhere
        with pytest.raises(DviError, match="version name"):
            record_verdict(tmp_path, bad, REJECTED)
    size = (tmp_path / VERDICTS).stat().st_size
    record_verdict(tmp_path, "d0002", REJECTED, reason="x" * (1 << 20))  # a huge reason is kept to its start
    assert (tmp_path / VERDICTS).stat().st_size - size < 1000 and verdicts(tmp_path)["d0002"] == REJECTED
    with pytest.raises(DviError, match="invalid drafter version"):
        record_verdict(tmp_path, "../d0002", PRODUCTION)
