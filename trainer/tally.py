"""The trainee's metric sums and the gradient norm, added up on the device between two reads.

A training step may not read the device back (`trainer.loop.train_step`), so what the tracker
shows of training (per-position acceptance `train/acc_k`, `train/grad_norm`) is summed here
as device tensors, step after step, and read once at a logging step, where the loop reads anyway.
Validation sums its batches the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Summarize = Callable[[dict[str, torch.Tensor]], dict[str, float]]  # `Trainee.summarize`


class Tally:
    """Sums of a trainee's outputs (`Trainee.__call__`: the loss and summable metric tensors)
    and of the finite gradient norms, since the last `read`."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.norms: torch.Tensor | None = None  # [sum of the finite norms, how many]

    def add(self, out: dict[str, torch.Tensor]) -> None:
        """One batch's outputs, added on the device (no read)."""
        for k, v in out.items():
            v = v.detach().float().reshape(-1)
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def add_norm(self, norm: torch.Tensor | float) -> None:
        """One optimizer step's gradient norm, on the device: a non-finite one (a step the
        non-finite guard skips or stops at) is left out of the mean rather than turning it NaN."""
        norm = torch.as_tensor(norm, dtype=torch.float32).detach().reshape(())
        finite = torch.isfinite(norm)
        pair = torch.stack([torch.where(finite, norm, 0.0), finite.float()])
        self.norms = pair if self.norms is None else self.norms + pair

    def reduced(self, accelerator) -> dict[str, torch.Tensor]:
        """The sums over every rank (collective: every rank calls it at the same step), then
        empty for the next window."""
        sums, self.sums = self.sums, {}
        return {k: accelerator.reduce(v, reduction="sum") for k, v in sums.items()}

    def read(self, accelerator, summarize: Summarize) -> dict[str, float]:
        """The window's metrics as `summarize` names them (per-position acceptance, the
        simulated acceptance length...) and `grad_norm`, the mean finite norm of its steps (every
        rank clips the same all-reduced gradients, so rank 0's norms are the run's)."""
        sums = self.reduced(accelerator)
        metrics = summarize(sums) if sums else {}
        if self.norms is not None:
            total, count = self.norms.tolist()
            if count:
                metrics["grad_norm"] = total / count
            self.norms = None
        return metrics
