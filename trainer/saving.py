"""When a run checkpoints: every `optim.save_every` steps, or, with a time cadence in force
(`optim.save_every_min`; on CUDA by default, `conf.device_defaults.Cadence`), once that much wall
time has passed since the last checkpoint.

Saving is collective (DeepSpeed gathers and every rank writes its optimizer shard), so every rank
must take the same branch, and ranks' clocks do not agree to the step: rank 0's clock decides and
its verdict is handed to every rank (`share`, a broadcast). That broadcast is a device read, and
a read each step would make the GPU idle after every step (`trainer.loop`: a training step reads
nothing back). So the clock is read only at logging steps, where the loop reads the device anyway
(the mean loss): one one-element broadcast per `logging.log_every` steps, and a checkpoint lands
at most that many steps after its time. A step count fixed in advance from a measured step time
would need no collective at all, but would drift with the data's lengths and with validations.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from accelerate.utils import broadcast

Share = Callable[[bool], bool]  # rank 0's verdict -> the same verdict on every rank (collective)


class CheckpointClock:
    """Decides at each optimizer step whether to checkpoint, identically on every rank."""

    def __init__(self, every_steps: int, every_s: float | None, log_every: int, share: Share,
                 clock: Callable[[], float] = time.monotonic):
        self.every_steps, self.every_s, self.log_every = every_steps, every_s, log_every
        self.share, self.clock = share, clock
        self.since = clock()  # the last checkpoint, or this run's (or resumed run's) start

    def due(self, step: int) -> bool:
        """Whether `step` checkpoints: by steps (no clock, no collective), or by time at logging
        steps only, every rank calling `share` there alike."""
        if self.every_s is None:
            return step % self.every_steps == 0
        return rank0_decides(step, self.log_every, self.share,
                             lambda: self.clock() - self.since >= self.every_s)

    def saved(self) -> None:
        """A checkpoint was just taken: the time to the next counts from now."""
        self.since = self.clock()


def rank0_decides(step: int, every: int, share: Share, verdict: Callable[[], bool]) -> bool:
    """Rank 0's `verdict()`, the same on every rank, asked at every `every`-th step only (the
    logging steps, where the loop reads the device anyway) and False between them, so that the
    ranks, whose clocks disagree, take each collective branch at the same step."""
    return step % every == 0 and share(verdict())


def rank0_share(accelerator) -> Share:
    """`Share` over the run's processes: rank 0's verdict broadcast as one float (on the device,
    as the backend wants it; a single process gets its own back, with no collective)."""

    def share(verdict: bool) -> bool:
        flag = torch.tensor([float(verdict)], device=accelerator.device)
        return bool(broadcast(flag, from_process=0).item())

    return share
