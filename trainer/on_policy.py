"""On-policy training (`optim.on_policy`): the run's last steps train on the head's own drafts.

Teacher-forced training (EAGLE-3's TTT unroll) feeds the head the data's tokens, and its context
is the target's states along the data: at serving the head feeds back its own drafts, and after
each verify its context holds the drafts the target accepted. Draft-OPD (arXiv 2605.29343) trains
on the states the drafts induce, with the target as teacher there. Here a step of the stage takes
its loader batch, lets the trainee lay out rows cut at random anchors on the host
(`on_policy_rows`), and on the device lets the head draft there and the frozen target run once
over each prefix and its drafts (`on_policy_batch`); the trainee's ordinary objective then trains
on those rows. The trainee kinds that can are listed in `trainer.kinds` (`TrainerKind.on_policy`).

What it changes against TTT, exactly: the unroll already feeds back the head's own hidden state
at each step; from the data it takes the token each step reads (the data's x[t+1+k] where the
decoder feeds its own draft d[k]) and the target's states and distributions, conditioned on the
data's tokens. An accepted draft is the target's greedy token, so where the data is the target's
own greedy answer (`data.regenerate`'s default, temperature 0) the on-policy rows hold, on the
prefix a greedy chain reaches, what TTT at that anchor holds: the stage then changes which labels
count (those the chain reaches, and the first it gets wrong, where TTT weighs step k by
`head.step_weight`**k everywhere) and where they are, not what they say. It trains on states TTT
never shows where the data is not the target's greedy path: human or sampled answers
(`data.regenerate.enabled=false`, `data.regenerate.temperature` > 0), or a target other than the
one that wrote the answers.

The stage is the steps from `TrainState.on_policy_from` on, fixed when a run first starts and
kept in its checkpoints; its anchors are drawn from a generator seeded by the run's seed and the
step's place in the data, so a resumed run trains exactly the batches the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.checkpoint import TrainState
from trainer.trainee import Batch

Capture = Callable[[Batch], Batch]


def stage_start(total: int, share: float) -> int:
    """The step count after which the last `share` of `total` steps train on-policy (`total`
    where the share is 0: never)."""
    return total - round(total * share)


@dataclass(frozen=True)
class OnPolicy:
    """The on-policy stage of one fit: the target's `capture` of any rows (the whole target, in
    this process) and the run's `seed`."""

    capture: Capture
    seed: int

    def generator(self, state: TrainState) -> torch.Generator:
        """The anchors' generator of the micro-batch about to train at `state`'s place."""
        key = (self.seed * 1_000_003 + state.epoch) * 1_000_003 + state.batch_in_epoch
        return torch.Generator().manual_seed(key % 2**63)

    def transform(self, trainee, batch: Batch, state: TrainState) -> Callable[[Batch], Batch] | None:
        """None before the stage; in it, what turns the device copy of the loader's `batch` (on
        the host still) into the rows `trainee` (unwrapped) trains on: their layout is made here,
        the drafts and the target's states on the device."""
        if state.on_policy_from is None or state.step < state.on_policy_from:
            return None
        rows = trainee.on_policy_rows(batch, self.generator(state))

        def apply(moved: Batch) -> Batch:
            device = moved["input_ids"].device
            laid = {k: v.to(device, non_blocking=True) for k, v in rows.items()}
            return trainee.on_policy_batch(moved, laid, self.capture)

        return apply
