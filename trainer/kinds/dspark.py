"""How a DSpark head learns: DFlash's blocks and loss (`trainer.kinds.dflash`), on logits that
carry the Markov bias of the token before each label (the data's token, teacher-forced as the
peers train it: at inference it is the token drawn at the slot before), plus the confidence
head's BCE against each slot's overlap with the target, sum min(q, p) = 1 - TV(q, p), detached,
weighted as the slots are (speculators `models/dspark`, SpecForge `dflash_family_model.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from heads.dspark.model import DSparkHead
from trainer.decoding.drafters import Shape
from trainer.decoding.dspark import DSparkDrafter
from trainer.kinds.dflash import DFlashTrainee, Slots, build_dflash_trainee, dflash_drafter
from trainer.objective import weighted_mean


class DSparkTrainee(DFlashTrainee):
    drafter_class = DSparkDrafter

    def __init__(self, *args, confidence_weight: float = 1.0, **kw):
        super().__init__(*args, **kw)
        self.confidence_weight = confidence_weight

    def draft_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.head.biased_logits(hidden, prev)

    def loss(self, slots: Slots) -> torch.Tensor:
        loss = super().loss(slots)
        if self.head.confidence_head is None or not self.confidence_weight:
            return loss
        with torch.no_grad():
            overlap = torch.minimum(slots.logq.exp(), slots.teacher_p).sum(-1).clamp(0.0, 1.0)
        logit = self.head.confidence(slots.hidden, slots.prev)
        bce = F.binary_cross_entropy_with_logits(logit, overlap, reduction="none")
        return loss + self.confidence_weight * weighted_mean(bce, slots.weight)


def build_dspark_trainee(cfg, target, data_dir: Path | None) -> DSparkTrainee:
    return build_dflash_trainee(cfg, target, data_dir, DSparkHead, DSparkTrainee,
                                confidence_weight=cfg.head.confidence_weight)


def dspark_drafter(head: DSparkHead, target, shapes: Sequence[Shape] = ()) -> DSparkDrafter:
    return dflash_drafter(head, target, shapes, DSparkDrafter)
