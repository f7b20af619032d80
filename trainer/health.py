"""Non-finite values stop a run in one line that says where they came from and what to try.

A training step reads nothing back from the device (see trainer/loop.py), so each step records,
on the device and in a few scalar ops, where a value first stopped being finite: its loss, its
gradient norm, and online the target's hidden states (`data_prep.states.capture.checked_capture`). The
loop reads that record where it reads the device anyway (logging, validation and checkpoint
steps) and always before it keeps anything, so no checkpoint and no kept head holds a diverged
state, and the step that went wrong is still named exactly. `optim.skip_nonfinite=n` trades that
for one read of the gradient norm per step: a step whose norm is not finite is then not taken,
up to n times (every rank sees the same all-reduced norm, so all ranks skip alike).

A run can also fail while every value stays finite: `trainer.collapse` watches for that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from conf.errors import UserError
from conf.schema import OptimConfig
from data_prep.folders.store import rebuild_hint
from data_prep.states.capture import overflow_message
from trainer.batching import rank_batches
from trainer.checkpoint import TrainState, latest_checkpoint
from trainer.selection import kept_head_dir

LOSS, GRAD_NORM, HIDDEN = 1, 2, 3  # what a record says was not finite
WHAT = {LOSS: "training loss", GRAD_NORM: "gradient norm", HIDDEN: "target hidden states"}


@dataclass(frozen=True)
class Fault:
    """The first non-finite value a record holds (layer, row, position: HIDDEN only)."""

    step: int
    micro: int  # the micro-batch's number since the watch started (`NonFiniteWatch.places`)
    what: int
    layer: int
    row: int
    position: int
    rank: int = 0


class NonFiniteWatch:
    """The device-side record of the first non-finite value, and the host-side map from
    micro-batch numbers to batches (`places`: (step, epoch, batch in epoch) of each micro-batch
    since the last clean `read`) that lets a fault name its sample."""

    def __init__(self, device, step: int, check_grad_norm: bool, skip_budget: int = 0, skipped: int = 0):
        self._empty = torch.full((6,), -1, dtype=torch.int64, device=device)
        self.record, self.pending = self._empty.clone(), self._empty.clone()
        self.step = torch.full((), step + 1, dtype=torch.int64, device=device)  # in progress
        self.micro = torch.zeros((), dtype=torch.int64, device=device)
        # False with fp16 loss scaling, where a non-finite gradient is routine: the scaler skips it.
        self.check_grad_norm = check_grad_norm
        self.skip_budget, self.skipped = skip_budget, skipped
        self.places: list[tuple[int, int, int]] = []
        self.base = 0  # the micro-batch number of places[0]
        self.last_skip: Fault | None = None  # the step just skipped, until `take_skip`

    def observe(self, loss: torch.Tensor, grad_norm, hidden: torch.Tensor | None, end_of_step: bool) -> bool:
        """Record one micro-batch: its loss, at the end of a step the gradient norm (a tensor, a
        float under DeepSpeed, None in between) and online where its hidden states overflowed
        (None offline). True: take the optimizer step. False (only with a `skip_budget`): its
        gradient norm is not finite, so skip it and drop its record; `take_skip` says what went
        wrong, and the loop stops the run once `skipped` exceeds the budget."""
        what = torch.where(torch.isfinite(loss), 0, LOSS)
        if hidden is not None:
            what = torch.where(hidden[0] >= 0, HIDDEN, what)
        if grad_norm is not None and self.check_grad_norm:
            finite = torch.isfinite(torch.as_tensor(grad_norm))
            what = torch.where((what == 0) & ~finite, GRAD_NORM, what)
        where = self._empty[:3] if hidden is None else hidden
        hit = torch.cat([self.step[None], self.micro[None], what[None], where])
        self.pending = torch.where((self.pending[0] < 0) & (what > 0), hit, self.pending)
        self.micro += 1
        if not end_of_step:
            return True
        take = not self._skips(grad_norm)
        if take:
            self.record = torch.where(self.record[0] < 0, self.pending, self.record)
        self.pending = self._empty.clone()
        self.step += 1
        return take

    def _skips(self, grad_norm) -> bool:
        """With a skip budget: whether this step's gradient norm is non-finite (the read
        `optim.skip_nonfinite` pays for). Counts the skip and keeps what went wrong."""
        if not (self.skip_budget and self.check_grad_norm and grad_norm is not None):
            return False
        if math.isfinite(float(grad_norm)):
            return False
        self.skipped += 1
        self.last_skip = Fault(*self.pending.tolist())
        return True

    def take_skip(self) -> Fault | None:
        """The step skipped since the last call, if any."""
        skipped, self.last_skip = self.last_skip, None
        return skipped

    def read(self, accelerator) -> Fault | None:
        """The first fault on any rank, or None (then the places read clean are forgotten). A
        collective: every rank calls it at the same steps."""
        rows = accelerator.gather(self.record[None]).tolist()
        faults = [Fault(*row, rank=rank) for rank, row in enumerate(rows) if row[0] >= 0]
        if faults:
            return min(faults, key=lambda f: (f.step, f.micro, f.rank))
        self.base += len(self.places)
        self.places.clear()
        return None

    def place(self, fault: Fault) -> tuple[int, int, int]:
        """(step, epoch, batch in epoch) of the fault's micro-batch."""
        return self.places[fault.micro - self.base]

    def step_places(self, step: int) -> list[tuple[int, int, int]]:
        """Those of every micro-batch of `step` (gradient accumulation runs several)."""
        return [p for p in self.places if p[0] == step]


def sample_at(batch: list, row: int, position: int, lengths: list[int]) -> tuple[int, int]:
    """(sample index, position in it) of a row position of a batch of sample indices: padded
    batches hold one sample a row, packed ones (lists) several back to back."""
    members = batch[row] if isinstance(batch[row], list) else [batch[row]]
    for i in members:
        if position < lengths[i]:
            return i, position
        position -= lengths[i]
    return members[-1], position


def batch_samples(batch: list) -> list[int]:
    return [i for row in batch for i in (row if isinstance(row, list) else [row])]


def describe(ds, i: int) -> str:
    """Sample `i` as errors name it (`CapturedDataset.describe`, or its index elsewhere)."""
    return ds.describe(i) if hasattr(ds, "describe") else f"sample {i}"


def nonfinite_fields(item: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in item.items() if v.is_floating_point() and not torch.isfinite(v).all()]


def bad_stored_sample(ds, batches: list) -> str | None:
    """The first sample of `batches` whose stored values are not finite, with the field, or None:
    a non-finite loss on such data is the data's fault, not the run's."""
    for batch in batches:
        for i in batch_samples(batch):
            bad = nonfinite_fields(ds[i])
            if bad:
                return f"{describe(ds, i)} holds non-finite {bad[0]}"
    return None


def tuning_hint(optim: OptimConfig) -> str:
    return (
        f"a lower optim.lr (now {optim.lr:g}) or optim.grad_clip (now {optim.grad_clip:g}), or "
        "optim.skip_nonfinite=n to skip up to n such steps"
    )


def explain(fault: Fault, batches: list, ds, optim: OptimConfig) -> tuple[str, str | None]:
    """(what went wrong, what to try) for a training fault. `batches`: the batch of its
    micro-batch (HIDDEN) or those of its step, as sample indices of `ds`."""
    if fault.what == HIDDEN:
        i, position = sample_at(batches[0], fault.row, fault.position, ds.lengths)
        return f"non-finite {WHAT[HIDDEN]} (online capture): " + overflow_message(
            fault.layer, position, describe(ds, i)
        ), None
    return blame(f"non-finite {WHAT[fault.what]}", batches, ds, optim)


def blame(problem: str, batches: list, ds, optim: OptimConfig) -> tuple[str, str | None]:
    """(problem, what to try) for a non-finite loss over `batches` of `ds`: the data when one of
    their samples holds a non-finite value (rebuild the folder), else the run (tune it)."""
    bad = bad_stored_sample(ds, batches)
    if bad is not None:
        return f"{problem}: {bad}", rebuild_hint(ds.folder)
    return problem, tuning_hint(optim)


def stop_line(
    step: int, problem: str, hint: str | None, head_dir: Path, best_step: int, checkpoint: Path | None
) -> str:
    """The one line a stopped run ends with: the step, what went wrong, what is kept, what to try."""
    kept = f"the best head so far (step {best_step}) stays in {head_dir}" if best_step else "no head kept yet"
    last = (
        f"the last good checkpoint is {checkpoint} (resume=true continues from it)"
        if checkpoint
        else "no checkpoint was written yet"
    )
    return f"step {step}: {problem}; the run stopped: {kept}, {last}" + (f"; to fix: {hint}" if hint else "")


class NonFiniteGuard:
    """The loop's side of the watch: reads it where the loop reads the device anyway and turns
    what it holds into the run's one-line stop (a `UserError`), naming the batches behind a
    fault from the deterministic data order. `state` is the run's live `TrainState` (its step
    and kept head go into the line). Reads are collective: every rank calls them at the same
    steps."""

    def __init__(
        self, accelerator, state: TrainState, train_ds, optim: OptimConfig, seed: int, run_dir: Path
    ):
        # fp16 loss scaling makes non-finite gradients routine (the scaler skips those steps itself).
        grad_norms = accelerator.mixed_precision != "fp16"
        budget = optim.skip_nonfinite
        self.watch = NonFiniteWatch(accelerator.device, state.step, grad_norms, budget, state.skipped)
        self.accelerator, self.state, self.train_ds = accelerator, state, train_ds
        self.optim, self.seed, self.run_dir = optim, seed, run_dir
        self.checked_at = -1

    def check(self) -> None:
        """Read the watch (once per step): stop at the first non-finite value of any rank."""
        if self.checked_at == self.state.step:
            return
        self.checked_at = self.state.step
        fault = self.watch.read(self.accelerator)
        if fault is not None:
            raise self.stop(fault.step, *self.explained(fault))

    def skip_line(self) -> str | None:
        """At a step's end: the line to print if its optimizer step was skipped (None: taken);
        a skip past `optim.skip_nonfinite` stops the run instead."""
        skipped, budget = self.watch.take_skip(), self.optim.skip_nonfinite
        if skipped is None:
            return None
        problem, hint = self.explained(skipped)
        if self.watch.skipped > budget:
            raise self.stop(skipped.step, f"{problem}, after {budget} skipped step(s)", hint)
        return (
            f"step {skipped.step}: {problem}: optimizer step skipped "
            f"({self.watch.skipped} of optim.skip_nonfinite={budget})"
        )

    def check_validation(self, metrics: dict[str, float], val_ds) -> None:
        """Stop on a non-finite validation loss (reduced: alike on every rank)."""
        if not math.isfinite(metrics.get("loss", 0.0)):
            every = [list(range(len(val_ds)))]
            raise self.stop(self.state.step, *blame("non-finite validation loss", every, val_ds, self.optim))

    def stop(self, step: int, problem: str, hint: str | None) -> UserError:
        checkpoint = latest_checkpoint(self.run_dir)  # written only after a clean `check`: good
        head_dir, best_step = kept_head_dir(self.run_dir), self.state.best_step
        return UserError(stop_line(step, problem, hint, head_dir, best_step, checkpoint))

    def explained(self, fault: Fault) -> tuple[str, str | None]:
        """`explain` with the fault's batches, rebuilt from the deterministic order."""
        watch, world = self.watch, self.accelerator.num_processes
        places = [watch.place(fault)] if fault.what == HIDDEN else watch.step_places(fault.step)
        batches = [
            rank_batches(self.train_ds, self.optim, self.seed, epoch, fault.rank, world)[i]
            for _, epoch, i in places
        ]
        return explain(fault, batches, self.train_ds, self.optim)
