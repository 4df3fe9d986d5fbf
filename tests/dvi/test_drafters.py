"""The bootstrap drafter dvi ships (`dvi.drafters`): checked by its pinned digest, installed beside the demo target,
served for the demo pair unless `model.drafter=init`, and refused when a byte of it changed."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from dvi import drafters
from dvi.config import ModelConfig
from dvi.errors import DviError
from dvi.models import load_tokenizer, read_drafter_meta, untrained
from dvi.pairs import pair_dirs


def test_the_shipped_drafter_is_bf16_at_most_20_mib_and_says_how_it_was_made():
    assert sum(f.stat().st_size for f in drafters.SHIPPED.iterdir()) <= 20 * 2**20
    assert len(drafters.shipped_weights_sha256()) == 64  # the store's checks, against the pinned digest
    with safe_open(str(drafters.SHIPPED / drafters.WEIGHTS), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys() if k not in ("d2t", "t2d")}
    assert dtypes == {"BF16"}
    meta = read_drafter_meta(drafters.SHIPPED)
    assert meta["kind"] == "eagle3" and meta["version"] == drafters.shipped_version()
    boot = meta["bootstrap"]
    for key in ("command", "hardware", "corpus", "seconds", "trainer", "before", "after"):
        assert key in boot, key
    assert set(boot["after"]) >= {"code", "prose", "all"} and boot["corpus"]["file_sha256"]


def test_the_demo_pair_serves_it_and_init_keeps_the_untrained_drafter(demo_target_dir):
    target, drafter = pair_dirs(ModelConfig())
    assert target == demo_target_dir and read_drafter_meta(drafter)["version"] == drafters.shipped_version()
    config = json.loads((drafter / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(demo_target_dir.resolve())
    assert load_tokenizer(drafter).get_vocab() == load_tokenizer(demo_target_dir).get_vocab()
    _, init = pair_dirs(ModelConfig(drafter="init"))
    assert read_drafter_meta(init)["version"] == "init-eagle3-v8192"
    _, layers = pair_dirs(ModelConfig(drafter_kind="layers"))  # another demo kind: built, untrained, as before
    assert read_drafter_meta(layers)["version"].startswith("init-L2")
    # what trainer.lr=auto reads: the built ones are untrained, the shipped one (a trainer published it) is not
    assert untrained(init) and untrained(layers) and not untrained(drafter)


def test_a_changed_byte_in_the_shipped_copy_is_refused_and_in_the_installed_one_replaced(demo_target_dir, tmp_path,
                                                                                          monkeypatch, caplog):
    shipped = tmp_path / "shipped"
    shutil.copytree(drafters.SHIPPED, shipped)
    monkeypatch.setattr(drafters, "SHIPPED", shipped)
    installed = drafters.installed_bootstrap(tmp_path / "cache", demo_target_dir)
    assert drafters.installed_bootstrap(tmp_path / "cache", demo_target_dir) == installed  # once

    good = (installed / drafters.WEIGHTS).read_bytes()
    weights = bytearray(good)
    weights[-1] ^= 1
    (installed / drafters.WEIGHTS).write_bytes(weights)
    assert drafters.installed_bootstrap(tmp_path / "cache", demo_target_dir) == installed
    assert (installed / drafters.WEIGHTS).read_bytes() == good  # the shipped copy again, and the log says why
    assert "does not match the shipped bootstrap drafter's sha256" in caplog.text

    (shipped / drafters.WEIGHTS).write_bytes(weights)
    with pytest.raises(DviError, match="model.safetensors does not match its sha256"):
        drafters.installed_bootstrap(tmp_path / "other", demo_target_dir)
    (shipped / "extra.bin").write_bytes(b"\0")
    with pytest.raises(DviError, match="pickle-capable"):
        drafters.installed_bootstrap(tmp_path / "other", demo_target_dir)
    assert not (tmp_path / "other" / "models").exists() or not any((tmp_path / "other" / "models").iterdir())


def test_a_drafter_without_dvis_metadata_counts_as_trained(tmp_path):
    assert not untrained(tmp_path)  # trained elsewhere (a speculators checkpoint): fine-tuned, not trained again
