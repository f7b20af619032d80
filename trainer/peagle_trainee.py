"""How a P-EAGLE head learns: K slots per anchor in one forward, laid out as vLLM drafts them.

At anchor t (the last verified position), slot 1 is EAGLE-3's step 0: the target feature of t
with token t+1, at position t. Slot k >= 2 reads the mask token and the mask state at position
t+k-1. Slot k predicts token t+1+k against the target's distribution at t+k. Slot k attends the
verified context of its sample up to t (the slot-1 rows: what the drafter's cache holds) and
slots 2..k of its own anchor: the causal mask of vLLM's one draft forward, verified positions
then K-1 mask slots. One forward over [every position's slot 1 | slot 2 of each anchor | ... |
slot K of each anchor] computes them all.

Slot k+1 stands where EAGLE-3's unroll step k stands (same anchor, position and label), so the
labels, rows, teacher and loss are `Eagle3Trainee`'s, step k weighted `step_weight**k` as there
(the peers take one mean over all sampled rows, so slot k weighs its share of rows, ~0.7^(k-1)).
Only the inputs of slots 2..K differ, and `anchor_fraction` < 1 runs them at a seeded sample of
anchors only, to bound their cost.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from conf.errors import UserError
from heads.peagle import PEagleHead
from trainer.decoding.drafters import Shape, Tree
from trainer.decoding.peagle import PEagleDrafter
from trainer.eagle3_trainee import Eagle3Trainee, draft_vocab, ttt_attention_mask, ttt_batch_index
from trainer.objective import CROSS_ENTROPY, Objective
from trainer.trainee import Batch, shift_left


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


def slot_attention_mask(
    first: torch.Tensor, anchors: torch.Tensor, seq_len: int, mask_slots: int,
    first_starts: torch.Tensor, anchor_starts: torch.Tensor, window: int | None = None,
) -> torch.Tensor:
    """Bool [B,1,R,R], R = T + mask_slots*S: rows and keys are every position's slot 1 (`first`
    [B,T]), then each mask slot at the S `anchors` [B,S]. Each block is EAGLE-3's unroll mask of
    that step (`ttt_attention_mask`: causal over slot 1 from the document's start, then the
    diagonal of each earlier mask slot, a `window` sliding with the slot), with the later slots'
    keys hidden."""
    rows = ttt_attention_mask(first, seq_len, 0, first_starts, window)
    width = seq_len + mask_slots * anchors.shape[1]
    blocks = [F.pad(rows, (0, width - rows.shape[-1]))]
    for k in range(1, mask_slots + 1):
        rows = ttt_attention_mask(anchors, seq_len, k, anchor_starts, window)
        blocks.append(F.pad(rows, (0, width - rows.shape[-1])))
    return torch.cat(blocks, dim=2)


class PEagleTrainee(Eagle3Trainee):
    """`Eagle3Trainee` with the K slots of `PEagleHead` in one forward in place of the unroll."""

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

    def unroll_gathered(
        self,
        aux_hidden: torch.Tensor,
        ids: torch.Tensor,
        later: tuple[torch.Tensor, torch.Tensor] | None,
        position_ids: torch.Tensor | None = None,
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (k, slot k+1's output hidden, its positions [B,S], valid [B,S]) as the EAGLE-3
        unroll yields its steps, all from one forward. `later` (None: every position) are the
        anchors of the mask slots; `position_ids` keep packed samples apart, as there."""
        head, (b, t) = self.head, ids.shape
        first = torch.arange(t, device=ids.device).expand(b, t)
        places = first if position_ids is None else position_ids
        anchors, valid = later if later is not None else (first, torch.ones_like(first, dtype=torch.bool))
        s, m = anchors.shape[1], self.ttt_length - 1
        at = places.gather(1, anchors)  # each anchor's position in its own sample
        fused = head.fuse(aux_hidden.to(head.fc.weight.dtype))
        hidden = torch.cat([fused, head.mask_state().to(fused.dtype).expand(b, m * s, -1)], 1)
        mask_ids = torch.full((b, m * s), head.mask_token_id, dtype=ids.dtype, device=ids.device)
        tokens = torch.cat([shift_left(ids, 1, 0), mask_ids], 1)
        positions = torch.cat([places, *(at + k for k in range(1, m + 1))], 1)
        attn = slot_attention_mask(first, anchors, t, m, first - places, anchors - at, self.window)
        out, _ = head.layer(hidden, tokens, positions, attn)
        yield 0, out[:, :t], first, torch.ones_like(first, dtype=torch.bool)
        for k in range(1, m + 1):
            yield k, out[:, t + (k - 1) * s : t + k * s], anchors, valid

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
    """A loaded head as the decoding drafter: chains only (vLLM drafts P-EAGLE as one chain)."""
    if any(isinstance(shape, Tree) for shape in shapes):
        raise UserError(
            "eval.mode=tree: a peagle head drafts one chain per forward; use eval.mode=chain or auto"
        )
    return PEagleDrafter(head)
