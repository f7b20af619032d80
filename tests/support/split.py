"""The validation split as data prep computes it, by uid, for tests that reason about uids."""

from __future__ import annotations

import torch

from data_prep.conversations.sources import held_out, prompt_uid, split_hash


def validation_uids(uids: list[str], seed: int, val_fraction: float) -> set[str]:
    """The uids `held_out` puts in validation, hashing each sample's prompt uid as prepare does."""
    hashes = torch.tensor([split_hash(prompt_uid(u), seed) for u in uids], dtype=torch.float64)
    return {u for u, held in zip(uids, held_out(hashes, val_fraction).tolist()) if held}
