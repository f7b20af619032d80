"""Data prep on every rank: under torchrun each process regenerates and captures its share.

On an 8-GPU node one process preparing data leaves seven GPUs idle through the largest stage of a
job, and a second node cannot help at all. With `torchrun -m data_prep.prepare` (or the main job
under torchrun, on a file system every rank sees) the ranks build one folder together:
1. regeneration: each rank answers the conversations whose prompt hashes to it (a prompt's
   sampled answers stay on one rank) into its own part of the answer cache, after rank 0 has
   folded any part a killed run left into the cache; rank 0 then folds every part in;
2. every rank reads the same answers and orders the same rows (a cheap, deterministic pass), so
   the split, the shards' boundaries and the draft vocabulary are those a single process gets;
3. capture: each rank writes its shards into the partial folder, the shards of both splits
   balanced over the ranks by their tokens (`balanced_owners`: shards are length-sorted, so
   one by index would give one rank the longest);
4. rank 0 reads every shard's record, counts the draft vocabulary and writes the manifest.
Nothing is written twice and a killed rank loses only what it had in flight: answers are
appended as they arrive, shards are whole files, and the next run (any world size) completes the
folder. The ranks talk over a gloo group with a day's timeout (a stage can take hours, longer
than the default group's timeout, and NCCL's).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from data_prep.conversations.sources import prompt_uid
from data_prep.target import resolve_device

TIMEOUT = datetime.timedelta(days=1)
T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the processes preparing one folder (one process: 0 of 1)."""

    rank: int = 0
    world: int = 1
    group: Any = None  # the gloo group the ranks wait on

    @classmethod
    def from_env(cls) -> Ranks:
        """torchrun's RANK and WORLD_SIZE; joins (or starts) the process group, with this
        process's GPU, if it has one, made current (`cuda:LOCAL_RANK`) first, so that whatever
        names plain `cuda` later (the target, the engine's free-memory probe) is its own GPU."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if torch.cuda.is_available():
            torch.cuda.set_device(resolve_device("cuda"))
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=TIMEOUT)
        return cls(dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo", timeout=TIMEOUT))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def from_main(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def main_does(self, work: Callable[[], T]) -> T:
        """`work()` done by rank 0 alone, its value on every rank; the others wait meanwhile, as
        long as it takes (this group waits a day). Should rank 0 fail, torchrun stops the rest."""
        return self.from_main(work() if self.main else None)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if self.world == 1:
            return [value]
        values = [None] * self.world
        dist.all_gather_object(values, value, group=self.group)
        return values

    def all(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""
        return all(self.gather(flag))

    def close(self) -> None:
        """Leave the process group this process started (`from_env`)."""
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def owns_prompt(self, uid: str) -> bool:
        """Whether this rank answers the conversation `uid` (all of a prompt's answers alike)."""
        digest = hashlib.sha256(prompt_uid(uid).encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.world == self.rank

    def share_folder(self, folder: Path) -> bool:
        """Whether every rank sees the same `folder` (one file system), by a file rank 0 writes."""
        if self.world == 1:
            return True
        folder.mkdir(parents=True, exist_ok=True)
        token = self.from_main(uuid.uuid4().hex)
        mark = folder / f".ranks-{token}"
        if self.main:
            mark.write_text(token)
        self.barrier()
        seen = mark.exists()
        shared = self.all(seen)
        if self.main:
            mark.unlink()
        return shared


SINGLE = Ranks()


def balanced_owners(costs: Sequence[int], world: int) -> list[int]:
    """The rank that does each job of `costs` (e.g. a shard's tokens): the largest job first, each
    to the rank with the least work so far, ties to the lower rank (longest-processing-time
    first: within 4/3 of the best split). Pure, so every rank computes the same owners."""
    load, owners = [0] * world, [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        owners[job] = min(range(world), key=lambda r: (load[r], r))
        load[owners[job]] += costs[job]
    return owners
