"""The GPU cadences in the loop: a capped validation reads the same fixed batches every time and
on every rank alike, and time-based checkpoints are decided identically on every rank.

In process, on a dataset made in memory (the loop's interface: items and `lengths`) and a real
module as the trainee. The clocks are fake, injected rather than mocked: a clock is no GPU, and a
test can move it; ranks are stepped in lockstep in this one process, the broadcast between them
being what rank 0's verdict handed to each rank is."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from conf.schema import OptimConfig, RootConfig
from trainer.batching import rank_batches, validation_batches
from trainer.loop import validation_metrics
from trainer.saving import CheckpointClock

OPTIM = OptimConfig(batch_tokens=64, max_batch_size=4)


class Samples(torch.utils.data.Dataset):
    """40 samples of 3-20 tokens; each carries its index, so a trainee can say what it read."""

    def __init__(self, n: int = 40):
        self.lengths = [3 + (7 * i) % 18 for i in range(n)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = self.lengths[i]
        return {"input_ids": torch.arange(n), "sample": torch.full((n,), i)}


class Reader(torch.nn.Module):
    """A trainee that records the samples of each batch it is given; its loss is 1 per batch."""

    batch_index = None

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self.read: list[frozenset[int]] = []

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.read.append(frozenset(batch["sample"][:, 0].tolist()))
        return {"loss": self.bias + 1.0, "rows": torch.tensor(float(len(batch["sample"])))}

    def summarize(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"score": float(sums["rows"])}


def test_a_capped_validation_reads_the_same_first_batches_every_time():
    ds, cfg, acc = Samples(), RootConfig(optim=OPTIM), Accelerator(cpu=True)
    trainee = Reader()
    first = validation_metrics(acc, trainee, ds, cfg, limit=3)
    once, trainee.read = trainee.read, []
    second = validation_metrics(acc, trainee, ds, cfg, limit=3)
    assert trainee.read == once  # the same batches, in the same order
    order = rank_batches(ds, OPTIM, cfg.seed, 0, 0, 1)
    assert once == [frozenset(b) for b in order[:3]] and len(order) > 3
    assert first == second and first["loss"] == 1.0  # the mean over the batches read
    trainee.read = []
    validation_metrics(acc, trainee, ds, cfg)  # no cap: the whole split, each sample once
    assert sorted(i for b in trainee.read for i in b) == list(range(len(ds)))


def test_capped_shares_are_the_first_batches_of_one_order_and_equal_across_ranks():
    ds = Samples()
    order = [frozenset(b) for b in rank_batches(ds, OPTIM, 0, 0, 0, 1)]
    for world in (2, 4):
        shares = [validation_batches(ds, OPTIM, 0, rank, world, 2) for rank in range(world)]
        assert [len(s) for s in shares] == [2] * world
        assert {frozenset(b) for s in shares for b in s} == set(order[: 2 * world])
        assert shares == [validation_batches(ds, OPTIM, 0, rank, world, 2) for rank in range(world)]


class FakeClock:
    """Seconds that advance only when the test says; counts its reads."""

    def __init__(self, now: float = 0.0):
        self.now, self.reads = now, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class FromRank0:
    """A broadcast from rank 0 among ranks stepped in lockstep (rank 0 first): rank 0's verdict
    is what every rank gets back, its own notwithstanding."""

    def __init__(self):
        self.verdict: bool | None = None

    def share(self, rank: int):
        def share(verdict: bool) -> bool:
            if rank == 0:
                self.verdict = verdict
            return self.verdict

        return share


def test_time_based_checkpoints_are_decided_on_rank_0s_clock_at_logging_steps_only():
    """Rank 0 steps 10 s, rank 1 13 s (another GPU's pace, a clock started later): alone, rank 1
    would save at step 5 where rank 0 saves at 10. Both save at the same steps, and the clocks
    are read at logging steps (every 5) only: no read between them."""
    bus, clocks = FromRank0(), [FakeClock(0.0), FakeClock(500.0)]
    ranks = [CheckpointClock(50, 60.0, 5, bus.share(r), clocks[r]) for r in range(2)]
    saved: list[list[int]] = [[], []]
    for step in range(1, 31):
        clocks[0].now += 10
        clocks[1].now += 13
        decisions = [clock.due(step) for clock in ranks]
        assert decisions[0] == decisions[1], step
        for r, clock in enumerate(ranks):
            if decisions[r]:
                clock.saved()
                saved[r].append(step)
    assert saved == [[10, 20, 30], [10, 20, 30]]
    assert clocks[0].reads == 1 + 6 + 3  # the start, 6 logging steps, 3 checkpoints


def test_by_steps_no_clock_is_read_and_nothing_is_shared():
    def never(verdict: bool) -> bool:
        raise AssertionError("a collective by steps")

    clock = FakeClock()
    saves = CheckpointClock(4, None, 5, never, clock)
    assert [step for step in range(1, 13) if saves.due(step)] == [4, 8, 12]
    assert clock.reads == 1
