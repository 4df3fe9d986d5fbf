"""What a record the trainer reads is to it: of no use (foreign), an example, and what that example lacks to train.

`Intake` holds what the trainer was set up with (its target's vocabulary, the drafter's kind and feature layers,
whether it has a copy of the target to compute features or as the teacher) and answers, per record:

- `foreign`: why a valid record is of no use to this trainer (another target vocabulary, no generated tokens), or None;
- `example`: the record as a `trainers.data.Example`, keeping the target's features it carries only where the drafter
  reads them (its layers, the target's width) and the trainer takes them (`trainer.features`);
- `lacks`: the counter of what an example lacks to train (`no_features`, `no_teacher`), or None: it can train.

What it cannot take it says on the trainer's logger, at most once a minute. This module knows records and what the
trainer has; it does not know the trainer's queues, ledger or offsets (`trainers.recipe` routes what it takes), nor
models.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from dvi.records import DecisionRecord
from trainers.data import Example, example_from_record

log = logging.getLogger("dvi.trainer")


@dataclass
class Intake:
    vocab_size: int  # the target's: a record for another vocabulary is foreign
    max_seq_len: int  # trainer.max_seq_len
    reward_penalty: float  # trainer.reward_penalty
    reads_features: bool = False  # the drafter drafts from the target's features (`StudentKind.reads_features`)
    takes_features: bool = False  # the records' features are taken (trainer.features records or auto)
    layer_ids: tuple[int, ...] = ()  # the target's layers the drafter reads
    feature_width: int = 0  # their values a token
    computes_features: bool = False  # the trainer has a copy of the target to compute the drafter's features
    has_teacher: bool = False  # the trainer has a copy of the target as the teacher of records without top-k
    logged_at: float = -math.inf  # when it last said what it could not take

    def foreign(self, record: DecisionRecord) -> str | None:
        """Why a valid record is of no use to this trainer (another target vocabulary, no generated tokens), or None."""
        if record.target.vocab_size != self.vocab_size:
            return f"target.vocab_size: record says {record.target.vocab_size}, this trainer's target has {self.vocab_size}"
        if not record.generated_ids:
            return "generated_ids: empty"
        return None

    def example(self, record: DecisionRecord) -> Example:
        """The record as an `Example`, keeping its features where the drafter reads them (its layers, the target's
        width) and the trainer takes them (trainer.features)."""
        f = record.features
        fits = self.takes_features and f is not None and f.layers == self.layer_ids and f.width == self.feature_width
        if f is not None and self.takes_features and not fits and time.monotonic() - self.logged_at >= 60.0:
            self.logged_at = time.monotonic()
            log.warning("record %s carries features of layers %s (%d values a token); the drafter reads layers %s (%d): "
                        "not taken", record.record_id, list(f.layers), f.width, list(self.layer_ids), self.feature_width)
        return example_from_record(record, self.max_seq_len, self.reward_penalty, features=fits)

    def lacks(self, example: Example) -> str | None:
        """The counter of what a record lacks for this trainer (features, a teacher), or None: it can train."""
        if self.reads_features and example.features is None and not self.computes_features:
            self._say_unusable("carry no features an EAGLE-3 drafter reads and the trainer has no copy of the target "
                               "(trainer.features=recompute loads one; serving sends them: stream.features.share)")
            return "no_features"
        if example.topk_ids is None and not self.has_teacher:
            self._say_unusable("carry no teacher log-probs (stream.topk=0) and the trainer has no copy of the target "
                               "(trainer.teacher=logits, or trainer.features=recompute with trainer.teacher=auto, loads one)")
            return "no_teacher"
        return None

    def _say_unusable(self, why: str) -> None:
        if time.monotonic() - self.logged_at >= 60.0:
            self.logged_at = time.monotonic()
            log.warning("records skipped: they %s", why)
