"""Building an EAGLE-3 drafter from the real demo target (`dvi.eagle3.build_eagle3`): the speculators-format files,
the draft vocabulary, loading it back, and the start it gets from the target's own layer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dvi.config import ModelConfig
from dvi.eagle3 import build_eagle3, load_eagle3, target_features, target_ids
from dvi.errors import DviError
from dvi.models import drafter_kind, end_ids, load_causal_lm, load_tokenizer
from dvi.pairs import pair_dirs

pytestmark = pytest.mark.real_model

TEXTS = ["def main():\n    return 0\n", "The quick brown fox jumps over the lazy dog. " * 20]


@pytest.fixture(scope="module")
def built(demo_target_dir, tmp_path_factory):
    return build_eagle3(demo_target_dir, tmp_path_factory.mktemp("eagle3") / "e3", vocab_n=512, texts=TEXTS)


def test_build_writes_the_speculators_format(built, demo_target_dir):
    config = json.loads((built / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 512
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM's default for 30 layers
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(demo_target_dir.resolve())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1 and config["target_hidden_size"] == 576
    assert "auto_map" not in json.dumps(config)
    meta = json.loads((built / "dvi_drafter.json").read_text())
    assert meta["kind"] == "eagle3" and meta["draft_vocab"] == 512
    weights = load_file(str(built / "model.safetensors"))
    assert weights["fc.weight"].shape == (576, 3 * 576) and weights["lm_head.weight"].shape == (512, 576)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (576, 2 * 576)
    assert not any("embed_tokens" in k for k in weights)  # shared with the target in vLLM
    assert (built / "tokenizer.json").is_file()


def test_loaded_drafter_starts_as_the_targets_layer(built, demo_target_dir):
    target = load_causal_lm(demo_target_dir, "target")
    drafter = load_eagle3(built)
    assert drafter.version == "init-eagle3-v512"
    ids = target_ids(drafter.d2t)
    assert ids.numel() == 512 and set(end_ids(target, load_tokenizer(demo_target_dir))) <= set(ids.tolist())
    assert torch.equal(drafter.t2d.nonzero().flatten(), ids)
    x = torch.tensor([[1, 504, 3458, 282, 4371, 314, 253, 1127]])
    with torch.no_grad():
        logits, prenorm = drafter(drafter.fuse(target_features(target, x, drafter.layer_ids)), x)
        # fc passes layer 27's input through and the midlayer is target layer 27: its output is layer 28's input
        assert torch.allclose(prenorm, target_features(target, x, [28]), atol=1e-4)
    assert logits.shape == (1, 8, 512) and bool(torch.isfinite(logits).all())


def test_drafter_init_kind_eagle3(tmp_path):
    out = tmp_path / "e3"
    done = subprocess.run([sys.executable, "-m", "dvi.cli", "drafter", "init", "--kind", "eagle3", "--vocab", "300",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 300
    assert json.loads((out / "dvi_drafter.json").read_text())["kind"] == "eagle3"
    refused = subprocess.run([sys.executable, "-m", "dvi.cli", "drafter", "init", "--kind", "eagle3", "--layers", "2"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--layers is for --kind layers" in refused.stderr


def test_model_drafter_kind_eagle3_builds_the_demo_eagle3_drafter_once(demo_target_dir, tmp_path):
    cfg = ModelConfig(target=str(demo_target_dir), drafter_kind="eagle3", drafter_vocab=300, cache_dir=str(tmp_path))
    target_dir, drafter_dir = pair_dirs(cfg)
    assert target_dir == demo_target_dir and drafter_dir == tmp_path / "models" / "eagle3-v300"
    assert drafter_kind(drafter_dir) == "eagle3" and json.loads((drafter_dir / "config.json").read_text())["draft_vocab_size"] == 300
    built = (drafter_dir / "model.safetensors").stat().st_mtime_ns
    assert pair_dirs(cfg) == (target_dir, drafter_dir) and (drafter_dir / "model.safetensors").stat().st_mtime_ns == built
    assert ModelConfig().drafter_kind == "eagle3"  # the default kind
    layers = ModelConfig(target=str(demo_target_dir), cache_dir=str(tmp_path), drafter_kind="layers")
    assert drafter_kind(pair_dirs(layers)[1]) == "layers" and pair_dirs(layers)[1] == tmp_path / "models" / "drafter-L2-full"
    with pytest.raises(DviError, match="model.drafter_kind"):
        ModelConfig(drafter_kind="medusa")
