"""The modules the trainer optimises and their training loss: a drafter as a function of a batch's teacher positions.

- `PositionLM`: a layer drafter (a causal LM) answering only at the teacher positions;
- `Eagle3PositionLM`: an EAGLE-3 drafter (`dvi.eagle3`) the same way, from the target's features (the records' or a
  frozen copy of the target's), and unrolled over training-time-test drafting steps;
- `ttt_position_loss`: an EAGLE-3 drafter's loss over those steps (`trainers.losses.position_loss` at each);
- `student_loss`: a batch's training loss, over one step or those unrolled steps; `zero_loss`: the loss of a rank
  without a batch, which joins the others' step with a zero gradient;
- `params_finite`: whether a module's weights are all finite;
- `autocast`: the forward's precision (`trainer.precision`).

This module knows drafters' forwards and the batch layout (`trainers.data.Batch`); the maths of the loss is
`trainers.losses`'. It does not know records, DeepSpeed, the gate or the model store.
"""

from __future__ import annotations

import torch

from dvi import eagle3
from dvi.errors import DviError
from trainers.data import Batch
from trainers.losses import Teacher, position_loss


class PositionLM(torch.nn.Module):
    """A causal LM whose forward returns logits only at the teacher positions: [P, N].

    Skipping the output layer at prompt positions matters: the 576 x 49,152 head is most of the drafter's cost.
    `features` (what an EAGLE-3 drafter reads, `Eagle3PositionLM`) is taken and ignored, so that callers pass a batch
    the same way to either.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                features: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, L, H]
        return self.model.get_output_embeddings()(hidden[rows, cols])  # [P, N]


class Eagle3PositionLM(torch.nn.Module):
    """An EAGLE-3 drafter (`dvi.eagle3.Eagle3Drafter`) as a `PositionLM`: forward(input_ids, attention_mask, rows,
    cols) returns its draft-vocabulary logits [P, N] at the teacher positions, predicting the token `PositionLM`
    predicts there, so teachers, losses and the gate take it as they take a layer drafter (vocab_map: the draft
    vocabulary's target ids).

    Alignment: teacher position (row, col) predicts the token at col + 1 from the tokens up to col. An EAGLE-3
    drafter predicts it from the target's features at col - 1 and the token at col: index col - 1 of
    `dvi.eagle3.ttt_logits` (step 0: what serving's first draft after the target verified up to col sees). A
    position at col 0 has no feature before it (vLLM never drafts there: the target's prefill gives the first
    token); the drafter reads zero features there, over that one token.

    The features are the batch's (`features` [B, L, n_aux x target hidden]: serving's, carried by the records), or,
    where it has none, computed by `target`, the trainer's frozen copy of the target, run without grad on the batch
    (None: the trainer has no copy, and a batch without features is an error). The target is held outside the module
    (a plain attribute, not a submodule): DeepSpeed neither optimises nor checkpoints it.

    forward(..., steps=k) unrolls k drafting steps (training-time test): a list of (logits [P_j, N], keep [P] bool)
    per step j, at the positions it reaches (keep: col - 1 - j >= 0; step 0 keeps every position). Step j at (row,
    col) is the drafter's j-th further draft after the target verified the tokens up to col - j: its first pass at
    index col - 1 - j, then j steps each on its own previous output, the tokens col - j + 1..col teacher-forced
    (`dvi.eagle3.ttt_prenorms`); it predicts the same token col + 1. Only the indices some step reads are computed
    (`dvi.eagle3.ttt_prenorms_at`): a record's prompt costs the first pass's keys and values, not its layer."""

    def __init__(self, model: torch.nn.Module, target: torch.nn.Module | None):
        super().__init__()
        self.model = model
        object.__setattr__(self, "target", target)  # not registered: no parameter, no state_dict entry

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                steps: int | None = None, features: torch.Tensor | None = None):
        d = self.model
        if features is None:
            if self.target is None:
                raise DviError("a batch without the target's features, and no copy of the target to compute them "
                               "(trainer.features=records trains on records that carry features only)")
            features = eagle3.target_features(self.target, input_ids, d.layer_ids, attention_mask)
        feats = features.to(d.fc.weight.dtype)
        n_steps = steps or 1
        b, t = input_ids.shape
        prenorms, slots = [], None
        if t > 1:
            want = torch.zeros(b, t - 1, dtype=torch.bool, device=input_ids.device)  # the indices some step reads
            for k in range(n_steps):
                at = cols - 1 - k
                on = at >= 0
                want[rows[on], at[on]] = True
            prenorms, slots = eagle3.ttt_prenorms_at(d, feats, input_ids, want, n_steps)

        def at_step(k: int, r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:  # step k's output at index c of rows r
            return prenorms[k][r, slots[r, c]]

        first = cols == 0
        if bool(first.any()):  # the drafter alone on the first token, over zero features
            alone, _ = d.trunk(feats.new_zeros(b, 1, d.config.hidden_size), input_ids[:, :1])
            at0 = alone[rows, 0]
            chosen = at0 if not prenorms else torch.where(first[:, None], at0, at_step(0, rows, (cols - 1).clamp(min=0)))
        else:
            chosen = at_step(0, rows, cols - 1)
        out = [(d.head(chosen), torch.ones_like(cols, dtype=torch.bool))]
        for k in range(1, n_steps):
            keep = cols - 1 - k >= 0
            reached = at_step(k, rows[keep], (cols - 1 - k)[keep]) if prenorms else chosen[:0]
            out.append((d.head(reached), keep))
        return out[0][0] if steps is None else out


def ttt_position_loss(student, batch: Batch, teacher: Teacher, steps: int, divergence: str, w_kl: float, w_reward: float,
                      beta: float, vocab_map) -> tuple[torch.Tensor, dict[str, float]]:
    """An EAGLE-3 drafter's training loss: `position_loss` averaged over `steps` unrolled drafting steps
    (`Eagle3PositionLM` forward with steps), each on the teacher positions it reaches; the metrics are step 0's (what
    serving's first draft sees, as the gate measures it), with each later step's expected acceptance beside them
    (`acceptance_step<j>`)."""
    losses, metrics = [], {}
    for k, (logits, keep) in enumerate(student(batch.input_ids, batch.attention_mask, batch.rows, batch.cols, steps=steps,
                                               features=batch.features)):
        if k and not bool(keep.any()):
            continue
        loss, m = position_loss(logits, teacher.select(keep), batch.drafted[keep],
                                batch.reward[keep], batch.judged[keep], batch.weight[keep], divergence, w_kl, w_reward,
                                beta, vocab_map)
        losses.append(loss)
        if k == 0:
            metrics.update(m)
        else:
            metrics[f"acceptance_step{k}"] = m["acceptance"]
    return torch.stack(losses).mean(), metrics


def student_loss(student, batch: Batch, teacher: Teacher, steps: int, divergence: str, w_kl: float, w_reward: float,
                 beta: float, vocab_map) -> tuple[torch.Tensor, dict[str, float]]:
    """A batch's training loss and metrics: one forward and `position_loss` at its teacher positions, or over `steps` > 1
    unrolled drafting steps (an EAGLE-3 drafter's `trainer.eagle3_ttt_steps`) `ttt_position_loss`."""
    if steps > 1:
        return ttt_position_loss(student, batch, teacher, steps, divergence, w_kl, w_reward, beta, vocab_map)
    logits = student(batch.input_ids, batch.attention_mask, batch.rows, batch.cols, features=batch.features)
    return position_loss(logits, teacher, batch.drafted, batch.reward, batch.judged, batch.weight, divergence, w_kl,
                         w_reward, beta, vocab_map)


def zero_loss(student, device: torch.device, feature_width: int | None) -> torch.Tensor:
    """A zero loss through the drafter, for a rank without a batch to join the others' step with a zero gradient (every
    rank must step together). `feature_width`: an EAGLE-3 drafter's features per token; None for a layer drafter."""
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    feats = torch.zeros(1, 1, feature_width, device=device) if feature_width is not None else None
    return student(one, torch.ones_like(one), one[0], one[0], features=feats).sum() * 0.0


def params_finite(module: torch.nn.Module) -> bool:
    """Every trainable parameter finite: one reduction on the device, read once (not one device sync per tensor). A
    frozen one never moves (an EAGLE-3 drafter's copy of the target's embedding: 28M of the demo drafter's 39M weights,
    whose check took 0.15 s of each CPU step)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return not params or bool(torch.stack([torch.isfinite(p).all() for p in params]).all())


def autocast(device: torch.device, precision: str):
    """bf16-mixed: the forward's matrix products in bf16 (`torch.autocast`), the weights and their gradients fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
