"""A draft's sliding attention window: the draft attends to its last W positions only.

Why: a head trained at short context drafts worse at long context (the field measured an EAGLE-3
head trained at 2k fall from τ 2.30 to 1.09 at 16k), and a window keeps the draft's attention at
distances it has seen; the target's attention is untouched, so the output stays the target's.
`head.sliding_window` trains and decodes a head that way and writes it into every export;
`eval.sliding_window` applies one at inference only, to a head trained without.

One meaning everywhere, transformers' and vLLM's: a query at position p sees a key at position i
only when p - i < W. The draft's config holds it as those engines read it: `sliding_window` with
every layer's `layer_types` entry "sliding_attention". vLLM's llama layers (which its EAGLE-3 and
P-EAGLE drafts are) pass `config.sliding_window` to their attention as per_layer_sliding_window for
such a layer; its `qwen3_dflash` resolves the same two fields per layer (`dflash_config`'s own
`swa_window_size` would take precedence; we do not write it); a speculators config's
`transformer_layer_config` reaches vLLM as the draft's config, so the same two fields serve there.
"""

from __future__ import annotations

import torch

SLIDING = "sliding_attention"


def window_fields(window: int | None, layers: int) -> dict:
    """The draft config's fields for `window` over `layers` decoder layers (none without one)."""
    if window is None:
        return {}
    return {"sliding_window": int(window), "layer_types": [SLIDING] * layers}


def window_of(config) -> int | None:
    """The window a draft config (a transformers config, or its dict as a config.json holds it)
    asks for, as the engines read it: `sliding_window` where its layers are sliding ones (a
    `sliding_window` alone, as Qwen3's default config carries, is none)."""
    fields = config if isinstance(config, dict) else vars(config)
    if SLIDING not in (fields.get("layer_types") or ()):
        return None
    return fields.get("sliding_window")


def asked_window(settings: dict) -> int | None:
    """The window of a saved head's config (its layer types say, `window_of`) or of a command's
    `head.*` settings, which carry `sliding_window` alone: the export refusals read both, so a
    format that cannot hold a window is refused when the command starts, not after training."""
    return window_of(settings) if "layer_types" in settings else settings.get("sliding_window")


def near(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor | bool:
    """Bool [..., Q, K]: key positions `keys` [K] within `window` of query positions `queries`
    [..., Q] (True where there is no window). Keys after a query are the causal mask's to hide."""
    if window is None:
        return True
    return queries[..., None] - keys < window
