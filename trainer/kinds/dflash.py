"""How a DFlash head learns: blocks at random anchors, each drafted in one forward, against the
target's distribution.

The layout is what vLLM's proposer builds at inference (`heads/dflash/model.py`): a block starts at an
anchor a (the last accepted token, whose target features do not exist yet), holds the anchor and
block_size - 1 mask tokens at positions a .. a+B-1, and sees the context's K/V at the positions
before a in its own sample. Slot k >= 1 predicts the token at a+k; its teacher is the target's
distribution there (the target's lm_head on its final hidden state at a+k-1). Many blocks of a
row run side by side under one mask, each blind to the others, as the peers train (speculators
`models/dflash`, SpecForge `dflash_family_model.py`).

Anchors: `head.anchors_per_sample` per sample of a row (a packed row's samples share them), drawn
without replacement among positions a whose
token and the next one are trained (answers, plus the prompt with a prompt weight) and which
have context before them (vLLM's first block follows the prompt). They are drawn by the batch
loader on the CPU from a generator seeded by the batch's token ids: the same batch gets the same
anchors (a resumed run and each validation draw what they drew before), and a reshuffled epoch
other ones.

Slot weights: `decay` exp(-(k-1)/head.loss_decay) (DFlash's), or `dpace` (D-PACE: each slot by the
acceptance it still leads to, sum_{j>=k} prod_{l<=j} ((1-alpha) c_l + alpha), c_l the head's
probability of the target's token, detached; speculators' and SpecForge's option).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from heads.dflash.model import DFlashHead, default_mask_token_id
from heads.window import near, window_of
from trainer.decoding.dflash import DFlashDrafter
from trainer.decoding.drafters import Shape
from trainer.objective import CROSS_ENTROPY, Objective, weighted_mean
from trainer.trainee import (
    FP32,
    LABEL_INDEX,
    Batch,
    HeadTrainee,
    RowSizes,
    indexed,
    label_index,
    position_ids,
    shift_left,
    trained_mask,
)

ANCHORS, ANCHOR_VALID = "dflash_anchors", "dflash_anchor_valid"
ROWS, SLOTS = "dflash_rows", "dflash_slots"  # per labelled slot: its row among the blocks, its k


def _seed(ids: torch.Tensor) -> int:
    """A generator seed from a batch's token ids: the same batch draws the same anchors."""
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.long) % 1_000_003
    return int((ids.flatten().long() * weights).sum()) % (2**63 - 1)


def draw_anchors(
    batch: Batch, block_size: int, per_sample: int, prompt_weight: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, A], valid [B, A]): ascending flat positions per row (0 where not valid), at
    most `per_sample` times the row's samples, among the candidates the module docstring names."""
    trained = trained_mask(batch, prompt_weight).bool()
    places = position_ids(batch)
    nxt = shift_left(places, 1, -1)
    candidates = trained & shift_left(trained, 1, False) & (nxt == places + 1) & (places >= 1)
    samples = ((places == 0) & batch["attention_mask"].bool()).sum(1).clamp(min=1)
    g = torch.Generator().manual_seed(_seed(batch["input_ids"]))
    keys = torch.rand(candidates.shape, generator=g).masked_fill(~candidates, 2.0)
    counts = torch.minimum(candidates.sum(1), samples * per_sample)
    width = max(1, int(counts.max()))
    picked = keys.argsort(dim=1)[:, :width]
    valid = torch.arange(width)[None] < counts[:, None]
    anchors = torch.where(valid, picked, candidates.shape[1]).sort(dim=1).values
    valid = anchors < candidates.shape[1]
    return torch.where(valid, anchors, 0), valid


def dflash_batch_index(batch: Batch, block_size: int, per_sample: int, prompt_weight: float = 0.0) -> Batch:
    """`DFlashTrainee.batch_index`: the anchors, and per labelled slot (slot k >= 1 of a valid
    block whose label a+k is trained and in the anchor's sample) its flat row among the blocks'
    slots [B * A * block_size] and its k. Adds `LABEL_INDEX` (the trained positions), which
    `indexed` reads as "already indexed"."""
    anchors, valid = draw_anchors(batch, block_size, per_sample, prompt_weight)
    trained = trained_mask(batch, prompt_weight).bool()
    places = position_ids(batch)
    b, t = trained.shape
    k = torch.arange(block_size)
    at = anchors[..., None] + k  # [B, A, Bk] label positions
    inside = at < t
    at_c = at.clamp(max=t - 1)
    row = torch.arange(b)[:, None, None]
    same = places[row, at_c] == places[row, anchors[..., None]] + k
    labelled = valid[..., None] & inside & same & trained[row, at_c] & (k >= 1)
    rows = labelled.flatten().nonzero().squeeze(1)
    return {
        LABEL_INDEX: label_index(trained),
        ANCHORS: anchors,
        ANCHOR_VALID: valid,
        ROWS: rows,
        SLOTS: rows % block_size,
    }


def block_attention_mask(
    anchors: torch.Tensor, places: torch.Tensor, seq_len: int, inside: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Bool [B, 1, A*Bk, T + A*Bk]: block j's slots see the context positions of the anchor's own
    sample before the anchor (with a `window`, `heads.window`, only those less than `window`
    before the slot's own position), and their block as `inside` [A*Bk, A*Bk] says (`block_mask`)."""
    bk = inside.shape[0] // anchors.shape[1]
    keys = torch.arange(seq_len, device=anchors.device)
    start = anchors - places.gather(1, anchors)  # where each anchor's sample starts in the row
    context = (keys[None, None] < anchors[..., None]) & (keys[None, None] >= start[..., None])
    context = context.repeat_interleave(bk, dim=1)  # [B, A*Bk, T]
    slots = (anchors[..., None] + torch.arange(bk, device=anchors.device)).flatten(1)  # row places
    context &= near(slots, keys, window)
    own = inside[None].expand(anchors.shape[0], -1, -1)
    return torch.cat([context, own], dim=2)[:, None]


class Slots(NamedTuple):
    """A batch's labelled slots, as the loss reads them: hidden states [N, H], the token before
    each label [N], the draft's log-probabilities [N, V], the target's probabilities [N, V] and
    each slot's weight [N] (slot weight times row weight)."""

    hidden: torch.Tensor
    prev: torch.Tensor
    logq: torch.Tensor
    teacher_p: torch.Tensor
    weight: torch.Tensor


class DFlashTrainee(HeadTrainee, nn.Module):
    drafter_class: ClassVar[type[DFlashDrafter]] = DFlashDrafter  # what validation decodes with
    frozen_tables = ("head.embed_tokens.weight", "head.lm_head.weight")

    def __init__(
        self,
        head: DFlashHead,
        anchors_per_sample: int,
        position_weights: str = "decay",
        loss_decay: float = 4.0,
        dpace_alpha: float = 0.5,
        objective: Objective = CROSS_ENTROPY,
    ):
        super().__init__()
        self.head, self.objective = head, objective
        self.position_weights, self.loss_decay, self.dpace_alpha = position_weights, loss_decay, dpace_alpha
        self.batch_index = partial(
            dflash_batch_index,
            block_size=head.block_size,
            per_sample=anchors_per_sample,
            prompt_weight=objective.prompt_weight,
        )

    def blocks(
        self, aux_hidden: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, places: torch.Tensor
    ) -> torch.Tensor:
        """Final-normed hidden [B, A*Bk, H] of the blocks at `anchors` [B, A] of rows ids [B, T]
        (aux features [B, T, n_aux*Ht], positions in their samples `places` [B, T])."""
        head, bk = self.head, self.head.block_size
        context = head.context(aux_hidden.to(head.fc.weight.dtype))
        past = head.context_kv(context, places)
        block_ids = head.block_ids(ids.gather(1, anchors)).flatten(1)
        block_pos = (places.gather(1, anchors)[..., None] + torch.arange(bk, device=ids.device)).flatten(1)
        inside = head.block_mask(anchors.shape[1], ids.device)
        mask = block_attention_mask(anchors, places, ids.shape[1], inside, window_of(head.config))
        return head.block(block_ids, block_pos, mask, past)

    def slot_weights(self, slots: torch.Tensor, confidence: torch.Tensor, rows: torch.Tensor, n_slots: int):
        """Float [N]: each labelled slot's weight (`decay` or `dpace`, see the module docstring)."""
        if self.position_weights == "decay":
            return torch.exp(-(slots - 1).float() / self.loss_decay)
        bk = self.head.block_size
        smooth = torch.ones(n_slots, device=rows.device)
        smooth[rows] = (1 - self.dpace_alpha) * confidence.detach() + self.dpace_alpha
        labelled = torch.zeros(n_slots, device=rows.device)
        labelled[rows] = 1.0
        prefix = smooth.view(-1, bk).cumprod(1) * labelled.view(-1, bk)
        suffix = prefix.flip(1).cumsum(1).flip(1).flatten()
        return suffix[rows]

    def draft_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of labelled slots' hidden states [N, H]; `prev` [N]: the token before
        each slot's label (what a derived kind's draft may condition on, as DSpark's bias)."""
        return self.head.logits(hidden)

    def loss(self, slots: Slots) -> torch.Tensor:
        """The `objective`'s weighted mean over the labelled slots."""
        return weighted_mean(self.objective.soft(slots.logq, slots.teacher_p), slots.weight)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loss and metric sums for one batch: `correct[k]` / `total[k]` = draft top-1 == target
        top-1 at the answer labels of drafted token k (slot k+1); the loss is the `objective`'s
        mean over the labelled slots, weighted by slot weight and row weight (`loss`)."""
        batch = indexed(batch, self.batch_index)
        ids, anchors, rows, slots = batch["input_ids"], batch[ANCHORS], batch[ROWS], batch[SLOTS]
        bk, k_max = self.head.block_size, self.head.block_size - 1
        hidden = self.blocks(batch["aux_hidden"], ids, anchors, position_ids(batch))
        t = ids.shape[1]
        block_rows = rows // bk  # flat (row, block) index
        label = block_rows // anchors.shape[1] * t + anchors.flatten().index_select(0, block_rows) + slots
        with torch.no_grad():  # the target's distribution for the token at u is the one it computed at u-1
            final = batch["final_hidden"].flatten(0, 1).index_select(0, label - 1).float()
            teacher_logits = self.head.logits(final).float()
            teacher_p, teacher_top = F.softmax(teacher_logits, dim=-1), teacher_logits.argmax(-1)
        labelled = hidden.flatten(0, 1).index_select(0, rows)
        prev = ids.flatten().index_select(0, label - 1)
        logq = F.log_softmax(self.draft_logits(labelled, prev).float(), dim=-1)
        answer = batch["loss_mask"].flatten().index_select(0, label).bool()
        confidence = logq.gather(1, teacher_top[:, None]).squeeze(1).exp()
        weight = self.slot_weights(slots, confidence, rows, hidden.shape[0] * hidden.shape[1])
        loss = self.loss(Slots(labelled, prev, logq, teacher_p, weight * self.objective.row_weights(answer)))
        with torch.no_grad():
            hit = (logq.argmax(-1) == teacher_top) & answer
            at = slots - 1
            correct = torch.zeros(k_max, device=ids.device).index_add_(0, at, hit.float())
            total = torch.zeros(k_max, device=ids.device).index_add_(0, at, answer.float())
        return {"loss": loss, "correct": correct, "total": total}

    def drafter(self, target) -> tuple[DFlashDrafter, object]:
        return self.drafter_class(self.head), target


def mask_token_id(cfg) -> int:
    """`head.mask_token_id`, or the default for the target's tokenizer (`default_mask_token_id`)."""
    from data_prep.target import resolve_target

    if cfg.head.mask_token_id is not None:
        return cfg.head.mask_token_id  # checked against the vocabulary by `heads.dflash.model.draft_config`
    target = resolve_target(cfg)
    return default_mask_token_id(target.tokenizer, target.config.get_text_config().vocab_size)


def dflash_activations(cfg, rows: RowSizes) -> int:
    """Bytes a DFlash (or DSpark) step keeps per token, an estimate: the context's fused features
    (float32), and `anchors_per_sample` blocks of `block_size` rows per `max_length` tokens, each
    row `num_layers` layers and the draft's and teacher's float32 full-vocabulary distributions."""
    head, h = cfg.head, rows.hidden
    drafted = min(head.block_size, head.anchors_per_sample * head.block_size / cfg.data.max_length)
    fused = len(head.aux_layer_ids or ()) or 5  # SpecForge's default reads 5 target layers
    per_row = head.num_layers * rows.layer + 2 * FP32 * rows.vocab
    return round(fused * h * FP32 + h * rows.act + drafted * per_row)


def build_dflash_trainee(cfg, target, data_dir: Path | None, head_class: type[DFlashHead] = DFlashHead,
                         trainee_class: type[DFlashTrainee] = DFlashTrainee, **extra) -> DFlashTrainee:
    """A fresh head for `target` (the data folder is not read: DFlash drafts over the target's
    whole vocabulary through its lm_head); a derived kind passes its classes and the extra
    arguments its trainee takes."""
    h = cfg.head
    head = head_class.from_target(target, cfg.target.name_or_path, h, mask_token_id(cfg))
    objective = Objective.from_config(h)
    return trainee_class(
        head, h.anchors_per_sample, h.position_weights, h.loss_decay, h.dpace_alpha, objective, **extra
    )


def dflash_drafter(head: DFlashHead, target, shapes: Sequence[Shape] = (),
                   drafter_class: type[DFlashDrafter] = DFlashDrafter) -> DFlashDrafter:
    """A loaded head as the decoding drafter (of `drafter_class`); chains only, its record's
    `chains_only`."""
    return drafter_class(head)
