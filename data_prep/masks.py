"""Additive attention masks. The regeneration engine and the decoder both own their model's KV
cache and pass every mask in explicitly; both build it here, so they agree on the one convention
that eager and SDPA attention read the same way."""

from __future__ import annotations

import torch


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = may attend) -> float mask: 0 where allowed, the dtype's lowest elsewhere
    (not -inf, which turns a row with nothing allowed into NaN)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)
