"""What the kinds' heads share: the K/V types their attention passes, the captured layers'
ids (default and checks), the draft layer's rope, and the EAGLE family's layer variants (read by
the shared model card too). A kind's own module imports these, never another kind's module, so
a kind reads only its parent (P-EAGLE of EAGLE-3) and what is here."""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import LlamaConfig

from conf.errors import UserError

KV = tuple[torch.Tensor, torch.Tensor]


class KVStore(Protocol):
    """A cache that stores a step's K/V itself, as a transformers `Cache` does: `update` returns
    every K/V the step attends to (the decoder's static cache, whose mask hides the rest)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> KV: ...


# The layer variants the head implements, spelled as vLLM 0.32 `llama_eagle3` and speculators read
# them from a head's config (all false = the original EAGLE-3 layout):
#   norm_before_fc: one RMSNorm over the concatenated [n_aux * Ht] features before fc (`input_norm`);
#   fc_norm: one RMSNorm over each aux layer's [Ht] chunk before fc (`fc_norm.{i}.weight`, EAGLE
#     3.1); vLLM applies it after input_norm when both are on (`combine_hidden_states`);
#   norm_before_residual: the decoder layer's residual is hidden_norm(feature), not the raw feature;
#   norm_output: the hidden fed back to the next draft step is the final norm's output.
NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


def norm_flags(config: LlamaConfig | dict) -> dict[str, bool]:
    """The head's layer variants; a head saved before they existed has them all off."""
    values = config if isinstance(config, dict) else vars(config)
    return {k: bool(values.get(k, False)) for k in NORM_FLAGS}


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """The engines' default (2, N//2, N-3) where its ids are distinct (7+ layers). On a shallower
    target they collide (4 layers: 2, 2, 1), so take the lowest, middle and highest of the layer
    outputs every engine captures (1..N-1; 4 layers: 1, 2, 3); 3 layers have only two, so the
    embeddings (0) join them: vLLM serves that head, SGLang and TensorRT-LLM capture no id 0."""
    n = num_hidden_layers
    engines = [2, n // 2, n - 3]
    if engines[0] < engines[1] < engines[2]:
        return engines
    outputs = list(range(1 if n >= 4 else 0, n))
    return [outputs[0], outputs[len(outputs) // 2], outputs[-1]] if outputs else []


def resolve_aux_layer_ids(
    ids: list[int] | None, num_hidden_layers: int, where: str = "head.aux_layer_ids", count: int | None = 3
) -> list[int]:
    """The captured layers, sorted: `ids`, or `default_aux_layer_ids`; `count` of them (EAGLE-3's
    three), or any number with `count=None` (DFlash reads as many as it is given).

    The one place that knows the default and the valid range, so that data capture, the head
    and the evaluator can never disagree about which layers a head reads."""
    n = num_hidden_layers
    chosen = ids or default_aux_layer_ids(n)
    aux = sorted(set(chosen))
    if not aux or len(aux) != (count or len(chosen)) or aux[0] < 0 or aux[-1] > n:
        default = "" if ids else f" (the default for {n} layers)"
        many = f"{count} distinct ids" if count else "distinct ids"
        raise UserError(
            f"{where}={chosen}{default}: expected {many} in 0..{n} (HF hidden_states "
            f"indices of this {n}-layer target); train with head.aux_layer_ids=[a, b, c]"
        )
    return aux


def draft_rope(text_config) -> dict:
    """The rope the draft layer runs and its exported config names: the target's own (theta,
    scaling, `max_position_embeddings` beside it), so the draft rotates positions as the target
    does at every length it serves. A target with one rope per layer type (Gemma 3's local and
    global) gives its global layers' rope: the draft attends over every position, as they do.
    `partial_rotary_factor` is left out: the draft is a Llama layer that rotates every dimension,
    and the engines serve it from a config that does not carry the factor."""
    params = dict(text_config.rope_parameters)
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    params.pop("partial_rotary_factor", None)
    return params
