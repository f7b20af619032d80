"""Run the frozen target over tokenized samples and keep the hidden states a head trains on.

One forward per length-grouped batch gives every layer's residual stream
(`output_hidden_states`, the project's one layer convention: HF index k = after k decoder
layers, N = after the final norm). EAGLE-3 keeps three of them concatenated, Medusa the final
one, Medusa-2 joint training none (it runs the target itself). Storage is bf16, or fp8 e4m3 with
one scale per token and layer, which halves the bytes at ~2-3 significant bits of loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_prep.template import Tokenized

LAYER_CONVENTION = "hf_hidden_states"
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


@dataclass(frozen=True)
class CaptureSpec:
    """What to keep per token; empty `aux_layer_ids` and `final=False` = tokens only."""

    aux_layer_ids: tuple[int, ...]
    final_layer_id: int | None
    storage_dtype: str = "bfloat16"  # one of conf.schema.STORAGE_DTYPES

    @property
    def needs_forward(self) -> bool:
        return bool(self.aux_layer_ids) or self.final_layer_id is not None


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (count * longest) stays within `batch_tokens`.

    Callers pass samples sorted by length, so consecutive groups waste little padding.
    """
    batches: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if batches and max(longest, n) * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)
            longest = max(longest, n)
        else:
            batches.append([i])
            longest = n
    return batches


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, G*H] float -> (fp8 [T, G*H], float32 scale [T, G]): one scale per token and layer."""
    t = x.shape[0]
    chunks = x.float().reshape(t, groups, -1)
    scale = (chunks.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    q = (chunks / scale.unsqueeze(-1)).to(FP8)
    return q.reshape(t, -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    t, groups = scale.shape
    return (q.float().reshape(t, groups, -1) * scale.unsqueeze(-1)).reshape(t, -1)


def encode(name: str, x: torch.Tensor, groups: int, storage_dtype: str) -> dict[str, torch.Tensor]:
    """Storage tensors for one hidden-state field: `name` (+ `name_scale` in fp8)."""
    if storage_dtype == "fp8":
        q, scale = quantize_fp8(x, groups)
        return {name: q, f"{name}_scale": scale}
    return {name: x.to(torch.bfloat16)}


def decode(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Inverse of `encode`: float32 [T, G*H]."""
    scale = tensors.get(f"{name}_scale")
    return tensors[name].float() if scale is None else dequantize_fp8(tensors[name], scale)


@torch.inference_mode()
def forward_hidden(model, batch: list[list[int]], spec: CaptureSpec) -> list[dict]:
    """One right-padded forward; per sample `aux` [L, 3H] and/or `final` [L, H] in float32."""
    width = max(len(ids) for ids in batch)
    pad = 0
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in batch], device=model.device)
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch], device=model.device)
    # logits_to_keep=1: the lm_head over the whole vocabulary is not needed here.
    hs = model(
        input_ids=ids,
        attention_mask=attn,
        output_hidden_states=True,
        use_cache=False,
        logits_to_keep=1,
    ).hidden_states
    aux = torch.cat([hs[i] for i in spec.aux_layer_ids], dim=-1) if spec.aux_layer_ids else None
    final = hs[spec.final_layer_id] if spec.final_layer_id is not None else None
    out = []
    for b, s in enumerate(batch):
        item = {}
        if aux is not None:
            item["aux"] = aux[b, : len(s)].float().cpu()
        if final is not None:
            item["final"] = final[b, : len(s)].float().cpu()
        out.append(item)
    return out


def capture_shard(
    model, samples: list[Tokenized], spec: CaptureSpec, batch_tokens: int
) -> dict[str, torch.Tensor]:
    """The tensors of one shard: samples concatenated along tokens, `offsets` [n+1] delimits them.

    Deterministic for a given sample list (batches depend only on it), which is what lets a
    resumed run reproduce the shards of an uninterrupted one byte for byte.
    """
    lengths = [len(s.input_ids) for s in samples]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {
        "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool),
        "offsets": offsets,
    }
    if not spec.needs_forward:
        return tensors
    # Encoded per sample so a shard never holds more than one batch in float32.
    parts: dict[str, list[torch.Tensor]] = {}
    fields = {"aux": ("aux_hidden", len(spec.aux_layer_ids)), "final": ("final_hidden", 1)}
    for idx in length_batches(lengths, batch_tokens):
        for item in forward_hidden(model, [samples[i].input_ids for i in idx], spec):
            for key, value in item.items():
                name, groups = fields[key]
                for k, v in encode(name, value, groups, spec.storage_dtype).items():
                    parts.setdefault(k, []).append(v)
    return tensors | {k: torch.cat(v) for k, v in parts.items()}
