"""Batches of samples: length-grouped and right-padded, or packed several to a row
(`optim.packing`); either way a deterministic order per (seed, epoch) for exact resume.

A packed row keeps its samples apart with per-sample position ids and causal attention (offline,
online and Medusa-2 alike), so each sample gets the loss it gets alone (tests/unit/trainer/test_packing.py).
Packing is off by default because a packed row spans the longest sample, and the attention that
costs outweighs the padding saved on the default data (3.8% of tokens padded, 0.7% packed:
`scripts/bench_packing.py`, which prints both padding shares for any config).
"""

from __future__ import annotations

import bisect
from functools import partial
from typing import TypeVar

import torch

from conf.schema import OptimConfig
from trainer.trainee import Batch, BatchIndex

B = TypeVar("B")  # a batch of sample indices: padded (list[int]) or packed (rows, list[list[int]])


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


# Samples a packing window holds: this many batches' worth of tokens. Rows are packed inside a
# window, so a larger one fills rows better (less padding) at a smaller variety between epochs.
PACK_WINDOW_BATCHES = 16


def best_fit_rows(lengths: list[int], indices: list[int], row_tokens: int) -> list[list[int]]:
    """Best-fit decreasing: each sample, longest first, into the open row it fills most tightly,
    else a new row. A sample longer than a row gets a row of its own: never split, so that its
    positions keep all the context they had."""
    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, row), ascending
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect.bisect_left(rooms, (n, -1))
        if at < len(rooms):
            room, row = rooms.pop(at)
            rows[row].append(i)
            bisect.insort(rooms, (room - n, row))
        else:
            rows.append([i])
            bisect.insort(rooms, (max(row_tokens - n, 0), len(rows) - 1))
    return rows


def packed_batches(
    lengths: list[int], batch_tokens: int, max_batch_size: int, seed: int, epoch: int
) -> list[list[list[int]]]:
    """Batches of rows, each row several samples back to back (`collate_packed` keeps them
    apart): rows of `row_tokens` = the longest sample (at most `batch_tokens`), so that no
    sample is split and attention spans no more than the padded batches' widest rows; as many
    rows per batch as `batch_tokens` holds (at most `max_batch_size`). Shuffle, pack each
    window of samples best-fit, group rows of similar fill (a batch pads its rows to the
    fullest), then shuffle the batches. With a sample longer than `batch_tokens`, rows are
    `batch_tokens` long, one per batch, and that sample has a batch of its own, as padded
    batching gives it."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    row_tokens = min(batch_tokens, max(lengths, default=1))
    per_batch = max(1, min(max_batch_size, batch_tokens // row_tokens))
    window_tokens = PACK_WINDOW_BATCHES * per_batch * row_tokens
    batches: list[list[list[int]]] = []
    start = 0
    while start < len(order):
        end, tokens = start, 0
        while end < len(order) and tokens < window_tokens:
            tokens += lengths[order[end]]
            end += 1
        rows = best_fit_rows(lengths, order[start:end], row_tokens)
        rows.sort(key=lambda r: -sum(lengths[i] for i in r))
        batches += [rows[a : a + per_batch] for a in range(0, len(rows), per_batch)]
        start = end
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]


def padding_share(lengths: list[int], batches: list[list[list[int]]]) -> float:
    """Pad tokens / all tokens of `batches` (of rows, as `packed_batches` makes them; a padded
    batch is rows of one sample) as collated: each batch is its rows x its fullest row."""
    total = sum(len(b) * max(sum(lengths[i] for i in row) for row in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for row in b for i in row) / max(total, 1)


def shard_batches(batches: list[B], rank: int, world: int) -> list[B]:
    """Every rank gets the same number of batches (collectives must pair up): drop the remainder."""
    usable = len(batches) - len(batches) % world
    return batches[rank:usable:world]


def rank_batches(ds, optim: OptimConfig, seed: int, epoch: int, rank: int, world: int) -> list:
    """This rank's batches of `ds` in `epoch`, as sample indices: the order is a function of
    (seed, epoch) alone, so a resumed run, and a fault's report, rebuild it exactly."""
    grouping = packed_batches if optim.packing else length_grouped_batches
    all_batches = grouping(ds.lengths, optim.batch_tokens, optim.max_batch_size, seed, epoch)
    return shard_batches(all_batches, rank, world)


def validation_batches(ds, optim: OptimConfig, seed: int, rank: int, world: int, limit: int | None) -> list:
    """This rank's validation batches: epoch 0's order, rebuilt the same at every validation,
    cut to its first `limit` (None: all). Rank r's first k are the order's batches r, r + world,
    ..., so across ranks a capped validation reads the first k x world batches of one fixed,
    shuffled order: the same batches at every validation, so that scores compare across steps
    and the kept head is chosen fairly, and as many on every rank, so collectives pair up."""
    return rank_batches(ds, optim, seed, 0, rank, world)[:limit]


class Rows(torch.utils.data.Dataset):
    """`ds` read a row at a time: the items of a packed batch are rows, lists of sample indices."""

    def __init__(self, ds):
        self.ds = ds

    def __getitem__(self, row: list[int]) -> list[Batch]:
        return [self.ds[i] for i in row]


def batch_loader(
    ds,
    batches: list,
    workers: int,
    pin_memory: bool,
    index: BatchIndex | None = None,
    packed: bool = False,
):
    """Collated batches in `batches` order (of `packed_batches` if `packed`, else of sample
    indices), read by `workers` processes (0: in this one), so that on a GPU host reading and
    padding the next batches can overlap the current step. `index` (a trainee's `batch_index`)
    adds its fields to each batch there too, before pinning."""
    return torch.utils.data.DataLoader(
        Rows(ds) if packed else ds,
        batch_sampler=batches,
        collate_fn=partial(collate_packed if packed else collate, index=index),
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


def pack_row(samples: list[Batch]) -> Batch:
    """Samples back to back in one row, with `position_ids` restarting at 0 at each: all the
    objectives and the target need to keep them apart (a token attends to and is predicted from
    its own sample only, see `data_prep.states.capture.document_mask`)."""
    row = {key: torch.cat([s[key] for s in samples]) for key in samples[0]}
    row["position_ids"] = torch.cat([torch.arange(s["input_ids"].shape[0]) for s in samples])
    return row


def collate_packed(rows: list[list[Batch]], index: BatchIndex | None = None) -> Batch:
    """`collate` of packed rows: padding positions get position 0, each a document of its own."""
    return collate([pack_row(samples) for samples in rows], index)
