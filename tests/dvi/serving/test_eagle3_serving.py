"""Serving an EAGLE-3 drafter (`dvi.eagle3`), without starting vLLM: the configured pair gives an `Eagle3Drafter`, vLLM
is told method eagle3 (on its own server's command line), a replica on dvi's own engine drafts with it
and swaps EAGLE-3 versions in and out, and a replica over vLLM's engine (here a stand-in for vLLM's engine core that
records what the worker is handed) swaps EAGLE-3 versions in as checkpoint tensors, refuses a layer drafter's version (`load`) and one vLLM's draft
model cannot take, and rolls back to the previous weights. Over a layer drafter, vLLM's engine refuses a version of
another shape than its draft model, dropping the drafter, and a request vLLM would refuse. vLLM itself serving a dvi
EAGLE-3 drafter: tests/dvi/serving/test_vllm_eagle3.py; vLLM's own server with dvi's loop: tests/dvi/cli/test_vllm_plugin.py.

The tiny target (tests/conftest.py) with an EAGLE-3 drafter built over its two layers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from dvi import store
from dvi.cli.vllm import server as vllm_server
from dvi.config import DviConfig, ModelConfig, ServeConfig, SpecConfig, SwapConfig, TrackingConfig
from dvi.control import DrafterPublished, DrafterRejected
from dvi.eagle3 import Eagle3Drafter, build_eagle3, load_eagle3
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.errors import DviError
from dvi.models import EAGLE3, LAYERS, Drafter, drafter_kind, load_causal_lm, load_drafter
from dvi.pairs import resolve_pair
from dvi.serving.replica import Replica
from dvi.cli.vllm.engine import VllmEngine

TEXTS = ["def f(x):\n    return x\n"]


@pytest.fixture(scope="module")
def eagle3_dir(tiny_dirs, tmp_path_factory) -> Path:
    return build_eagle3(tiny_dirs[0], tmp_path_factory.mktemp("eagle3") / "e3", vocab_n=256, texts=TEXTS, layer_ids=(0, 1),
                        version="e0000")


def publish(store_root: Path, parent: Path, target_dir: Path, version: str, seed: int | None = None) -> store.Published:
    """`parent`'s weights (with noise on every matrix when `seed` is given) published as `version`."""
    weights = load_eagle3(parent, target_dir).weights()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for k, v in weights.items():
            if v.is_floating_point() and v.ndim == 2:
                weights[k] = v + torch.randn(v.shape, generator=g) * v.std()
    return store.publish(store_root, version, weights, parent, {"parent": "test"})


def announce(p: store.Published) -> DrafterPublished:
    return DrafterPublished(p.version, str(p.path), p.sha256)


def config(target: Path, drafter: Path, store_root: Path, engine: str = "vllm-server", **swap) -> DviConfig:
    sw = {"store": str(store_root), "initial": "none", "window_tokens": 10**9, **swap}
    return DviConfig(model=ModelConfig(target=str(target), drafter=str(drafter), dtype="float32"),
                     serve=ServeConfig(engine=engine, spec=SpecConfig(k=3, adaptive=False), max_batch=4, swap=SwapConfig(**sw),
                                       metrics_every_s=3600, plot_every_s=3600),
                     tracking=TrackingConfig(enabled=False))


class Core:
    """What VllmEngine reads of vLLM's engine core, with a worker that keeps the weights it is handed."""

    def __init__(self, method: str):
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.step_fn = lambda: ({}, False)
        self.scheduler = type("Scheduler", (), {"requests": {}, "running": [], "waiting": []})()
        spec = type("Spec", (), {"method": method, "num_speculative_tokens": 3})()
        sched = type("Sched", (), {"max_num_seqs": 4})()
        model = type("Model", (), {"max_model_len": 256})()
        self.vllm_config = type("Config", (), {"speculative_config": spec, "scheduler_config": sched, "model_config": model})()

    def collective_rpc(self, name, args=()):
        if name == "dvi_load_drafter":
            assert args[1:] == (True,)  # an EAGLE-3 drafter's tensors
            self.loaded.append(dict(args[0]))
            return [0.0]
        return [[]] if name == "dvi_take" else [None]


def test_the_configured_pair_gives_an_eagle3_drafter_and_vllm_is_told_method_eagle3(tiny_dirs, eagle3_dir, tmp_path):
    assert drafter_kind(eagle3_dir) == EAGLE3 and drafter_kind(tiny_dirs[1]) == LAYERS
    cfg = config(tiny_dirs[0], eagle3_dir, tmp_path / "store")
    pair = resolve_pair(cfg.model, target_weights=False)
    assert isinstance(pair.drafter, Eagle3Drafter) and pair.drafter.kind == EAGLE3 and pair.drafter.version == "e0000"
    target = load_causal_lm(tiny_dirs[0], "target")
    assert torch.equal(pair.drafter.embed_tokens.weight, target.get_input_embeddings().weight)  # the target's, from its files
    layered = resolve_pair(config(tiny_dirs[0], tiny_dirs[1], tmp_path / "store").model, target_weights=False)
    assert isinstance(layered.drafter, Drafter) and layered.drafter.kind == LAYERS
    assert Drafter(model=pair.drafter, version="e0000").kind == EAGLE3  # a Drafter holding one is of its kind

    def speculative(drafter: Path) -> dict:
        cmd = vllm_server.command(cfg, tiny_dirs[0], drafter, "float32")
        return json.loads(cmd[cmd.index("--speculative-config") + 1])

    assert speculative(eagle3_dir) == {"method": "eagle3", "model": str(eagle3_dir), "num_speculative_tokens": 3}
    assert speculative(tiny_dirs[1])["method"] == "draft_model"


def test_a_replica_on_dvis_own_engine_drafts_with_eagle3_versions_and_rolls_them_back(tiny_dirs, eagle3_dir, tmp_path):
    store_root = tmp_path / "store"
    noisy = publish(store_root, eagle3_dir, tiny_dirs[0], "e0001", seed=1)
    cfg = config(tiny_dirs[0], eagle3_dir, store_root, engine="dvi")
    service = Replica(cfg, resolve_pair(cfg.model))
    engine = service.engine
    assert isinstance(engine, SpeculativeEngine) and engine.drafter.version == "e0000"
    plain = SpeculativeEngine(engine.target, None, SpecConfig())
    prompt = Request([1, 504, 3458, 282, 4371, 314], max_new_tokens=12, ignore_eos=True)

    service.on_control(announce(noisy))
    assert engine.drafter.version == "e0001" and service.rollout is not None
    answer = engine.generate([prompt])[0]
    assert answer.drafter_versions == ["e0001"] and answer.stats.drafted > 0
    assert answer.token_ids == plain.generate([prompt])[0].token_ids
    layer = store.publish(store_root, "e0002", load_causal_lm(tiny_dirs[1], "drafter").state_dict(), tiny_dirs[1], {"parent": "test"})
    with pytest.raises(DviError, match="is a layer drafter, not an EAGLE-3 drafter"):
        service._load(announce(layer))
    service.on_control(DrafterRejected("e0001", "elsewhere", reason="test"))
    assert engine.drafter.version == "e0000" and "e0001" in service.rejected
    assert engine.generate([prompt])[0].drafter_versions == ["e0000"]


def test_eagle3_versions_swap_into_vllms_draft_model_and_the_other_kind_is_refused(tiny_dirs, eagle3_dir, tmp_path):
    store_root = tmp_path / "store"
    noisy = publish(store_root, eagle3_dir, tiny_dirs[0], "e0001", seed=1)
    cfg = config(tiny_dirs[0], eagle3_dir, store_root)
    pair = resolve_pair(cfg.model, target_weights=False)
    core = Core("eagle3")
    service = Replica(cfg, pair, engine=VllmEngine.attach(core, pair.target, pair.drafter, cfg.serve.spec))
    engine = service.engine

    service.on_control(announce(noisy))
    assert engine.drafter.version == "e0001" and service.metrics.version == "e0001" and service.rollout is not None
    assert not core.loaded  # loaded between two steps of vLLM's, not on the swap thread
    core.step_fn()
    weights = core.loaded[-1]
    ref = load_eagle3(noisy.path, tiny_dirs[0]).weights()
    assert set(weights) == set(ref) and not any(k.startswith("embed_tokens") for k in weights)  # the embedding is the target's
    assert {k for k in weights if k.startswith("midlayer.")} and {"fc.weight", "norm.weight", "lm_head.weight", "d2t"} <= set(weights)
    assert weights["d2t"].dtype == torch.int64 and all(torch.equal(weights[k], v) for k, v in ref.items())

    layer = store.publish(store_root, "e0002", load_causal_lm(tiny_dirs[1], "drafter").state_dict(), tiny_dirs[1], {"parent": "test"})
    other = store_root.parent / "other"  # a drafter over other aux layers: vLLM feeds its draft model layers 0 and 1
    build_eagle3(tiny_dirs[0], other, vocab_n=256, texts=TEXTS, layer_ids=(1,))
    moved = publish(store_root, other, tiny_dirs[0], "e0003")
    for p, why in ((layer, "is a layer drafter, not an EAGLE-3 drafter"), (moved, "aux layers")):
        service.on_control(announce(p))
        assert service.metrics.events["refused:load"] >= 1 and engine.drafter.version == "e0001"
        with pytest.raises(DviError, match=why):
            service._load(announce(p)) if p is layer else engine.check_drafter(load_eagle3(p.path, tiny_dirs[0]))
    assert service.metrics.events["refused:load"] == 2

    # a rollback (here announced by another replica) puts the previous weights back in
    service.on_control(DrafterRejected("e0001", "elsewhere", reason="test"))
    assert engine.drafter.version == "e0000" and "e0001" in service.rejected
    core.step_fn()
    first = load_eagle3(eagle3_dir, tiny_dirs[0]).weights()
    assert all(torch.equal(core.loaded[-1][k], v) for k, v in first.items())


def test_a_vllm_engine_started_with_one_kind_takes_no_drafter_of_the_other(tiny_dirs, eagle3_dir):
    from dvi.models import target_skeleton

    target = target_skeleton(tiny_dirs[0])
    layered = load_drafter(tiny_dirs[1], int(target.config.vocab_size))
    eagle = load_eagle3(eagle3_dir, tiny_dirs[0])
    engine = VllmEngine.attach(Core("eagle3"), target, eagle, SpecConfig(k=3, adaptive=False))
    with pytest.raises(DviError, match="is a layer drafter; this vLLM engine was started with an EAGLE-3 drafter"):
        engine.swap_drafter(layered)
    moved = load_eagle3(eagle3_dir, tiny_dirs[0])
    moved.layer_ids = (1, 2)  # the same shapes over other layers of the target's
    with pytest.raises(DviError, match=r"aux layers \[1, 2\]"):
        engine.swap_drafter(moved)
    engine.swap_drafter(load_eagle3(eagle3_dir, tiny_dirs[0]))
    engine.swap_drafter(Drafter(model=load_eagle3(eagle3_dir, tiny_dirs[0]), version="held"))  # held by a Drafter too
    engine = VllmEngine.attach(Core("draft_model"), target, layered, SpecConfig(k=3, adaptive=False))
    with pytest.raises(DviError, match="is an EAGLE-3 drafter; this vLLM engine was started with a layer drafter"):
        engine.check_drafter(eagle)
    with pytest.raises(DviError, match="drafts with method draft_model"):  # vLLM's own server started otherwise
        VllmEngine.attach(Core("draft_model"), target, eagle, SpecConfig(k=3, adaptive=False))


def test_vllms_engine_refuses_what_vllm_cannot_take_and_the_current_drafter_keeps_serving(tiny_dirs, tmp_path):
    """A replica following vLLM's engine with a layer drafter (one layer): a published version of another shape (the
    target's two layers) is refused (`load`) and the configured drafter keeps serving, nothing loaded into vLLM; the
    drafter cannot be dropped while serving; a request vLLM would refuse (a temperature over vLLM's limit, a prompt
    beyond vLLM's context window) fails with the reason."""
    from replica_fixtures import publish_noisy

    store_root = tmp_path / "store"
    whole = publish_noisy(store_root, tiny_dirs[0], "d0001", noise=0.05, seed=1)
    cfg = config(tiny_dirs[0], tiny_dirs[1], store_root)
    pair = resolve_pair(cfg.model, target_weights=False)
    core = Core("draft_model")
    service = Replica(cfg, pair, engine=VllmEngine.attach(core, pair.target, pair.drafter, cfg.serve.spec))
    engine = service.engine
    assert service.health()["engine"] == "vllm" and engine.drafter.version == "init-L1-full"

    service.on_control(announce(whole))
    assert engine.drafter.version == "init-L1-full" and service.rollout is None and service.metrics.events["refused:load"] == 1
    with pytest.raises(DviError, match="has 2 layers and other shapes than the draft model vLLM was started with"):
        engine.check_drafter(load_drafter(whole.path, engine.vocab_size))
    core.step_fn()
    assert not core.loaded  # vLLM's draft model keeps the configured weights
    with pytest.raises(DviError, match="cannot drop its drafter"):
        engine.swap_drafter(None)
    assert engine.drafter.version == "init-L1-full"

    engine.check_request(Request([1, 2, 3], temperature=2.0))  # vLLM's limit itself: taken
    with pytest.raises(DviError, match=r"temperature must be in \[0, 2\] on vLLM's engine \(vLLM's limit\), got 2.5"):
        engine.check_request(Request([1, 2, 3], temperature=2.5))
    with pytest.raises(DviError, match=r"prompt of 256 tokens does not fit the context window \(serve.vllm.max_model_len\) of 256"):
        engine.check_request(Request([1] * 256))


def test_the_workers_reload_warns_of_no_layer_an_eagle3_checkpoint_leaves_to_the_target():
    from dvi.cli.vllm.worker import EAGLE3_NOT_LOADED, _NotLoaded

    quiet = _NotLoaded(EAGLE3_NOT_LOADED)

    def record(layer: str) -> logging.LogRecord:
        return logging.LogRecord("vllm", logging.WARNING, "layerwise.py", 266, "%s: Failed to load weights", (layer,), None)

    assert not quiet.filter(record("VocabParallelEmbedding")) and not quiet.filter(record("RotaryEmbedding"))
    assert quiet.filter(record("QKVParallelLinear"))  # a layer the checkpoint should have loaded: still said
