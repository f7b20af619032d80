"""How a P-EAGLE head learns: K slots per anchor in one forward, laid out as vLLM drafts them.

At anchor t (the last verified position), slot 1 is EAGLE-3's step 0: the target feature of t
with token t+1, at position t. Slot k >= 2 reads the mask token and the mask state at position
t+k-1. Slot k predicts token t+1+k against the target's distribution at t+k. Slot k attends the
verified context of its sample up to t (the slot-1 rows: what the drafter's cache holds) and
slots 2..k of its own anchor: the causal mask of vLLM's one draft forward, verified positions
then K-1 mask slots. In a one-layer draft a slot's K/V depend on its own inputs only, so the slots
are computed one after another, as EAGLE-3's unroll steps (`Eagle3Trainee.step_input` is all that
differs): the same outputs as that one forward (tests/unit/trainer/test_peagle.py holds them
equal to the drafter's), with EAGLE-3's branch attention, whose memory grows linearly in the
context where one forward's mask over every slot grows with its square.

Slot k+1 stands where EAGLE-3's unroll step k stands (same anchor, position and label), so the
labels, rows, teacher and loss are `Eagle3Trainee`'s, step k weighted `step_weight**k` as there
(the peers take one mean over all sampled rows, so slot k weighs its share of rows, ~0.7^(k-1)).
Only the inputs of slots 2..K differ, and `anchor_fraction` < 1 runs them at a seeded sample of
anchors only, to bound their cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

from heads.peagle.model import PEagleHead
from trainer.decoding.drafters import Shape
from trainer.decoding.peagle import PEagleDrafter
from trainer.kinds.eagle3 import Eagle3Trainee, draft_vocab, ttt_batch_index
from trainer.objective import CROSS_ENTROPY, Objective
from trainer.trainee import Batch


def sampled_anchors(batch: Batch, fraction: float) -> torch.Tensor | None:
    """Bool [B,T]: the anchors whose mask slots train in this batch, each kept with probability
    `fraction` (None: all). Seeded by the batch's tokens, so a batch samples the same anchors in
    any loader process and on resume, and validation stays comparable between runs."""
    if fraction >= 1:
        return None
    ids = batch["input_ids"]
    g = torch.Generator().manual_seed(int(ids.sum()) * 1_000_003 + ids.numel())
    return (torch.rand(ids.shape, generator=g) < fraction).to(ids.device)


def peagle_batch_index(batch: Batch, slots: int, prompt_weight: float, anchor_fraction: float) -> Batch:
    """`PEagleTrainee.batch_index`: EAGLE-3's index with slot k+1 as step k, over the sampled
    anchors."""
    return ttt_batch_index(batch, slots, prompt_weight, sampled_anchors(batch, anchor_fraction))


class PEagleTrainee(Eagle3Trainee):
    """`Eagle3Trainee` with the K slots of `PEagleHead` as its unroll steps (`step_input`)."""

    def __init__(
        self,
        head: PEagleHead,
        target_lm_head: torch.Tensor,
        slots: int,
        step_weight: float,
        objective: Objective = CROSS_ENTROPY,
        anchor_fraction: float = 1.0,
    ):
        super().__init__(head, target_lm_head, slots, step_weight, objective)
        self.batch_index = partial(
            peagle_batch_index,
            slots=slots,
            prompt_weight=objective.prompt_weight,
            anchor_fraction=anchor_fraction,
        )

    def step_input(
        self, k: int, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot k+1 at the anchors `pos` reads the mask state and the mask token, whatever slot k
        computed: the slots depend on each other only through attention, so EAGLE-3's unroll
        computes them, and its branch attention keeps their memory linear in the context."""
        b, s = pos.shape
        mask_ids = torch.full((b, s), self.head.mask_token_id, dtype=ids.dtype, device=ids.device)
        return self.head.mask_state().to(hidden.dtype).expand(b, s, -1), mask_ids

    def drafter(self, target) -> tuple[PEagleDrafter, object]:
        return PEagleDrafter(self.head), target


def build_peagle_trainee(cfg, target, data_dir: Path | None) -> PEagleTrainee:
    """A fresh P-EAGLE head for `target` over EAGLE-3's draft vocabulary (`draft_vocab`)."""
    d2t, t2d = draft_vocab(cfg, target, data_dir)
    head = PEagleHead.from_target(target, cfg.target.name_or_path, cfg.head, d2t, t2d)
    lm_head = target.get_output_embeddings().weight
    return PEagleTrainee(
        head,
        lm_head,
        cfg.head.parallel_tokens,
        cfg.head.step_weight,
        Objective.from_config(cfg.head),
        cfg.head.anchor_fraction,
    )


def peagle_drafter(head: PEagleHead, target, shapes: Sequence[Shape] = ()) -> PEagleDrafter:
    """A loaded head as the decoding drafter (chains only, as vLLM drafts P-EAGLE: its record's
    `chains_only`)."""
    return PEagleDrafter(head)
