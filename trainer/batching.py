"""Length-grouped batches: little padding, a deterministic order per (seed, epoch) for exact resume."""

from __future__ import annotations

from functools import partial

import torch

from trainer.trainee import Batch, BatchIndex


def length_grouped_batches(
    lengths: list[int], batch_tokens: int, max_batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """Shuffle, sort by length inside windows of a few batches, pack each batch up to
    `batch_tokens` padded tokens, then shuffle the batches so lengths don't trend over an epoch."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    window = max_batch_size * 8
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: (-lengths[i], i))
        current: list[int] = []
        for i in chunk:
            longest = lengths[current[0]] if current else lengths[i]
            full = len(current) >= max_batch_size or (len(current) + 1) * longest > batch_tokens
            if current and full:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]


def shard_batches(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """Every rank gets the same number of batches (collectives must pair up): drop the remainder."""
    usable = len(batches) - len(batches) % world
    return batches[rank:usable:world]


def batch_loader(
    ds,
    batches: list[list[int]],
    workers: int,
    pin_memory: bool,
    index: BatchIndex | None = None,
):
    """Collated batches in `batches` order, read by `workers` processes (0: in this one), so that
    on a GPU host reading and padding the next batches can overlap the current step. `index` (a
    trainee's `batch_index`) adds its fields to each batch there too, before pinning."""
    return torch.utils.data.DataLoader(
        ds,
        batch_sampler=batches,
        collate_fn=partial(collate, index=index),
        num_workers=workers,
        pin_memory=pin_memory,
    )


def collate(samples: list[Batch], index: BatchIndex | None = None) -> Batch:
    """Right-pad to the longest sample: causal attention keeps real positions unaffected and
    the loss mask is False on padding. Then `index`'s fields, computed here on the CPU, where
    reading the mask costs no wait for a device."""
    longest = max(s["input_ids"].shape[0] for s in samples)
    out: Batch = {}
    for key in samples[0]:
        first = samples[0][key]
        padded = first.new_zeros((len(samples), longest, *first.shape[1:]))
        for row, s in enumerate(samples):
            padded[row, : s[key].shape[0]] = s[key]
        out[key] = padded
    out["attention_mask"] = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        out["attention_mask"][row, : s["input_ids"].shape[0]] = 1
    return out if index is None else out | index(out)
