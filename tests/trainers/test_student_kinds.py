"""The trainer's side of each drafter kind (`trainers.student_kinds`): one per kind dvi knows, looked up by its name,
and what each says the trainer reads, builds and optimises, on tiny random models (no files)."""

from __future__ import annotations

import pytest
import torch

from dvi.config import TrainerConfig
from dvi.drafter_kinds import KINDS
from dvi.eagle3 import Eagle3Drafter, layer_config
from dvi.errors import DviError
from dvi.models import EAGLE3, LAYERS, Drafter
from trainers.student_kinds import STUDENT_KINDS, Eagle3Student, LayersStudent, StudentKind, student_kind
from trainers.students import Eagle3PositionLM, PositionLM

DRAFT = 40


def test_every_drafter_kind_has_a_student_kind_of_its_name():
    assert sorted(STUDENT_KINDS) == sorted(KINDS) == [EAGLE3, LAYERS]
    assert all(isinstance(s, StudentKind) and student_kind(n) is s and s.drafter is KINDS[n] for n, s in STUDENT_KINDS.items())
    assert isinstance(student_kind(LAYERS), LayersStudent) and isinstance(student_kind(EAGLE3), Eagle3Student)
    assert (student_kind(LAYERS).reads_features, student_kind(EAGLE3).reads_features) == (False, True)


@pytest.mark.parametrize("name", ["medusa", "", None])
def test_a_kind_the_trainer_does_not_train_is_an_error_naming_those_it_does(name):
    with pytest.raises(DviError, match="the trainer trains no drafter of kind .*: it trains eagle3, layers"):
        student_kind(name)


def test_a_layer_drafter_reads_no_features_and_trains_as_a_position_lm_over_one_step(tiny_target, tmp_path):
    kind = student_kind(LAYERS)
    drafter = Drafter(model=tiny_target, version="v0")
    assert kind.features(drafter) == ((), 0) and kind.shared_embedding(tmp_path) is None
    assert kind.features_target(tiny_target, "float32", torch.device("cpu")) is None
    student = kind.student(tiny_target, None)
    assert isinstance(student, PositionLM) and student.model is tiny_target
    assert kind.steps(TrainerConfig(eagle3_ttt_steps=4)) == 1
    assert float(kind.zero_loss(student, torch.device("cpu"), 0)) == 0.0


def test_an_eagle3_drafter_reads_its_layers_features_from_a_target_in_the_features_dtype(tiny_target):
    kind = student_kind(EAGLE3)
    hidden = tiny_target.config.hidden_size
    model = Eagle3Drafter(layer_config(tiny_target.config), DRAFT, (2, 0, 1), tiny_target.get_input_embeddings().weight.detach())
    assert kind.features(Drafter(model=model, version="e0")) == ((0, 1, 2), 3 * hidden)  # sorted, as records carry them
    cpu = torch.device("cpu")
    assert kind.features_target(None, "float32", cpu) is None  # no copy of the target: the records' features only
    assert kind.features_target(tiny_target, "float32", cpu) is tiny_target  # its own dtype: the target itself
    copied = kind.features_target(tiny_target, "bfloat16", cpu)
    assert copied is not tiny_target and copied.dtype == torch.bfloat16 and tiny_target.dtype == torch.float32
    student = kind.student(model, tiny_target)
    assert isinstance(student, Eagle3PositionLM) and student.model is model and student.target is tiny_target
    assert kind.steps(TrainerConfig(eagle3_ttt_steps=4)) == 4
    assert float(kind.zero_loss(student, cpu, 3 * hidden)) == 0.0
