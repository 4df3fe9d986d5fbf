"""Student kinds: what differs, for the trainer, between the kinds of drafter it trains, behind one interface.

A `StudentKind` says, for one drafter kind (`dvi.drafter_kinds.DrafterKind`, whose name looks it up: `student_kind`):
whether the drafter drafts from the target's features (then a record's features are taken where they fit, or the
trainer's copy of the target recomputes them), what a trainer that holds no copy of the target shares of it (an
EAGLE-3 drafter's embedding), which of the target's layers it reads and how many values a token, the module the
trainer optimises for a loaded drafter (`trainers.students`), and that module's loss on a batch. Two kinds:

- layers (`LayersStudent`): a `PositionLM`, no features, the loss at one drafting step;
- eagle3 (`Eagle3Student`): an `Eagle3PositionLM` over the records' features or those its features target computes,
  the loss over `trainer.eagle3_ttt_steps` unrolled drafting steps.

What a version's files hold is the store's (`dvi.store`), which a kind's parent directory decides. This module knows
the students and their losses (`trainers.students`) and the target's features; not records, DeepSpeed, the gate,
the store or the trainer's loop (`trainers.recipe` asks it).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from dvi import eagle3
from dvi.config import TrainerConfig
from dvi.drafter_kinds import KINDS, DrafterKind
from dvi.errors import DviError
from dvi.hardware import resolve_dtype
from dvi.models import EAGLE3, LAYERS, Drafter
from trainers.data import Batch
from trainers.losses import Teacher
from trainers.students import Eagle3PositionLM, PositionLM, student_loss, zero_loss


class StudentKind(ABC):
    """The trainer's side of one drafter kind (see the module docstring)."""

    drafter: DrafterKind  # the kind of drafter it trains (its name, how messages name it)

    @property
    def name(self) -> str:
        return self.drafter.name

    @property
    def reads_features(self) -> bool:
        """The drafter drafts from the target's features (aux hidden states)."""
        return self.drafter.reads_features

    @abstractmethod
    def shared_embedding(self, target_dir: Path) -> torch.Tensor | None:
        """What the drafter shares of the target where the trainer holds no copy of it, read from `target_dir`."""

    @abstractmethod
    def features(self, drafter: Drafter) -> tuple[tuple[int, ...], int]:
        """(the target's layers whose features `drafter` reads, sorted; their values a token): ((), 0) for none."""

    @abstractmethod
    def features_target(self, target: torch.nn.Module | None, dtype: str, device: torch.device) -> torch.nn.Module | None:
        """The target that computes the drafter's features, in the dtype `dtype` names (a copy where the target's
        differs); None where it reads none or the trainer holds no copy of the target (`target` None)."""

    @abstractmethod
    def student(self, model: torch.nn.Module, features_target: torch.nn.Module | None) -> torch.nn.Module:
        """The drafter's module `model` as the trainer optimises it: answering at a batch's teacher positions."""

    @abstractmethod
    def steps(self, t: TrainerConfig) -> int:
        """How many drafting steps its loss unrolls."""

    @abstractmethod
    def zero_loss(self, student, device: torch.device, feature_width: int) -> torch.Tensor:
        """A zero loss through `student`, for a rank without a batch (`trainers.students.zero_loss`)."""

    def loss(self, student, batch: Batch, teacher: Teacher, t: TrainerConfig, w_kl: float, w_reward: float,
             vocab_map: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """A batch's training loss and metrics (`trainers.students.student_loss` over its `steps`)."""
        return student_loss(student, batch, teacher, self.steps(t), t.divergence, w_kl, w_reward, t.jsd_beta, vocab_map)


class LayersStudent(StudentKind):
    """A layer drafter: a `PositionLM` over its causal LM, no features, one drafting step."""

    drafter = KINDS[LAYERS]

    def shared_embedding(self, target_dir: Path) -> None:
        return None

    def features(self, drafter: Drafter) -> tuple[tuple[int, ...], int]:
        return (), 0

    def features_target(self, target, dtype: str, device: torch.device) -> None:
        return None

    def student(self, model: torch.nn.Module, features_target: torch.nn.Module | None) -> PositionLM:
        return PositionLM(model)

    def steps(self, t: TrainerConfig) -> int:
        return 1

    def zero_loss(self, student, device: torch.device, feature_width: int) -> torch.Tensor:
        return zero_loss(student, device, None)


class Eagle3Student(StudentKind):
    """An EAGLE-3 drafter (`dvi.eagle3`): an `Eagle3PositionLM` over the target's features, its loss unrolled over
    `trainer.eagle3_ttt_steps` drafting steps."""

    drafter = KINDS[EAGLE3]

    def shared_embedding(self, target_dir: Path) -> torch.Tensor:
        """The target's input embedding, read alone from its files."""
        return eagle3.read_target_embedding(target_dir)

    def features(self, drafter: Drafter) -> tuple[tuple[int, ...], int]:
        layer_ids = tuple(sorted(drafter.model.layer_ids))
        return layer_ids, len(layer_ids) * drafter.model.target_hidden_size

    def features_target(self, target, dtype: str, device: torch.device) -> torch.nn.Module | None:
        """In the dtype serving computes them in (`trainer.features_dtype`)."""
        if target is None:
            return None
        features_dtype = resolve_dtype(dtype, device)
        return target if features_dtype == target.dtype else copy.deepcopy(target).to(features_dtype)

    def student(self, model: torch.nn.Module, features_target: torch.nn.Module | None) -> Eagle3PositionLM:
        return Eagle3PositionLM(model, features_target)

    def steps(self, t: TrainerConfig) -> int:
        return t.eagle3_ttt_steps

    def zero_loss(self, student, device: torch.device, feature_width: int) -> torch.Tensor:
        return zero_loss(student, device, feature_width)


STUDENT_KINDS: dict[str, StudentKind] = {k.name: k for k in (LayersStudent(), Eagle3Student())}


def student_kind(name: str) -> StudentKind:
    """The student kind of the drafter kind called `name`; DviError naming the kinds the trainer trains for another."""
    try:
        return STUDENT_KINDS[name]
    except (KeyError, TypeError):
        raise DviError(f"the trainer trains no drafter of kind {name!r}: it trains {', '.join(sorted(STUDENT_KINDS))}") from None
