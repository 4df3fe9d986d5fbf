"""Loading announced drafters: every refusal case on real store versions, and the live keep / roll-back rule.

Versions are published into a temporary store with `dvi.store.publish` from the tiny pair (a random Llama with
the demo tokenizer, tests/conftest.py), then damaged the way a broken or malicious publisher would; EAGLE-3 versions likewise from an EAGLE-3 drafter built
from the tiny target.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest
import torch

from dvi import store
from dvi.control import ControlError, DrafterPublished, decode
from dvi.files import sha256_file
from dvi.models import load_causal_lm
from dvi.eagle3 import build_eagle3, load_eagle3
from dvi.swap import Refused, at_depth, compare, judge, load_announced, resolve_in_store


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


def resum(path: Path) -> DrafterPublished:
    """Rewrite the version's SHA256SUMS over what its folder now holds (what a writer to the store could do), and
    announce it with the new digest: only checks other than the checksums can refuse it."""
    (path / store.SUMS).write_text("".join(f"{sha256_file(f)}  {f.name}\n" for f in sorted(path.iterdir())
                                           if f.is_file() and f.name != store.SUMS))
    return DrafterPublished(path.name, str(path), sha256_file(path / store.SUMS))


@pytest.mark.faults
def test_what_is_loaded_is_what_was_checked_files_links_folders_and_sizes(tiny_dirs, target, tmp_path):
    root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = publish_version(root, tiny_dirs[1], "d0001").path  # the weights, a link to a file outside the store
    (elsewhere / "w.safetensors").write_bytes((linked / store.WEIGHTS).read_bytes())
    (linked / store.WEIGHTS).unlink()
    (linked / store.WEIGHTS).symlink_to(elsewhere / "w.safetensors")
    folder = publish_version(root, tiny_dirs[1], "d0002").path  # a folder inside the version
    (folder / "sub").mkdir()
    (folder / "sub" / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    huge = publish_version(root, tiny_dirs[1], "d0003").path  # a listed file far bigger than the target
    with open(huge / "tokenizer.model", "wb") as f:
        f.truncate(2 << 30)  # sparse: 2 GiB that cost no disk
    odd = publish_version(root, tiny_dirs[1], "d0004").path  # a listed file no version holds
    (odd / "run.py").write_text("print('hi')")
    for path, words in ((linked, "not a regular file"), (folder, "not a regular file"), (huge, "bytes, more than"),
                        (odd, "not files a drafter version holds")):
        ann = resum(path) if path is not huge else DrafterPublished(path.name, str(path), "0" * 64)  # sizes come first
        t0 = time.perf_counter()
        with pytest.raises(Refused) as e:
            load_announced(ann, root, target)
        assert e.value.reason == "files" and words in str(e.value), (path.name, e.value)
        assert time.perf_counter() - t0 < 60  # the 2 GiB file is refused by its size, never read


@pytest.mark.faults
def test_a_config_other_than_the_targets_is_refused(tiny_dirs, target, tmp_path):
    for version, change, words in (("d0001", {"auto_map": {"AutoModelForCausalLM": "evil.Model"}}, "auto_map"),
                                   ("d0002", {"rms_norm_eps": 0.5}, "rms_norm_eps"),
                                   ("d0003", {"num_hidden_layers": 5}, "more than the target"),
                                   # private keys pick how transformers builds it (kernels, from the hub too): refused
                                   ("d0005", {"_attn_implementation": "kernels-community/flash-attn"}, "private keys"),
                                   ("d0006", {"_experts_implementation": "eager"}, "_experts_implementation")):
        path = publish_version(tmp_path, tiny_dirs[1], version).path
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(Refused) as e:
            load_announced(resum(path), tmp_path, target)
        assert e.value.reason == "config" and words in str(e.value), (version, e.value)
    fine = publish_version(tmp_path, tiny_dirs[1], "d0004").path  # layers are the drafter's own: fewer is fine
    assert load_announced(resum(fine), tmp_path, target).version == "d0004"
    family = load_causal_lm(tiny_dirs[1], "drafter").config  # a replica configured with a drafter checks its family
    family.rms_norm_eps = 0.25
    with pytest.raises(Refused, match="differs from the configured drafter's in .'rms_norm_eps'"):
        load_announced(resum(fine), tmp_path, target, family=family)


def rounds(k: int, accepted: list[int]) -> list[tuple[int, int]]:
    """Drafting rounds of `k` drafted tokens each, accepting these many."""
    return [(k, a) for a in accepted]


def test_judge_waits_for_the_window_then_keeps_or_rolls_back():
    kw = dict(window_tokens=100, baseline_tokens=50, margin=0.05)
    before = rounds(1, [1, 1, 1, 0, 1] * 50)  # 250 first drafts, 200 accepted: 0.80
    assert judge(before, rounds(4, [0] * 24), **kw) is None  # not enough of the new drafter's traffic yet
    assert judge(before, rounds(4, [3, 2, 3, 0, 4, 2, 1, 3, 0, 1] * 2 + [2, 2, 1, 0, 0]), **kw) == "keep"  # 0.76 >= 0.80 - 0.05
    assert judge(before, rounds(4, [3, 2, 3, 0, 4, 2, 1, 3, 0, 1] * 2 + [2, 2, 0, 0, 0]), **kw) == "rollback"  # 0.72 < 0.75
    assert judge(before, rounds(4, [4] * 50), **kw) == "keep"
    assert judge(rounds(4, [4] * 12), rounds(4, [0] * 24 + [3]), **kw) == "keep"  # the previous barely drafted: nothing to compare
    assert judge(None, rounds(4, [0] * 24 + [3]), **kw) == "keep"  # there was no drafter before
    assert judge(None, rounds(4, [0] * 25), **kw) == "rollback"  # a trial that accepted nothing is never promoted
    assert judge(rounds(4, [0] * 250), rounds(4, [0] * 25), **kw) == "rollback"  # nor after a drafter that accepted nothing


def test_at_depth_cuts_every_round_that_drafted_that_deep_and_leaves_the_others_out():
    mixed = [(1, 1), (2, 0), (3, 3), (4, 2), (5, 5), (2, 2)]
    for depth in range(1, 6):  # the plain reference: each deep-enough round's first `depth` drafts, one by one
        deep = [(k, a) for k, a in mixed if k >= depth]
        assert at_depth(mixed, depth) == (sum(depth for _ in deep), sum(sum(j < a for j in range(depth)) for _, a in deep))
    assert at_depth(mixed, 6) == (0, 0)


def test_a_drafter_drafted_deeper_than_the_one_it_replaced_is_judged_on_first_drafts():
    """An adaptive planner drafts a swapped-in drafter at its own K (its first rounds probe deeper): per drafted token,
    a drafter as good at every position falls with K. Judged on first drafts, it is kept; one worse there is not."""
    kw = dict(window_tokens=100, baseline_tokens=50, margin=0.05)
    before = rounds(1, [1, 0] * 150)  # K = 1: half its first drafts accepted
    same = rounds(4, [2, 0] * 20)  # K = 4: half its first drafts accepted too, 0.25 per drafted token
    assert sum(a for _, a in same) / sum(k for k, _ in same) == 0.25  # what accepted over drafted would hold it to
    assert compare(before, same) == (0.5, 0.5) and judge(before, same, **kw) == "keep"
    worse = rounds(4, [2, 0, 0] * 14)  # a third of its first drafts accepted
    assert judge(before, worse, **kw) == "rollback"


def test_a_drafter_the_planner_drafted_deep_only_on_easy_traffic_is_no_higher_bar():
    """The planner drafts deep where the recent traffic accepts well. The replaced drafter's K=4 rounds came from its
    easy stretches (every first draft accepted), its K=1 rounds from the hard ones (a fifth); the new one, drafting K=4
    on trial over both kinds of traffic alike, is as good at every depth. At depth 4 it would stand 0.32 below (its deep
    rounds include the hard traffic); on first drafts, over every round, the two are level and it is kept."""
    kw = dict(window_tokens=100, baseline_tokens=50, margin=0.05)
    easy, hard = rounds(4, [3, 2, 4, 2] * 20), rounds(1, [1, 0, 0, 0, 0] * 16)  # 80 rounds each
    new = rounds(4, [3, 2, 4, 2] * 5) + rounds(4, [1, 0, 0, 0, 0] * 4)  # the same traffic at K = 4: 20 rounds each
    deep = lambda side: at_depth(side, 4)[1] / at_depth(side, 4)[0]  # noqa: E731
    assert deep(easy + hard) - deep(new) > 0.2
    assert compare(easy + hard, new) == (0.6, 0.6) and judge(easy + hard, new, **kw) == "keep"


# ----------------------------------------------------------------------------------------------
# EAGLE-3 versions (speculators format, dvi.eagle3): the same checks, their own config and shapes.


@pytest.fixture(scope="module")
def eagle3_parent(tiny_dirs, tmp_path_factory) -> Path:
    return build_eagle3(tiny_dirs[0], tmp_path_factory.mktemp("eagle3") / "e3", vocab_n=256, texts=["def f(x):\n    return x\n"],
                        layer_ids=(0, 1))


def publish_eagle3(store_root: Path, parent: Path, target_dir: Path, version: str, mutate=None) -> store.Published:
    weights = load_eagle3(parent, target_dir).weights()
    if mutate is not None:
        mutate(weights)
    return store.publish(store_root, version, weights, parent, {"parent": "test"})


def test_an_eagle3_version_loads_and_is_not_served_as_a_layer_drafter(tiny_dirs, target, eagle3_parent, tmp_path):
    p = publish_eagle3(tmp_path, eagle3_parent, tiny_dirs[0], "d0001")
    assert json.loads((p.path / "dvi_drafter.json").read_text())["kind"] == "eagle3"  # the parent's kind
    drafter = load_announced(announcement(p), tmp_path, target, kind="eagle3")
    assert drafter.version == "d0001"
    ref = load_eagle3(eagle3_parent, tiny_dirs[0]).weights()
    assert all(torch.equal(v, ref[k]) for k, v in drafter.weights().items())
    assert torch.equal(drafter.embed_tokens.weight, target.get_input_embeddings().weight)
    with pytest.raises(Refused) as e:
        load_announced(announcement(p), tmp_path, target)
    assert e.value.reason == "load" and "EAGLE-3" in str(e.value)
    layer = publish_version(tmp_path, tiny_dirs[1], "d0002")
    with pytest.raises(Refused, match="not an EAGLE-3 drafter"):
        load_announced(announcement(layer), tmp_path, target, kind="eagle3")


@pytest.mark.faults
def test_eagle3_versions_that_do_not_fit_the_target_are_refused(tiny_dirs, target, eagle3_parent, tmp_path):
    def layer(**change):
        return lambda c: {**c, "transformer_layer_config": {**c["transformer_layer_config"], **change}}

    def verifier(c):
        spec = c["speculators_config"]
        return {**c, "speculators_config": {**spec, "verifier": {**spec["verifier"], "architectures": ["Qwen2ForCausalLM"]}}}

    configs = (("auto_map", lambda c: {**c, "auto_map": {"AutoModel": "evil.Model"}}, "auto_map"),
               ("nested auto_map", layer(auto_map={"AutoModel": "evil.Model"}), "auto_map"),
               ("private key", layer(_attn_implementation="kernels-community/x"), "private keys"),
               ("hidden size", layer(hidden_size=64), "hidden_size"),
               ("two layers", layer(num_hidden_layers=2), "one Llama layer"),
               ("verifier", verifier, "Qwen2ForCausalLM"),
               ("fc input", lambda c: {**c, "target_hidden_size": 64}, "target_hidden_size 64"),
               ("aux layers", lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [0, 7]}, "aux layers [0, 7]"),
               ("unsorted aux layers", lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [1, 0]}, "strictly increasing"))
    for i, (what, change, words) in enumerate(configs):
        path = publish_eagle3(tmp_path, eagle3_parent, tiny_dirs[0], f"c{i:04d}").path
        (path / "config.json").write_text(json.dumps(change(json.loads((path / "config.json").read_text()))))
        with pytest.raises(Refused) as e:
            load_announced(resum(path), tmp_path, target, kind="eagle3")
        assert e.value.reason == "config" and words in str(e.value), (what, e.value)

    def shrink(w):
        w["fc.weight"] = w["fc.weight"][:, :-1].clone()

    def drop(w):
        del w["d2t"]

    def shuffle(w):
        w["t2d"] = w["t2d"].roll(1).contiguous()  # no longer the ids d2t maps to

    def poison(w):
        w["midlayer.mlp.up_proj.weight"][0, 0] = float("inf")

    for version, mutate, reason, words in (("s0001", shrink, "shapes", "wrong shapes ['fc.weight"), ("s0002", drop, "shapes", "missing ['d2t']"),
                                           ("s0003", shuffle, "load", "d2t and t2d"), ("s0004", poison, "nonfinite", "up_proj")):
        p = publish_eagle3(tmp_path, eagle3_parent, tiny_dirs[0], version, mutate)
        with pytest.raises(Refused) as e:
            load_announced(announcement(p), tmp_path, target, kind="eagle3")
        assert e.value.reason == reason and words in str(e.value), (version, e.value)
    linked = publish_eagle3(tmp_path, eagle3_parent, tiny_dirs[0], "f0001").path  # the weights, a link
    (tmp_path / "w.safetensors").write_bytes((linked / store.WEIGHTS).read_bytes())
    (linked / store.WEIGHTS).unlink()
    (linked / store.WEIGHTS).symlink_to(tmp_path / "w.safetensors")
    with pytest.raises(Refused) as e:
        load_announced(resum(linked), tmp_path, target, kind="eagle3")
    assert e.value.reason == "files" and "not a regular file" in str(e.value)
