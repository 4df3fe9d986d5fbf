"""The trainer end to end with an EAGLE-3 drafter: records from a file, DeepSpeed (CPU, gloo), the gate, the model
store, the servers' checks on what it published, and a restart that resumes from its checkpoint.

The target is the tiny random Llama with the demo tokenizer (tests/conftest.py: tiny_dirs); its records come from
the real engine, target-only (no drafter drafted them), carrying the target's features of the layers the drafter
reads, as a replica serving an EAGLE-3 drafter sends them: the trainer trains on those and never loads the target
(trainer.features auto), or recomputes them with its own copy (trainer.features=recompute). The EAGLE-3 drafter
starts as the target's last layer over its features (`dvi.eagle3.init_from_target`), its draft vocabulary the ids the
records' teachers use most, so it predicts the token one behind the teacher's until training moves it on."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from broker_fixtures import chat_records, engine_records

from dvi import store
from dvi.config import DviConfig, ModelConfig, TrackingConfig, TrainerConfig
from dvi.control import DrafterPublished
from dvi.eagle3 import Eagle3Drafter, init_from_target, layer_config, save_eagle3
from dvi.models import EAGLE3, load_causal_lm, load_tokenizer
from dvi.swap import load_announced
from trainers import anchor
from trainers.data import FileSource, collate, example_from_record
from trainers.gate import teacher_for
from trainers.recipe import Trainer
from trainers.students import Eagle3PositionLM, ttt_position_loss

pytestmark = pytest.mark.slow

VOCAB = 49152
DRAFT = 256
STEPS = 12


LAYERS = (0, 1)  # the drafter's aux layers of the 2-layer tiny target


@pytest.fixture(scope="module")
def records(tiny_dirs) -> list:
    return engine_records(tiny_dirs[0], None, n=16, new_tokens=24, seed=11, features_layers=LAYERS)


@pytest.fixture(scope="module")
def eagle3_dir(tiny_dirs, records, tmp_path_factory) -> Path:
    target_dir = tiny_dirs[0]
    target = load_causal_lm(target_dir, "target")
    used = Counter(int(i) for r in records for rnd in r.rounds for row in rnd.topk_ids for i in row)
    vocab = torch.tensor(sorted(i for i, _ in used.most_common(DRAFT)))
    assert vocab.numel() == DRAFT
    drafter = Eagle3Drafter(layer_config(target.config), DRAFT, LAYERS, target.get_input_embeddings().weight.detach())
    init_from_target(drafter, target, vocab)
    return save_eagle3(drafter, tmp_path_factory.mktemp("eagle3") / "e3", target_dir,
                       {"version": "e3-init", "parent": None}, load_tokenizer(target_dir))


def config(tiny_dirs, eagle3_dir: Path, tmp_path: Path, **trainer) -> DviConfig:
    t = dict(run_dir=str(tmp_path / "run"), store=str(tmp_path / "store"), batch_tokens=96, replay_share=0.0,
             holdout_share=0.25, holdout_first=4, gate_min_records=4, min_gain=-1.0, gate_every=1000, gate_every_s=None,
             checkpoint_every=5, max_steps=STEPS, replay_when_idle=True, idle_exit_s=None, lr=3e-3, teacher="topk",
             eagle3_ttt_steps=3, log_every=1)
    t.update(trainer)
    return DviConfig(model=ModelConfig(target=str(tiny_dirs[0]), drafter=str(eagle3_dir), device="cpu"),
                     trainer=TrainerConfig(**t), tracking=TrackingConfig(enabled=False))


def test_an_eagle3_drafter_trains_passes_the_gate_publishes_for_vllm_and_resumes(tiny_dirs, records, eagle3_dir, tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    cfg = config(tiny_dirs, eagle3_dir, tmp_path)
    tracker = Recorder()
    trainer = Trainer(cfg, FileSource(str(path)), tracker=tracker, offline=True)
    # the records carry the drafter's features: the trainer holds no copy of the target, and reads the target's
    # embedding alone (the drafter shares it)
    assert trainer.kind.name == EAGLE3 and trainer.kind.reads_features and trainer.teacher_lm is None and trainer.target is None and trainer.features_target is None
    assert trainer.student.module.target is None and trainer.embed is not None
    assert isinstance(trainer.student.module, Eagle3PositionLM) and isinstance(trainer.baseline, Eagle3PositionLM)
    assert all(k.startswith("model.") for k in trainer.student.module.state_dict())
    assert trainer.vocab_map.numel() == DRAFT
    examples = [example_from_record(r, cfg.trainer.max_seq_len) for r in records]
    before = fixed_loss(trainer, examples)
    counters = trainer.run()
    after = fixed_loss(trainer, examples)

    assert trainer.state.step == STEPS and counters.nonfinite == 0 and counters.trained > 0
    assert counters.with_features == counters.records and counters.no_features == 0
    gate = trainer.last_gate
    print(f"loss over all records {before:.3f} -> {after:.3f}; held-out acceptance as served: serving "
          f"{gate['serving_acceptance']:.4f}, candidate {gate['candidate_acceptance']:.4f} on {gate['holdout_records']} records")
    assert after < 0.9 * before
    assert len([m for m in tracker.metrics if "loss" in m]) == STEPS
    assert {"train/acceptance", "train/acceptance_step1", "train/acceptance_step2"} <= set(tracker.metrics[0])
    assert gate["outcome"] == "passed" and trainer.state.counters.gates == 1  # min_gain -1: about the pipeline, not the gate
    assert counters.published == 1 and len(trainer.published) == 1
    version = trainer.published[0]
    root = Path(cfg.trainer.store)
    where = root / version
    assert trainer.state.serving_dir == str(where) and trainer.state.lineage == ["e3-init", version]

    # what vLLM reads, passing the servers' checks under the digest a DrafterPublished carries
    assert sorted(f.name for f in where.iterdir()) == sorted(
        ["SHA256SUMS", "config.json", "dvi_drafter.json", "model.safetensors", *[f.name for f in eagle3_dir.iterdir()
                                                                                 if f.name.startswith(("tokenizer", "special_tokens", "chat_template"))]])
    meta = json.loads((where / "dvi_drafter.json").read_text())
    assert meta["kind"] == "eagle3" and meta["parent"] == "e3-init" and meta["step"] == STEPS
    target = load_causal_lm(tiny_dirs[0], "target")
    from dvi.files import sha256_file
    served = load_announced(DrafterPublished(version, str(where), sha256_file(where / store.SUMS)), root, target, kind="eagle3")
    trained = trainer.student.module.model.weights()
    assert all(torch.equal(v, trained[k]) for k, v in served.weights().items())
    # the gate's next baseline is the published version, reloaded from the store
    assert torch.equal(trainer.baseline.model.fc.weight, trained["fc.weight"])

    # registered like any version: its store directory, under its version name
    assert tracker.registered == [(str(where), version)]

    # a restart resumes from the last checkpoint: step, lineage and the trained weights, recomputing the features with
    # its own copy of the target this time (trainer.features=recompute; fp32: the target itself gives them)
    again = Trainer(replace_steps(cfg, STEPS, features="recompute", features_dtype="float32"), FileSource(str(path)), offline=True)
    assert again.target is not None and again.features_target is again.target and not again.takes_features
    assert again.kind.name == EAGLE3 and again.state.step == STEPS and again.state.lineage == ["e3-init", version]
    assert again.state.serving_dir == str(where)
    resumed = again.student.module.model.weights()
    assert all(torch.equal(v, trained[k]) for k, v in resumed.items())
    assert torch.equal(again.baseline.model.lm_head.weight, trained["lm_head.weight"])
    # reading the same file again (every record is in its ledger by now), it puts what it trained back into replay and
    # what it held out back into the gate's set, so its epochs go on where they stopped (`dvi drafter bootstrap` resumed)
    again.ingest(again.source.poll(0.0, max_records=10**6))
    assert again.state.counters.duplicates == len(records) and not again.buffer.pending
    assert len(again.buffer.replay) == counters.trained and len(again.buffer.holdout) == counters.held_out > 0
    again.step()
    assert again.state.step == STEPS + 1


class Recorder:
    """The tracker's interface, keeping what the trainer sends it."""

    def __init__(self):
        self.metrics, self.registered = [], []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.metrics.append(dict(metrics))

    def register_drafter(self, source: str, version: str, tags: dict, alias: str = "candidate") -> None:
        self.registered.append((source, version))


def test_features_from_records_are_the_ones_the_trainer_would_recompute(tiny_dirs, records, eagle3_dir, tmp_path):
    """The loss over records' features (serving's, bf16 on the wire) against the trainer's own recomputation of them
    (its copy of the target in fp32): the same within bf16's rounding. Records without features are skipped and
    counted by a trainer without the target (trainer.features=records), and recomputed by one with it (auto)."""
    from dataclasses import replace

    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    recompute = Trainer(config(tiny_dirs, eagle3_dir, tmp_path, features="recompute", features_dtype="float32"),
                        FileSource(str(path)), offline=True)
    with_features = [example_from_record(r, 512) for r in records]
    without = [example_from_record(r, 512, features=False) for r in records]
    assert all(e.features is not None for e in with_features) and all(e.features is None for e in without)
    assert fixed_loss(recompute, with_features) == pytest.approx(fixed_loss(recompute, without), rel=0.02)
    bare = [replace(r, features=None) for r in records[:6]]
    bare_path = tmp_path / "bare.jsonl"
    bare_path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in bare))
    strict = Trainer(config(tiny_dirs, eagle3_dir, tmp_path / "strict", features="records"), FileSource(str(bare_path)), offline=True)
    strict.ingest(strict.source.poll(0.0))
    c = strict.state.counters
    assert (c.records, c.no_features, c.skipped, len(strict.buffer.pending), len(strict.buffer.holdout)) == (6, 6, 6, 0, 0)
    assert strict.ledger.entries() and all(fate == "s" for _, fate in strict.ledger.entries())
    auto = Trainer(config(tiny_dirs, eagle3_dir, tmp_path / "auto", teacher="logits"), FileSource(str(bare_path)), offline=True)
    auto.ingest(auto.source.poll(0.0))
    assert auto.target is not None and auto.state.counters.no_features == 0 and auto.state.counters.records == 6


def test_the_gate_keeps_the_bootstraps_held_out_slice_beside_live_traffic(tiny_dirs, records, eagle3_dir, tmp_path):
    """A held-out slice of bootstrap records (trainer.anchor, written without features as a bootstrap writes it): the
    trainer, holding no copy of the target, computes their features once with a copy loaded for that alone (the
    features serving sends), and evaluates the drafter it started from on them; a candidate's figures on the slice go
    into the gate's metrics and the published version beside the live ones, and a candidate more than
    trainer.anchor_max_drop below the start figure is refused, whatever it gains on live traffic."""
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records[4:]))
    sliced = [replace(r, domain=d, features=None) for r, d in zip(records[:4], ("code", "code", "prose", "prose"), strict=True)]
    kept_at = tmp_path / "e3.heldout.jsonl.gz"
    anchor.write(sliced, kept_at)
    tracker = Recorder()
    cfg = config(tiny_dirs, eagle3_dir, tmp_path, max_steps=3, anchor=str(kept_at), anchor_max_drop=1.0, features_dtype="float32")
    trainer = Trainer(cfg, FileSource(str(path)), tracker=tracker, offline=True)
    kept = trainer.anchor
    assert kept is not None and len(kept.examples) == 4 and kept.domains == ["code", "code", "prose", "prose"]
    assert not kept.start and all(e.features is None for e in kept.examples)  # computed when a gate first needs them

    trainer.run()
    assert trainer.target is None and trainer.features_target is None  # the copy that computed the slice's features is gone
    for mine, r in zip(kept.examples, records[:4], strict=True):
        theirs = example_from_record(r, cfg.trainer.max_seq_len).features  # serving's, as the record carried them
        assert mine.features.start == 0 and mine.features.rows == len(mine.tokens) - 1
        assert torch.allclose(mine.features.tensor()[theirs.start : theirs.end].float(), theirs.tensor().float(), atol=0.05, rtol=0.02)
    assert set(kept.start) == {"all", "code", "prose"} and 0.0 <= kept.start["all"]["realized"] <= 1.0
    gate = trainer.last_gate
    assert gate["outcome"] == "passed" and gate["anchor_start"] == kept.start["all"]["realized"]
    assert {"anchor_acceptance", "anchor_expected", "anchor_code", "anchor_prose"} <= set(gate)
    assert any("gate/anchor_acceptance" in m for m in tracker.metrics)
    version = trainer.published[-1]
    meta = json.loads((Path(cfg.trainer.store) / version / "dvi_drafter.json").read_text())
    assert meta["gate"]["anchor_acceptance"] == gate["anchor_acceptance"]

    # a start figure no candidate reaches, and no drop allowed: refused, though it gains on live traffic (min_gain -1)
    trainer.tcfg = replace(trainer.tcfg, anchor_max_drop=0.0)
    kept.start["all"]["realized"] = 1.01
    refused = trainer.state.counters.refused
    assert not trainer.gate_and_publish(why="test")
    assert trainer.last_gate["outcome"] == "refused" and trainer.state.counters.refused == refused + 1
    assert trainer.published == [version] and trainer.state.lineage[-1] == version


def fixed_loss(trainer: Trainer, examples) -> float:
    """The student's training loss (unrolled steps, divergence only) over every position of `examples`."""
    batch = collate(examples)
    teacher = teacher_for(batch, VOCAB, trainer.vocab_map, None)  # the examples' top-k
    with torch.no_grad():
        return float(ttt_position_loss(trainer.student.module, batch, teacher, 3, "fkl", 1.0, 0.0, 0.5, trainer.vocab_map)[0])


def replace_steps(cfg: DviConfig, steps: int, **trainer) -> DviConfig:
    from dataclasses import replace

    return replace(cfg, trainer=replace(cfg.trainer, max_steps=steps, **trainer))


@pytest.mark.real_model
def test_training_an_eagle3_drafter_on_demo_records_raises_held_out_acceptance(demo_target_dir, tmp_path):
    """The demo target's records of one domain (Python questions, target-only), an EAGLE-3 drafter built from the
    target (`build_eagle3`: at first it repeats the target's last prediction): a short run raises its expected
    acceptance on held-out records of that domain, as the gate measures it."""
    from dvi.eagle3 import build_eagle3, default_layer_ids

    tokenizer = load_tokenizer(demo_target_dir)
    target = load_causal_lm(demo_target_dir, "target")
    demo = chat_records(target, None, tokenizer, features_layers=default_layer_ids(target.config.num_hidden_layers))
    texts = [tokenizer.decode(list(r.prompt_ids) + list(r.generated_ids)) for r in demo]
    drafter_dir = build_eagle3(demo_target_dir, tmp_path / "e3", vocab_n=2048, texts=texts)
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in demo))
    cfg = config((demo_target_dir, None), drafter_dir, tmp_path, batch_tokens=128, replay_share=0.5, holdout_first=3,
                 gate_min_records=3, min_gain=0.02, lr=1e-3, max_steps=24, checkpoint_every=1000)
    trainer = Trainer(replace_model(cfg, threads=2), FileSource(str(path)), offline=True)
    trainer.run()  # the gate at its end: the trained candidate against the drafter it started from, on held-out records
    gate = trainer.last_gate
    assert trainer.state.step == 24 and gate["holdout_records"] >= 3
    print(f"held-out acceptance as served {gate['serving_acceptance']:.3f} -> {gate['candidate_acceptance']:.3f}, "
          f"greedy match {gate['serving_greedy']:.3f} -> {gate['candidate_greedy']:.3f}")
    assert gate["outcome"] == "passed" and trainer.published  # more than min_gain better


def replace_model(cfg: DviConfig, **model) -> DviConfig:
    from dataclasses import replace

    return replace(cfg, model=replace(cfg.model, **model))
