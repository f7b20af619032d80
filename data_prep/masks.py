"""Attention masks. The regeneration engine and the decoder both own their model's KV cache and
pass every mask in explicitly, and capture hands its forward ready-made 4D masks
(`capture.attention_masks`); all build them here, so they agree on the one convention that eager
and SDPA attention read the same way, and on which positions each layer of the target may see.

A target's layers need not all see the same positions: Mistral slides every layer over a window,
Gemma 3 and gpt-oss mix sliding and full layers, Qwen 2 slides the layers past
`max_window_layers`. transformers decides per layer from the config (`layer_types`, or
`sliding_window` on every layer) and builds one mask per layer type; a KV cache that keeps every
position stays exact when the mask of a sliding layer also hides the keys that fell out of its
window. `AttentionLayout` is that decision, read from the config the way transformers' own caches
read it, so a caller builds the masks its forward needs without re-implementing attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conf.errors import UserError

FULL, SLIDING = "full_attention", "sliding_attention"


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = may attend) -> float mask: 0 where allowed, the dtype's lowest elsewhere
    (not -inf, which turns a row with nothing allowed into NaN)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


@dataclass(frozen=True)
class AttentionLayout:
    """`windows[i]`: how many positions, the query's own included, layer i attends back over
    (None: all of them). transformers' rule (`sliding_window_overlay`): a key at distance
    `query position - key position` is in the window when that distance is below the window."""

    windows: tuple[int | None, ...]

    @property
    def kinds(self) -> tuple[int | None, ...]:
        """The distinct windows, in layer order: one mask is built per kind."""
        return tuple(dict.fromkeys(self.windows))

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    def masks(self, keep: torch.Tensor, distance: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """keep: bool [..., Q, K], what every layer may see (causality, padding, a tree's
        ancestors); distance: each query's position minus each key's, broadcastable to keep (None
        when no layer slides: nothing reads it). -> additive masks [kinds, ..., Q, K], a sliding
        kind also hiding what lies outside its window. Stacked in one tensor, so a CUDA graph
        takes them as one input; a target of one kind gets its one mask as a view."""
        kept = [keep if w is None else keep & (distance < w) for w in self.kinds]
        if len(kept) == 1:
            return additive_mask(kept[0], dtype)[None]
        shape = torch.broadcast_shapes(*(k.shape for k in kept))
        return torch.stack([additive_mask(k.expand(shape), dtype) for k in kept])

    def argument(self, masks: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The `attention_mask` a forward takes for `masks` (from `masks()`): one 4D mask when
        every layer reads the same (a model then uses it as it is, whatever its family), else
        one per layer type, the mapping transformers' hybrid models take as it is."""
        if len(masks) == 1:
            return masks[0]
        return {SLIDING if w is not None else FULL: m for w, m in zip(self.kinds, masks)}


DECODERS = "draftsmith's regeneration engine and decoder"
DECODERS_WAY_OUT = "use data.regenerate.backend=vllm, pipeline.evaluate=false and optim.val_decode_prompts=0"


def check_masked(implementation: str | None, stage: str, way_out: str) -> None:
    """Refuse, in one line naming `target.attn_implementation`, an attention that does not read
    the dense 4D masks `stage` hands the target (static caches, packed documents, sliding windows):
    transformers passes a ready-made 4D mask to the attention as it is, and flash attention
    (`flash_attention_*`, and the Hub's kernels, flash ones) reads a mask as padding only, so
    the hidden states would silently be wrong. None is transformers' default (sdpa or eager)."""
    if implementation is None or not (implementation.startswith("flash_attention") or "/" in implementation):
        return
    raise UserError(
        f"target.attn_implementation={implementation}: the target gets dense attention masks from "
        f"{stage}, which this attention does not read; use eager, sdpa or flex_attention, or {way_out}"
    )


def attention_layout(config, implementation: str | None = None) -> AttentionLayout:
    """The layout of a transformers model config (its text decoder's), as transformers' caches
    read it (`get_layer_types_and_kwargs`). Refuses, in one line, a target with layers that are
    neither full nor sliding-window attention (chunked, linear, recurrent, KV shared with
    another layer), or with sliding windows of several sizes: the static caches cannot mask them
    as transformers does; and an attention that reads no dense mask (`check_masked`):
    `implementation`, `target.attn_implementation` before the weights load, else the loaded
    config's."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    check_masked(implementation or config._attn_implementation, DECODERS, DECODERS_WAY_OUT)
    text = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(text)
    other = sorted(set(types) - {FULL, SLIDING})
    windows = tuple(kw["sliding_window"] if t == SLIDING else None for t, kw in zip(types, kwargs))
    sizes = sorted({w for w in windows if w is not None})
    why = None
    if other:
        count = sum(t not in (FULL, SLIDING) for t in types)
        why = f"{count} of its {len(types)} layers are {' or '.join(other)}"
    elif len(sizes) > 1:
        why = f"its sliding layers use windows of several sizes {sizes}"
    if why:
        raise UserError(
            f"target ({text.model_type}): {why}, which {DECODERS} cannot mask as transformers does "
            f"(they run full and sliding-window attention only); {DECODERS_WAY_OUT}"
        )
    return AttentionLayout(windows)
