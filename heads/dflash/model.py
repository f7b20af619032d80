"""The DFlash draft head: Qwen3 decoder layers that draft a block of tokens in one forward.

The layout is what vLLM 0.32 serves as `method: dflash` (`model_executor/models/qwen3_dflash.py`,
proposer `v1/spec_decode/dflash.py`), so that export renames nothing:
- context: the target's aux-layer features of the verified positions, concatenated (ascending
  layer ids) and fused by `fc`, normed by `hidden_norm`, become every layer's K/V directly
  (`k_proj` -> `k_norm` -> rope, `v_proj`; no input norm): they never pass through a layer;
- block: the last accepted token, then block_size - 1 mask tokens, at the positions right after
  the context, embedded with the target's embeddings and run through the layers (pre-norm, Qwen3
  attention with per-head `q_norm` / `k_norm`), attending to the context and to the block
  (every slot, or the slots before it with `causal`); slot k >= 1 predicts the token at its own
  position through the final `norm` and the target's lm_head.
vLLM ships neither embeddings nor lm_head with such a head: it shares the target's. The head holds
frozen copies (never saved), so that training, decoding and export checks run the served model.

One `block` serves training (past = context K/V per layer, many blocks per row under one mask)
and decoding (past = the drafter's cache of verified positions): the caller owns the mask.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from conf.errors import UserError
from conf.kinds import DFlashConfig
from heads.folder import TargetSpec, load_head, save_head
from heads.parts import KV, KVStore, draft_rope, resolve_aux_layer_ids
from heads.window import window_fields

# Target-owned parts of the head: copied from the target, frozen, never saved (vLLM shares them).
SHARED = ("embed_tokens.", "lm_head.", "rotary.")


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The mask slots' input id when `head.mask_token_id` is null: a token chat rows never hold,
    so a mask slot cannot read as text. The tokenizer's mask token; else the first embedding row
    past the tokenizer (no text maps to it); else its unk token (a byte-level tokenizer never
    emits one), pad or EOS token (SpecForge's fallbacks, in this order of rarity in chat rows)."""
    candidates = [getattr(tokenizer, "mask_token_id", None)]
    if len(tokenizer) < vocab_size:
        candidates.append(len(tokenizer))
    candidates += [getattr(tokenizer, f"{name}_token_id", None) for name in ("unk", "pad", "eos")]
    found = next((int(c) for c in candidates if c is not None and 0 <= int(c) < vocab_size), None)
    if found is None:
        raise UserError("head.mask_token_id=null: the tokenizer has no token to mask with; set one")
    return found


def check_mask_token_id(mask_token_id: int, vocab_size: int) -> None:
    if not 0 <= mask_token_id < vocab_size:
        raise UserError(f"head.mask_token_id={mask_token_id}: expected an id below the target's {vocab_size}")


def check_target(cfg: DFlashConfig, target_config) -> None:
    """An explicit `head.mask_token_id` lies inside this target's vocabulary (`HeadKind.check_target`;
    the default comes from the tokenizer, inside it by construction)."""
    if cfg.mask_token_id is not None:
        check_mask_token_id(cfg.mask_token_id, target_config.get_text_config().vocab_size)


def captured_layers(cfg: DFlashConfig, num_hidden_layers: int) -> tuple[tuple[int, ...], int]:
    """(aux layer ids, final layer id): the fused context features, and the final hidden state
    the target's lm_head turns into the teacher's distribution."""
    aux = resolve_aux_layer_ids(cfg.aux_layer_ids, num_hidden_layers, count=None)
    return tuple(aux), num_hidden_layers


def draft_config(target_config, cfg: DFlashConfig, mask_token_id: int) -> Qwen3Config:
    """The draft's Qwen3Config, derived from the target's (any family): the target's width (vLLM
    feeds the draft the target's embeddings), rope and norm epsilon; the head's own fields
    (`aux_layer_ids`, `block_size`, `causal`, `mask_token_id`, `target_hidden_size`) ride along."""
    t = target_config.get_text_config()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    num_heads = cfg.num_attention_heads or t.num_attention_heads
    check_mask_token_id(mask_token_id, t.vocab_size)
    return Qwen3Config(
        hidden_size=t.hidden_size,
        intermediate_size=cfg.intermediate_size or t.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.num_key_value_heads or getattr(t, "num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings,
        vocab_size=t.vocab_size,
        hidden_act="silu",
        rope_parameters=draft_rope(t),
        attention_bias=False,
        tie_word_embeddings=False,
        target_hidden_size=t.hidden_size,
        aux_layer_ids=resolve_aux_layer_ids(cfg.aux_layer_ids, t.num_hidden_layers, count=None),
        block_size=cfg.block_size,
        causal=cfg.causal,
        mask_token_id=mask_token_id,
        **qwen3_window(cfg.sliding_window, cfg.num_layers),
    )


def qwen3_window(window: int | None, layers: int) -> dict:
    """`heads.window`'s fields as a Qwen3Config keeps them: it drops `sliding_window` unless
    `use_sliding_window`, and slides only from layer `max_window_layers` on (vLLM builds the
    exported config.json with it, so the export carries these too)."""
    if window is None:
        return {}
    return {"use_sliding_window": True, "max_window_layers": 0, **window_fields(window, layers)}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope (the neox half-split vLLM's DFlash uses) on x [B, heads, T, d], cos/sin [B, T, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys are the context's (precomputed per layer) and the block's own."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.layer_idx, self.head_dim = layer_idx, d
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return proj(x).view(b, t, n, self.head_dim)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """Rotated, k-normed keys and values [B, kv_heads, T, d] of inputs x [B, T, H]: the
        block's own, or the context's (x = the normed fused features)."""
        k = self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads)).transpose(1, 2)
        v = self._heads(x, self.v_proj, self.num_kv_heads).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x, cos, sin, mask: torch.Tensor | None, past: KV | KVStore | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = rotate(self.q_norm(self._heads(x, self.q_proj, self.num_heads)).transpose(1, 2), cos, sin)
        k, v = self.kv(x, cos, sin)
        if past is None:
            keys, values = k, v
        elif isinstance(past, tuple):
            keys, values = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        else:
            keys, values = past.update(k, v, self.layer_idx)
        rep = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1), attn_mask=mask
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashDecoderLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer over the block (the context skips it: see `context_kv`)."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x, cos, sin, mask, past) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(nn.Module):
    """The draft model; `embed_tokens` and `lm_head` are the target's, frozen and never saved."""

    kind = "dflash"

    def __init__(self, config: Qwen3Config, target: TargetSpec):
        super().__init__()
        self.config, self.target = config, target
        h, v = config.hidden_size, config.vocab_size
        self.aux_layer_ids: list[int] = list(config.aux_layer_ids)
        self.block_size, self.causal = int(config.block_size), bool(config.causal)
        self.mask_token_id = int(config.mask_token_id)
        self.embed_tokens = nn.Embedding(v, h).requires_grad_(False)
        self.lm_head = nn.Linear(h, v, bias=False).requires_grad_(False)
        self.fc = nn.Linear(len(self.aux_layer_ids) * config.target_hidden_size, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_target(cls, target_model, target_name: str, cfg: DFlashConfig, mask_token_id: int) -> DFlashHead:
        """A fresh head for `target_model`, its embeddings and lm_head shared (copied, frozen)."""
        head = cls(cls.head_config(target_model.config, cfg, mask_token_id),
                   TargetSpec.from_model(target_model, target_name))
        return head.share_target(target_model)

    @classmethod
    def head_config(cls, target_config, cfg: DFlashConfig, mask_token_id: int) -> Qwen3Config:
        """The head's saved config for this target and head config (`draft_config`); a derived
        kind adds its own fields."""
        return draft_config(target_config, cfg, mask_token_id)

    def share_target(self, target_model) -> DFlashHead:
        """Copy the target's embeddings and lm_head in: what vLLM gives a head that ships none."""
        self.embed_tokens.weight.data.copy_(target_model.get_input_embeddings().weight.float())
        self.lm_head.weight.data.copy_(target_model.get_output_embeddings().weight.float())
        return self

    # ---- compute ------------------------------------------------------------------------
    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[..., n_aux*Ht] target features (ascending layer ids) -> [..., H] context states,
        normed: what every layer's context K/V are projected from."""
        return self.hidden_norm(self.fc(aux_hidden))

    def context_kv(self, context: torch.Tensor, position_ids: torch.Tensor) -> list[KV]:
        """Each layer's K/V [B, kv_heads, T, d] of context states [B, T, H] at position_ids [B, T]."""
        cos, sin = self.rotary(context, position_ids)
        return [layer.self_attn.kv(context, cos, sin) for layer in self.layers]

    def block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """Token ids [..., block_size] of blocks starting at anchor tokens [...]: the anchor,
        then mask tokens, as vLLM's proposer lays them out."""
        ids = anchors.new_full((*anchors.shape, self.block_size), self.mask_token_id)
        ids[..., 0] = anchors
        return ids

    def block_mask(self, n_blocks: int, device: torch.device | None = None) -> torch.Tensor:
        """Bool [n*B, n*B]: which block slots a slot attends to, for n blocks side by side
        (each its own; inside it every slot, or the slots before it with `causal`)."""
        b = self.block_size
        inside = torch.ones(b, b, dtype=torch.bool, device=device)
        if self.causal:
            inside = inside.tril()
        return torch.block_diag(*[inside] * n_blocks) if n_blocks > 1 else inside

    def block(
        self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
        past: list[KV | KVStore],
    ) -> torch.Tensor:
        """The layers over block tokens ids [B, T] at position_ids [B, T] -> final-normed hidden
        [B, T, H]. past: per layer the context K/V (a tuple the block's own are appended to, or a
        `KVStore` that writes them); mask: bool or additive [B|1, 1, T, keys] over those keys."""
        x = self.embed_tokens(ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(x, position_ids)
        for layer, layer_past in zip(self.layers, past):
            x = layer(x, cos, sin, mask, layer_past)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits of `block` hidden states, through the target's lm_head."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    # ---- folder format ------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path, state: dict | None = None) -> Path:
        """`state` replaces the live weights (ZeRO-3 gathers them elsewhere)."""
        tensors = {k: v for k, v in (state or self.state_dict()).items() if not k.startswith(SHARED)}
        return save_head(out_dir, self.kind, self.config.to_dict(), self.target, tensors)

    @classmethod
    def from_pretrained(cls, path: str | Path, target_model, target_name: str) -> DFlashHead:
        """Load a saved head against `target_model`; refuse one trained for another target."""
        config_dict, spec, tensors = load_head(path, cls.kind)
        spec.check(TargetSpec.from_model(target_model, target_name), f"head={str(path)!r}")
        head = build(Qwen3Config(**config_dict), spec, tensors, f"head={str(path)!r}", cls)
        return head.share_target(target_model)


def build(config: Qwen3Config, spec: TargetSpec, tensors: dict[str, torch.Tensor], where: str,
          head_class: type[DFlashHead] = DFlashHead) -> DFlashHead:
    """A head of `head_class` from its config and its own tensors (the shared parts left at
    their init)."""
    head = head_class(config, spec)
    missing, unexpected = head.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    missing = [k for k in missing if not k.startswith(SHARED)]
    if missing or unexpected:
        raise UserError(f"{where}: missing {missing}, unexpected {unexpected}")
    return head


def load_for_decoding(path: str | Path, target_model, target_name: str,
                      head_class: type[DFlashHead] = DFlashHead) -> tuple[DFlashHead, object]:
    """(head, the model that verifies its drafts): the head refuses a target other than its own,
    and aux layer ids this target lacks, before anything is decoded."""
    head = head_class.from_pretrained(path, target_model, target_name)
    n_layers = target_model.config.get_text_config().num_hidden_layers
    where = f"the head at {str(path)!r}: aux_layer_ids"
    resolve_aux_layer_ids(head.aux_layer_ids, n_layers, where, count=None)
    return head, target_model
