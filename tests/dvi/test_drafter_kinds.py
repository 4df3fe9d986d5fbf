"""The table of drafter kinds (`dvi.drafter_kinds`): each kind's names, the look-ups, and what vLLM is told of a
drafter of each kind, on tiny random drafters (no files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from dvi.config import ModelConfig
from dvi.drafter_kind_names import KIND_NAMES
from dvi.drafter_kinds import KINDS, DrafterKind, Eagle3Kind, LayersKind, kind_of, kind_of_config, kind_of_dir
from dvi.eagle3 import Eagle3Drafter
from dvi.errors import DviError
from dvi.models import DRAFTER_META, EAGLE3, LAYERS, Drafter

VOCAB = 97


def test_each_kind_is_looked_up_by_its_name_with_vllms_method_for_it():
    assert sorted(KINDS) == [EAGLE3, LAYERS]
    assert all(isinstance(k, DrafterKind) and kind_of(name) is k and k.name == name for name, k in KINDS.items())
    layers, eagle = kind_of("layers"), kind_of("eagle3")
    assert isinstance(layers, LayersKind) and isinstance(eagle, Eagle3Kind)
    assert (layers.vllm_method, eagle.vllm_method) == ("draft_model", "eagle3")
    assert (layers.description, eagle.description) == ("a layer drafter", "an EAGLE-3 drafter")
    assert (layers.reads_features, eagle.reads_features) == (False, True)  # what runs an EAGLE-3 drafter runs the target


def test_the_names_the_config_and_the_command_line_take_are_the_kinds():
    assert sorted(KIND_NAMES) == sorted(KINDS) and (LAYERS, EAGLE3) == KIND_NAMES  # dvi drafter init --kind's order
    assert ModelConfig(drafter_kind=LAYERS).drafter_kind == LAYERS and ModelConfig().drafter_kind == EAGLE3
    with pytest.raises(DviError, match="model.drafter_kind.*layers or eagle3"):
        ModelConfig(drafter_kind="medusa")


@pytest.mark.parametrize("name", ["dflash", "", "Eagle3", None])
def test_an_unknown_kind_is_an_error_naming_the_known_ones(name):
    with pytest.raises(DviError, match="unknown drafter kind .*: dvi knows eagle3, layers"):
        kind_of(name)


def test_a_config_names_its_kind_and_a_directory_its_own(tmp_path):
    speculators = {"speculators_model_type": "eagle3", "model_type": "llama", "transformer_layer_config": {}}
    assert kind_of_config(speculators) is kind_of(EAGLE3)  # before the causal LM any config with a model_type is
    assert kind_of_config({"model_type": "llama"}) is kind_of(LAYERS)
    assert kind_of_config({"architectures": ["LlamaForCausalLM"]}) is None
    (tmp_path / DRAFTER_META).write_text('{"kind": "eagle3"}')
    assert kind_of_dir(tmp_path) is kind_of(EAGLE3) and kind_of_dir(tmp_path / "none") is kind_of(LAYERS)


def test_demo_drafters_live_where_each_kind_names_them():
    cache = Path("/cache")
    assert kind_of(LAYERS).demo_dir(cache, 2, None) == cache / "models" / "drafter-L2-full"
    assert kind_of(LAYERS).demo_dir(cache, 3, 300) == cache / "models" / "drafter-L3-v300"
    assert kind_of(EAGLE3).demo_dir(cache, 2, None) == cache / "models" / "eagle3-v8192"
    assert kind_of(EAGLE3).demo_dir(cache, 2, 300) == cache / "models" / "eagle3-v300"


def tiny_eagle3(layer_ids=(0, 1)) -> Eagle3Drafter:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2)
    drafter = Eagle3Drafter(config, 40, layer_ids, torch.randn(VOCAB, 32))
    drafter.set_vocab(torch.arange(40))
    drafter.version = "e1"
    return drafter


def test_what_vllm_is_told_of_each_kind(make_tiny_llama):
    layers, eagle = kind_of(LAYERS), kind_of(EAGLE3)
    drafter = Drafter(make_tiny_llama(seed=0, layers=1), "d1")
    bare = tiny_eagle3()
    held = Drafter(bare, "e1", bare.d2t)
    assert layers.feature_layers(drafter) is None
    assert eagle.feature_layers(bare) == eagle.feature_layers(held) == (0, 1)
    assert layers.vllm_shape(drafter)["kind"] == LAYERS and eagle.vllm_shape(held)["kind"] == EAGLE3
    assert eagle.vllm_shape(bare) == eagle.vllm_shape(held) != eagle.vllm_shape(tiny_eagle3((0, 2)))
    assert "1 layers" in layers.vllm_shape_text(drafter) and "aux layers [0, 1]" in eagle.vllm_shape_text(bare)
    weights, = layers.vllm_load_args(drafter)
    assert weights.keys() == drafter.model.state_dict().keys()
    weights, flagged = eagle.vllm_load_args(bare)
    assert flagged is True and weights["d2t"].dtype == torch.long and weights["fc.weight"].dtype == torch.float32
    layers.check_vllm(drafter, VOCAB)
    eagle.check_vllm(bare, VOCAB)
    with pytest.raises(DviError, match="vocabulary size 97, the target has 98"):
        layers.check_vllm(drafter, VOCAB + 1)
    with pytest.raises(DviError, match="for a vocabulary of 97, the target has 98"):
        eagle.check_vllm(held, VOCAB + 1)
    with pytest.raises(DviError, match="reduced vocabulary head"):
        layers.check_vllm(Drafter(drafter.model, "d2", torch.arange(10)), VOCAB)


def test_a_server_of_one_kind_refuses_a_version_of_the_other_naming_both():
    layers, eagle = kind_of(LAYERS), kind_of(EAGLE3)
    refused = layers.refuse_other("d0001", eagle)
    assert refused.reason == "load" and "d0001 is an EAGLE-3 drafter" in str(refused) and "method eagle3" in str(refused)
    refused = eagle.refuse_other("d0002", layers)
    assert refused.reason == "load" and "d0002 is a layer drafter, not an EAGLE-3 drafter" in str(refused)


def test_what_drafts_for_each_kind_and_the_target_it_needs(make_tiny_llama):
    layers, eagle = kind_of(LAYERS), kind_of(EAGLE3)
    target = make_tiny_llama(seed=0, layers=2)
    drafter = Drafter(make_tiny_llama(seed=1, layers=1), "d1", torch.arange(10))
    bare = tiny_eagle3()
    assert layers.draft_model(drafter) == (drafter.model, drafter.vocab_map)
    model, ids = eagle.draft_model(bare)
    assert model is bare and ids.tolist() == list(range(40))
    assert eagle.draft_model(Drafter(bare, "e1", ids))[0] is bare
    layers.check_target(drafter, target.config)
    eagle.check_target(bare, target.config)  # aux layers 0 and 1 of a 2-layer target, its width
    with pytest.raises(DviError, match=r"aux layers \[0, 3\] of width 32; the target has layers 0..2"):
        eagle.check_target(tiny_eagle3((0, 3)), target.config)
    eagle.place(bare, torch.device("meta"))
    assert bare.fc.weight.is_meta


def test_an_initial_drafters_size_is_its_kinds_to_take_or_refuse():
    layers, eagle = kind_of(LAYERS), kind_of(EAGLE3)
    assert layers.init_size(None, None, 2, 8192) == (2, 8192)  # the configured defaults
    assert layers.init_size(4, 0, 2, 8192) == (4, None)  # vocab 0: the target's whole vocabulary
    assert eagle.init_size(None, None, 2, None) == (2, 8192) and eagle.init_size(None, 2048, 2, None) == (2, 2048)
    with pytest.raises(DviError, match="--layers is for --kind layers"):
        eagle.init_size(3, None, 2, None)
    with pytest.raises(DviError, match="reduced vocabulary"):
        eagle.init_size(None, 0, 2, None)


def test_a_versions_files_hold_what_its_kind_reads_back():
    w = {"model.embed_tokens.weight": torch.zeros(5, 2), "lm_head.weight": torch.ones(3, 2), "model.norm.weight": torch.ones(2)}
    layers = kind_of(LAYERS)
    reduced = layers.version_tensors(w, {}, torch.tensor([0, 2, 4]))  # a reduced head: apart, with its target ids
    assert set(reduced) == {"model.safetensors", "draft_head.safetensors"} and "lm_head.weight" not in reduced["model.safetensors"]
    assert reduced["draft_head.safetensors"]["token_ids"].tolist() == [0, 2, 4]
    assert "lm_head.weight" not in layers.version_tensors(w, {"tie_word_embeddings": True}, None)["model.safetensors"]
    assert "lm_head.weight" in layers.version_tensors(w, {}, None)["model.safetensors"] and "lm_head.weight" in w  # w untouched
    shared = {"embed_tokens.weight": torch.zeros(5, 2), "rotary.inv_freq": torch.ones(1), "fc.weight": torch.ones(2, 6)}
    assert set(kind_of(EAGLE3).version_tensors(shared, {}, None)) == {"model.safetensors"}
    assert list(kind_of(EAGLE3).version_tensors(shared, {}, None)["model.safetensors"]) == ["fc.weight"]  # not the target's
