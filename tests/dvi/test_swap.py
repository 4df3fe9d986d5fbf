"""Loading announced drafters: every refusal case on real store versions, and the live keep / roll-back rule.

Versions are published into a temporary store with `dvi.store.publish` from the tiny pair (a random Llama with
the demo tokenizer, tests/conftest.py), then damaged the way a broken or malicious publisher would.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from dvi import store
from dvi.control import ControlError, DrafterPublished, decode
from dvi.models import load_causal_lm
from dvi.swap import Refused, judge, load_announced, resolve_in_store


def publish_version(store_root: Path, source_dir: Path, version: str, mutate=None) -> store.Published:
    """Publish the drafter at `source_dir` (its weights changed by `mutate(state_dict)`) as `version`."""
    model = load_causal_lm(source_dir, "drafter")
    weights = dict(model.state_dict())
    if mutate is not None:
        mutate(weights)
    return store.publish(store_root, version, weights, source_dir, {"parent": "test"})


def announcement(p: store.Published) -> DrafterPublished:
    return DrafterPublished(p.version, str(p.path), p.sha256)


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_causal_lm(tiny_dirs[0], "target")


def test_a_good_version_loads_under_its_announced_name(tiny_dirs, target, tmp_path):
    p = publish_version(tmp_path, tiny_dirs[1], "d0001")
    drafter = load_announced(announcement(p), tmp_path, target)
    assert drafter.version == "d0001"
    ref = load_causal_lm(tiny_dirs[1], "drafter").state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in drafter.model.state_dict().items())


def test_announcements_missing_fields_or_with_path_names_are_refused(target, tmp_path):
    for msg in ({}, {"version": "d1", "uri": "/x"}, {"version": 7, "uri": "/x", "sha256": "ab"},
                {"version": "../d1", "uri": "/x", "sha256": "ab"}):
        with pytest.raises(ControlError):  # the wire boundary: never reaches load_announced
            decode(json.dumps({"type": "drafter_published", **msg}).encode())
    with pytest.raises(Refused) as e:  # and load_announced checks the name of what it is handed too
        load_announced(DrafterPublished("../d1", "/x", "ab"), tmp_path, target)
    assert e.value.reason == "bad_message"


@pytest.mark.faults
def test_paths_outside_the_store_are_refused(tiny_dirs, target, tmp_path):
    root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    p = publish_version(elsewhere, tiny_dirs[1], "d0001")
    (root).mkdir()
    (root / "d0002").symlink_to(p.path)  # a link out of the store
    for uri, version in ((str(p.path), "d0001"), (str(root / ".." / "elsewhere" / "d0001"), "d0001"),
                         (str(root / "d0002"), "d0002"), (str(root / "d0003"), "d0001")):
        with pytest.raises(Refused) as e:
            load_announced(DrafterPublished(version, uri, p.sha256), root, target)
        assert e.value.reason == "outside_store", uri
    assert resolve_in_store(str(root / "d0001"), "d0001", root) == (root / "d0001").resolve()


@pytest.mark.faults
def test_a_pickle_in_the_version_is_refused_and_never_unpickled(tiny_dirs, target, tmp_path):
    p = publish_version(tmp_path, tiny_dirs[1], "d0001")
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (p.path / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(Refused) as e:
        load_announced(announcement(p), tmp_path, target)
    assert e.value.reason == "pickle" and "pytorch_model.bin" in str(e.value)
    assert not marker.exists()


@pytest.mark.faults
def test_checksum_mismatches_are_refused(tiny_dirs, target, tmp_path):
    p = publish_version(tmp_path, tiny_dirs[1], "d0001")
    with pytest.raises(Refused) as e:  # the announced digest is not the version's
        load_announced(DrafterPublished(p.version, str(p.path), "0" * 64), tmp_path, target)
    assert e.value.reason == "checksum"
    weights = p.path / store.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte in the weights
    weights.write_bytes(bytes(data))
    with pytest.raises(Refused) as e:
        load_announced(announcement(p), tmp_path, target)
    assert e.value.reason == "checksum" and store.WEIGHTS in str(e.value)


@pytest.mark.faults
def test_wrong_shapes_and_missing_weights_are_refused(tiny_dirs, target, tmp_path):
    def shrink(w):
        w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"][:-1].clone()

    def drop(w):
        del w["model.layers.0.self_attn.q_proj.weight"]

    for version, mutate, words in (("d0001", shrink, "wrong shapes"), ("d0002", drop, "missing")):
        p = publish_version(tmp_path, tiny_dirs[1], version, mutate)
        with pytest.raises(Refused) as e:
            load_announced(announcement(p), tmp_path, target)
        assert e.value.reason in ("shapes", "load") and (words in str(e.value) or "size mismatch" in str(e.value)), e.value


@pytest.mark.faults
def test_non_finite_weights_are_refused(tiny_dirs, target, tmp_path):
    def poison(w):
        w["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")

    p = publish_version(tmp_path, tiny_dirs[1], "d0001", poison)
    with pytest.raises(Refused) as e:
        load_announced(announcement(p), tmp_path, target)
    assert e.value.reason == "nonfinite" and "down_proj" in str(e.value)


@pytest.mark.faults
def test_a_reduced_head_that_repeats_a_token_id_is_refused(tiny_dirs, target, tmp_path):
    """A repeated id would make the head's scatter into the target vocabulary lose draft mass, so that sampled
    output no longer follows the target's distribution: such a head never loads. The same head without the
    repetition loads."""
    model = load_causal_lm(tiny_dirs[1], "drafter")
    weights = dict(model.state_dict())
    head = weights["lm_head.weight"]
    for version, ids in (("d0001", [5, 7, 7, 9]), ("d0002", [5, 7, 8, 9])):
        vocab_map = torch.tensor(ids)
        p = store.publish(tmp_path, version, {**weights, "lm_head.weight": head[vocab_map].clone()}, tiny_dirs[1],
                          {"parent": "test"}, vocab_map)
        if version == "d0001":
            with pytest.raises(Refused) as e:
                load_announced(announcement(p), tmp_path, target)
            assert e.value.reason == "load" and "token id 7 appears 2 times" in str(e.value), e.value
        else:
            assert load_announced(announcement(p), tmp_path, target).vocab_map.tolist() == ids


def test_judge_waits_for_the_window_then_keeps_or_rolls_back():
    kw = dict(window_tokens=100, baseline_tokens=50, margin=0.05)
    assert judge((1000, 600), (99, 0), **kw) is None  # not enough of the new drafter's traffic yet
    assert judge((1000, 600), (100, 56), **kw) == "keep"  # 0.56 >= 0.60 - 0.05
    assert judge((1000, 600), (100, 54), **kw) == "rollback"  # 0.54 < 0.55
    assert judge((1000, 600), (200, 190), **kw) == "keep"
    assert judge((49, 40), (100, 0), **kw) == "keep"  # the previous drafter barely drafted: nothing to compare
    assert judge(None, (100, 0), **kw) == "keep"  # there was no drafter before
