"""How an MTP head learns: FastMTP's recursive unroll against the target's distribution.

Step 0 reads the target's final state at each position t with the token t+1 and predicts token
t+2; step k reads step k-1's (recycled) output at t with the token t+1+k and predicts t+2+k, at
rotary position t+k, where the chain drafter runs it (`head.step_positions=anchor`: at t, as
speculators trains it). Every step runs the whole row, causally
(speculators' and FastMTP's unroll: a step's keys are its own step's states, where the decoder's
cache holds step 0's for the verified context). The loss of step k weighs beta**k / sum_j
beta**j (FastMTP's Eq. 2, speculators' `compute_step_weights`), each the `objective`'s mean over
the trained rows against the target's distribution at that token (the target's lm_head over its
stored final state, one position earlier). Only the MTP layer trains: the embedding and lm_head
are the target's, frozen.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from data_prep.states.capture import document_mask
from heads.mtp.model import MtpHead
from trainer.decoding.drafters import Shape
from trainer.decoding.mtp import MtpDrafter
from trainer.objective import CROSS_ENTROPY, Objective
from trainer.trainee import (
    FP32,
    LABEL_INDEX,
    LABEL_POSITION,
    HeadTrainee,
    RowSizes,
    indexed,
    label_batch_index,
    position_ids,
    shift_left,
)


def step_weights(beta: float, steps: int) -> list[float]:
    """beta**k / sum_j beta**j for k = 0..steps-1."""
    raw = [beta**k for k in range(steps)]
    return [w / sum(raw) for w in raw]


class MtpTrainee(HeadTrainee, nn.Module):
    frozen_tables = ("head.embed_tokens.weight", "head.lm_head.weight")

    def __init__(
        self, head: MtpHead, num_steps: int, beta: float, objective: Objective = CROSS_ENTROPY,
        drafted_positions: bool = True,
    ):
        super().__init__()
        self.head, self.num_steps, self.objective = head, num_steps, objective
        self.drafted_positions = drafted_positions  # step k at t + k (vLLM's), else at t (speculators')
        self.weights = step_weights(beta, num_steps)
        self.batch_index = partial(label_batch_index, prompt_weight=objective.prompt_weight)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loss and per-step sums (`correct[k]`/`total[k]`: the step's top-1 equals the target's
        at answer rows), as `Eagle3Trainee.forward` reports them."""
        batch = indexed(batch, self.batch_index)
        ids, labels, at = batch["input_ids"], batch[LABEL_INDEX], batch[LABEL_POSITION]
        final = batch["final_hidden"]
        places = position_ids(batch)
        mask = document_mask(places) if "position_ids" in batch else None
        head = self.head
        with torch.no_grad():  # the target's distribution for the token at u: computed at u-1
            before = final.flatten(0, 1).index_select(0, (labels - 1).clamp(min=0))
            teacher_p = F.softmax(head.lm_head(before.to(head.lm_head.weight.dtype)).float(), dim=-1)
            teacher_top = teacher_p.argmax(-1)
        answer = batch["loss_mask"].flatten().index_select(0, labels)
        weight = self.objective.row_weights(answer)
        loss = teacher_p.new_zeros(())
        correct, total = teacher_p.new_zeros(self.num_steps), teacher_p.new_zeros(self.num_steps)
        hidden = final.to(head.eh_proj.weight.dtype)
        for k in range(self.num_steps):
            at_k = places + k if self.drafted_positions else places
            hidden, out = head.layer(hidden, shift_left(ids, 1 + k, 0), at_k, mask)
            counted = at >= 2 + k  # label j is predicted at step k from row j-2-k of its own sample
            rows = (labels - 2 - k).clamp(min=0)
            logits = head.logits(out.flatten(0, 1).index_select(0, rows))
            term, correct[k] = self.objective.step_term(logits, teacher_p, teacher_top, counted, weight,
                                                        answer)
            loss = loss + self.weights[k] * term
            total[k] = (counted & answer).sum()
        return {"loss": loss, "correct": correct, "total": total}

    def drafter(self, target) -> tuple[MtpDrafter, object]:
        return MtpDrafter(self.head), target


def mtp_activations(cfg, rows: RowSizes) -> int:
    """Bytes an MTP step keeps per token, an estimate: the final state (float32), then per step
    the layer and the float32 probabilities over the full vocabulary, and the teacher's once."""
    return FP32 * rows.hidden + cfg.head.num_steps * (rows.layer + FP32 * rows.vocab) + FP32 * rows.vocab


def build_mtp_trainee(cfg, target, data_dir: Path | None) -> MtpTrainee:
    """The target's MTP layer as a trainee (`head.init`: its shipped weights or a fresh init)."""
    head = MtpHead.from_target(target, cfg.target.name_or_path, cfg.head)
    objective = Objective.from_config(cfg.head)
    drafted = cfg.head.step_positions == "drafted"
    return MtpTrainee(head, cfg.head.num_steps, cfg.head.step_weight_beta, objective, drafted)


def mtp_drafter(head: MtpHead, target, shapes: Sequence[Shape] = ()) -> MtpDrafter:
    return MtpDrafter(head)
