"""What the training loop needs from a head being trained, and the helpers both kinds share.

A trainee is the module the loop wraps (DDP / DeepSpeed call its forward): the trainable head
plus whatever frozen parts its loss reads. `trainer/loop.py` knows nothing else about a head, so
a new head kind is a new trainee module and nothing in the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

LABEL_INDEX = "label_index"  # the batch fields `label_batch_index` adds
LABEL_POSITION = "label_position"

Batch = dict[str, torch.Tensor]
BatchIndex = Callable[[Batch], Batch]


class Trainee(Protocol):
    batch_index: BatchIndex
    """Index tensors forward reads in place of boolean masks (at least `label_batch_index`'s),
    which the batch loader computes from each collated batch while it is still on the CPU: their
    shapes carry every data-dependent width, so that a step never has to read the device back to
    learn one. A module-level function or a partial of one, since loader workers may be spawned."""

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A batch -> {"loss": scalar, <metric>: summable tensors}; the loop all-reduces the
        sums over ranks and validation batches before `summarize` turns them into rates."""
        ...

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Summed metrics -> logged rates, including "score": higher is better (best-head pick)."""
        ...

    def param_groups(self, lr: float, weight_decay: float) -> list[dict]:
        """Optimizer groups over the trainable parameters only."""
        ...

    def save_pretrained(self, out_dir: str | Path, state: dict | None = None) -> Path:
        """Write the head folder, from `state` (a full, possibly gathered state dict) if given."""
        ...

    def drafter(self, target) -> tuple[object, object]:
        """(drafter, verifier) for `trainer.decoding.speculative_generate` with the head as it
        is now: decoded validation measures the head in training with the evaluator's decoder.
        The verifier is `target`, or the trainee's own target where it trains one."""
        ...


FP32 = 4  # bytes of a float32 value: the losses' probabilities, AdamW's moments and master copies


@dataclass(frozen=True)
class RowSizes:
    """What one trained row of a head keeps for backward, in the terms each kind's estimate
    (`TrainerKind.activations`, for `trainer.plan.memory`) is written in."""

    hidden: int  # the target's hidden size
    vocab: int  # the target's vocabulary
    heads: int  # the head's attention heads
    act: int  # bytes of one activation: 2 under bf16/fp16 autocast, else 4
    layer: int  # bytes one decoder layer keeps: about 10 hidden-sized and 4 MLP-sized values


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, t] <- x[:, t+n]; the last n positions get `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def label_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """Flat indices (row * T + position), ascending, of the labelled positions of a [B,T] mask.
    How many there are is data: `nonzero` waits for the mask's values, cheap on the CPU, a sync
    on a GPU."""
    return loss_mask.flatten().nonzero().squeeze(1)


def position_ids(batch: Batch) -> torch.Tensor:
    """[B,T]: each token's position in its own sample. Packed rows (`trainer.batching.pack_row`)
    carry them; a padded batch holds one sample per row, 0..T-1."""
    if "position_ids" in batch:
        return batch["position_ids"]
    ids = batch["input_ids"]
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


def trained_mask(batch: Batch, prompt_weight: float) -> torch.Tensor:
    """Bool [B,T]: the positions whose token a loss predicts. The answers (`loss_mask`) always;
    with a prompt weight > 0 every other real position too (prompt, system and template
    tokens): capture keeps the target's hidden states at every position, offline and online, so
    their target distribution is there without a new capture."""
    if prompt_weight == 0:
        return batch["loss_mask"]
    return batch["loss_mask"] | batch["attention_mask"].bool()


def label_batch_index(batch: Batch, prompt_weight: float = 0.0) -> Batch:
    """The `batch_index` of a trainee that needs the labelled positions only (`trained_mask`):
    their flat indices and their positions in their own samples (a label is predicted from its
    own sample only, so `offset` tokens ahead only where its position is >= offset)."""
    labels = label_index(trained_mask(batch, prompt_weight))
    return {LABEL_INDEX: labels, LABEL_POSITION: position_ids(batch).flatten().index_select(0, labels)}


def indexed(batch: Batch, index: BatchIndex) -> Batch:
    """`batch` with the fields `index` computes, unless the batch loader added them already:
    for batches made elsewhere (a direct call, a benchmark), which then pay the syncs here."""
    return batch if LABEL_INDEX in batch else {**batch, **index(batch)}


def simulated_acceptance_length(acc: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the chain acceptance length these per-step accuracies imply."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def store_frozen_tables(trainee: nn.Module, dtype: torch.dtype | None) -> None:
    """Store the trainee's frozen target tables (its `frozen_tables`, state-dict names of
    parameters or buffers) in `dtype`, the 16-bit dtype training computes in (None: left as built).

    autocast caches the casts of trainable leaves only: a float32 frozen table was re-cast to 16
    bits at every step it was multiplied (a DFlash step cast its whole [V, H] lm_head twice), and
    held twice the bytes (2.1 GB of float32 embedding at Llama-3-8B). Stored as autocast's cast
    would make them, the matmuls see the same numbers; the tables never train, so float32 kept
    nothing. Rotary frequencies and index maps are not tables and are not named."""
    if dtype is None:
        return
    for name in getattr(trainee, "frozen_tables", ()):
        owner, _, leaf = name.rpartition(".")
        module = trainee.get_submodule(owner)
        table = getattr(module, leaf)
        if isinstance(table, nn.Parameter):
            table.data = table.data.to(dtype)
        else:
            setattr(module, leaf, table.to(dtype))  # a registered buffer stays one


class HeadTrainee:
    """The parts of a trainee that trains its `head` alone and reports per-step top-1 agreement
    (`correct[k]`/`total[k]`): EAGLE-3, P-EAGLE and DFlash share them. The score is the chain
    acceptance length those rates imply (for a block drafted at once, DFlash's, it takes slot k
    to be right independently of the slots before it)."""

    head: nn.Module
    # Frozen copies of the target's tables (`store_frozen_tables`): none unless a kind names them.
    frozen_tables: tuple[str, ...] = ()

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor]) -> dict[str, float]:
        acc = (sums["correct"] / sums["total"].clamp(min=1)).tolist()
        out = {f"acc_{k}": a for k, a in enumerate(acc)}
        out["sim_acceptance_length"] = simulated_acceptance_length(acc)
        out["score"] = out["sim_acceptance_length"]
        return out

    def param_groups(self, lr: float, weight_decay: float) -> list[dict]:
        params = [p for p in self.head.parameters() if p.requires_grad]
        return [{"params": params, "lr": lr, "weight_decay": weight_decay}]

    def save_pretrained(self, out_dir: str | Path, state: dict | None = None) -> Path:
        head_state = None if state is None else strip_prefix(state, "head.")
        return self.head.save_pretrained(out_dir, state=head_state)
