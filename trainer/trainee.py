"""What the training loop needs from a head being trained, and the helpers both kinds share.

A trainee is the module the loop wraps (DDP / DeepSpeed call its forward): the trainable head
plus whatever frozen parts its loss reads. `trainer/loop.py` knows nothing else about a head, so
a new head kind is a new trainee module and nothing in the loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch


class Trainee(Protocol):
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


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, t] <- x[:, t+n]; the last n positions get `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def simulated_acceptance_length(acc: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the chain acceptance length these per-step accuracies imply."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
