"""The EAGLE-3 draft head: fc fusion of three target layers, one decoder layer, a reduced-vocab lm_head.

The layout (names, the 2H attention input, where the norms sit) follows what the serving engines
load (vLLM `llama_eagle3`, SGLang, TRT-LLM), so that export is a renaming and nothing else. The
layer variants in `NORM_FLAGS` are vLLM's and speculators' own flags, with their placement and
tensor names (`input_norm.weight`, `fc_norm.{i}.weight`), so a head trained with them is served as
it was trained.
One `step` serves training (the TTT unroll passes earlier steps' K/V as `past`) and decoding
(the decoder passes its static KV cache as `past`): the caller owns the mask, so both see one code
path. A TTT step after the first passes `Branches` instead of a mask over every earlier step's
keys: a query may read only its own row of those, so `branch_attention` scores them as one dot
product each beside the masked context, instead of a kernel walking a mask that is diagonal in
all but its first block (keys that are mostly masked out: `scripts/bench_train.py`'s three steps
of attention, forward and backward, went from ~260 to ~170 ms on two CPU cores).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from conf.errors import UserError
from conf.kinds import Eagle3Config
from heads.folder import TargetSpec, load_head, save_head
from heads.parts import KV, NORM_FLAGS, KVStore, draft_rope, norm_flags, resolve_aux_layer_ids
from heads.window import window_fields


class Branches(NamedTuple):
    """What a TTT unroll step after the first attends to: the verified context's K/V [B,KV,T,D]
    (step 0's, over every position) under `mask` bool [B,1,S,T] (causal within each document),
    and the K/V [B,KV,S,D] of each step between, at the query's own row only: the draft tokens
    of that query's branch, what a chain decoder's cache holds at inference."""

    context: KV
    mask: torch.Tensor
    steps: tuple[KV, ...] = ()


# Whether the head's attention is shaped for CUDA's fused SDPA kernels (flash, memory-efficient):
# None decides by the device (CUDA: yes), True forces that path on any device (the CPU tests hold it
# equal to the other), False keeps the path a CPU runs everywhere (the old GPU path, to compare).
# On CUDA a bool mask rules out flash, and with `enable_gqa` the memory-efficient kernel too: SDPA
# falls back to its math kernel, [B, H, T, T] float32 scores and probabilities (4 GB a tensor at
# T=2048, B=8). The CPU keeps its path: its kernels take the mask and GQA as they are.
FUSED_KERNELS: bool | None = None


def fused_kernels(x: torch.Tensor) -> bool:
    """Whether attention over tensors like `x` takes the fused-kernel path (`FUSED_KERNELS`)."""
    return x.is_cuda if FUSED_KERNELS is None else FUSED_KERNELS


def context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, fused: bool
) -> torch.Tensor:
    """Attention of queries q [B,H,T,D] over their own K/V [B,KV,T,D] (TTT step 0, every position;
    no past). `mask` None: exactly causal, which SDPA runs as flash with GQA on CUDA (the caller
    passes None only where its mask would be exactly that, a fact of the batch's layout known on
    the host). Otherwise bool [B|1,1,T,T]: `fused` repeats the K/V groups to every query head, since
    the memory-efficient kernel, the fused one that takes a mask, does not take GQA; without it the
    query heads read their group in place (`enable_gqa`), what the CPU's kernels take."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)
    if fused:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


# Query rows of a later TTT step scored at once: a step materialises [B, H, rows, T] float32 scores
# (and the probabilities its backward keeps), so a long context runs in chunks of rows, each
# recomputed in the backward pass (`torch.utils.checkpoint`): memory linear in T, not quadratic.
# On a CPU 2**25 scores (128 MiB) leave the main job's rows of 512 tokens in one piece; a fused-
# kernel device takes `branch_scores`'s share of its memory instead.
BRANCH_SCORES = 2**25
# The share of a fused-kernel device's memory one chunk's scores may take, in bytes per score: a
# chunk holds ~4 float32 tensors of its scores (scores, masked, probabilities, their concatenation)
# and about as much again while its backward recomputes them, so 1/512 keeps a chunk at ~1/16 of
# the device (2**27 scores on an 80 GB GPU, 2**25's four times).
DEVICE_BYTES_PER_SCORE = 512


def branch_scores(x: torch.Tensor) -> int:
    """Scores a later TTT step's chunk may hold for tensors like `x`: `BRANCH_SCORES`, or on the
    fused-kernel path of a CUDA device the larger `DEVICE_BYTES_PER_SCORE` share of its memory
    (fewer chunks, each recomputed in the backward pass). Reads the device's properties, never
    its tensors: no sync."""
    if not (x.is_cuda and fused_kernels(x)):
        return BRANCH_SCORES
    return max(BRANCH_SCORES, _device_memory(x.device.index or 0) // DEVICE_BYTES_PER_SCORE)


@cache
def _device_memory(index: int) -> int:
    """Total memory of CUDA device `index`, in bytes (asked once)."""
    return torch.cuda.get_device_properties(index).total_memory


def branch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: Branches) -> torch.Tensor:
    """Attention of queries q [B,H,S,D], this step's K/V [B,KV,S,D], over `past`: equal to
    scaled_dot_product_attention over [context | every step's K/V] with the mask
    [past.mask | diagonal per step], at the multiply-adds of the unmasked keys, in chunks of
    query rows where the scores would pass `branch_scores` (each row reads only its own branch,
    so rows split freely)."""
    b, h, s, _ = q.shape
    rows = max(1, branch_scores(q) // (b * h * past.context[0].shape[2]))
    if rows >= s:
        return _branch_rows(q, k, v, past)
    parts = []
    for i in range(0, s, rows):
        part = slice(i, i + rows)
        piece = Branches(past.context, past.mask[:, :, part], tuple((sk[:, :, part], sv[:, :, part])
                                                                    for sk, sv in past.steps))
        args = (q[:, :, part], k[:, :, part], v[:, :, part], piece)
        grad = torch.is_grad_enabled()
        parts.append(checkpoint(_branch_rows, *args, use_reentrant=False) if grad else _branch_rows(*args))
    return torch.cat(parts, dim=2)


def _branch_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: Branches) -> torch.Tensor:
    """`branch_attention` over all of q's rows at once. Computed in float32 (scores of bf16 K/V
    rounded to bf16 would lose what a fused kernel keeps) and returned in q's dtype; query heads
    read their K/V group by a view, never a copy."""
    (ck, cv), groups = past.context, k.shape[1]
    b, h, s, d = q.shape
    own_k = torch.stack([sk for sk, _ in past.steps] + [k], -2).float()  # [B,KV,S,n,D]
    own_v = torch.stack([sv for _, sv in past.steps] + [v], -2).float()
    qg = q.float().view(b, groups, h // groups, s, d) * d**-0.5
    context = (qg.flatten(2, 3) @ ck.float().transpose(-1, -2)).view(b, groups, h // groups, s, -1)
    context = context.masked_fill(~past.mask[:, :, None], float("-inf"))
    own = torch.einsum("bgrsd,bgsnd->bgrsn", qg, own_k)
    probs = torch.cat([context, own], -1).softmax(-1)
    t = ck.shape[2]
    out = (probs[..., :t].flatten(2, 3) @ cv.float()).view(b, groups, h // groups, s, d)
    out = out + torch.einsum("bgrsn,bgsnd->bgrsd", probs[..., t:], own_v)
    return out.view(b, h, s, d).to(q.dtype)


# Earlier positions: K/V the step concatenates its own to, a store it writes them into, or a TTT
# step's context and branches.
Past = KV | KVStore | Branches

def captured_layers(cfg: Eagle3Config, num_hidden_layers: int) -> tuple[tuple[int, ...], int]:
    """(aux layer ids, final layer id) the head trains on: the three fused features, and the final
    hidden state the target's lm_head turns into the teacher's distribution."""
    return tuple(resolve_aux_layer_ids(cfg.aux_layer_ids, num_hidden_layers)), num_hidden_layers


def draft_layer_config(target_config, cfg: Eagle3Config, draft_vocab_size: int) -> LlamaConfig:
    """The draft decoder layer's LlamaConfig, derived from the target's (any family)."""
    t = target_config.get_text_config()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    num_heads = cfg.num_attention_heads or t.num_attention_heads
    aux = resolve_aux_layer_ids(cfg.aux_layer_ids, t.num_hidden_layers)
    return LlamaConfig(
        hidden_size=t.hidden_size,
        intermediate_size=cfg.intermediate_size or t.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.num_key_value_heads
        or getattr(t, "num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings,
        vocab_size=t.vocab_size,
        hidden_act="silu",
        rope_parameters=draft_rope(t),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        draft_vocab_size=min(draft_vocab_size, t.vocab_size),
        target_hidden_size=t.hidden_size,
        aux_layer_ids=aux,
        **{k: getattr(cfg, k) for k in NORM_FLAGS},
        **window_fields(cfg.sliding_window, 1),
    )


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v read the 2H concatenation [norm(embed) | norm(feature)]."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        past: Past | None,
    ) -> tuple[torch.Tensor, KV]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if isinstance(past, Branches):
            out = branch_attention(q, k, v, past)
        elif past is None:
            out = context_attention(q, k, v, mask, fused_kernels(q))
        else:  # decoding: a few queries over a cache, which the kernels below take as they are
            if isinstance(past, tuple):
                keys, values = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            else:
                keys, values = past.update(k, v, 0)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class Eagle3DecoderLayer(nn.Module):
    """The single draft layer ("midlayer" in the engines' checkpoints)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm_before_residual = norm_flags(config)["norm_before_residual"]
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, hidden, cos, sin, mask, past):
        normed = self.hidden_norm(hidden)
        # The engines' default keeps the un-normalised feature as the residual.
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn, kv = self.self_attn(x, cos, sin, mask, past)
        hidden = residual + attn
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, kv


class Eagle3Head(nn.Module):
    """The draft model. `embed_tokens` is the target's, frozen and never saved."""

    kind = "eagle3"

    def __init__(self, config: LlamaConfig, target: TargetSpec):
        super().__init__()
        self.config, self.target = config, target
        h, v, vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.aux_layer_ids: list[int] = list(config.aux_layer_ids)
        flags = norm_flags(config)
        self.norm_output = flags["norm_output"]
        self.embed_tokens = nn.Embedding(v, h).requires_grad_(False)
        fused = len(self.aux_layer_ids) * config.target_hidden_size
        self.input_norm = LlamaRMSNorm(fused, eps=config.rms_norm_eps) if flags["norm_before_fc"] else None
        self.fc_norm = (
            nn.ModuleList(
                LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps)
                for _ in self.aux_layer_ids
            )
            if flags["fc_norm"]
            else None
        )
        self.fc = nn.Linear(fused, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(v, dtype=torch.bool))

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_target(
        cls, target_model, target_name: str, cfg: Eagle3Config, d2t: torch.Tensor, t2d: torch.Tensor
    ) -> Eagle3Head:
        """A fresh head: embeddings copied (frozen), lm_head initialised from the target's rows."""
        config = cls.draft_config(target_model.config, cfg, len(d2t))
        head = cls(config, TargetSpec.from_model(target_model, target_name))
        head.set_vocab(d2t, t2d)
        head.embed_tokens.weight.data.copy_(target_model.get_input_embeddings().weight.float())
        target_lm = target_model.get_output_embeddings().weight.float()
        head.lm_head.weight.data.copy_(target_lm[head.draft_token_ids()])
        return head

    @classmethod
    def draft_config(cls, target_config, cfg: Eagle3Config, draft_vocab_size: int) -> LlamaConfig:
        """The saved LlamaConfig of a fresh head (a kind built on this one adds its keys)."""
        return draft_layer_config(target_config, cfg, draft_vocab_size)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.numel() != self.config.draft_vocab_size or t2d.numel() != self.config.vocab_size:
            raise UserError(
                f"draft vocabulary has {d2t.numel()} ids over {t2d.numel()} target ids; the head "
                f"expects {self.config.draft_vocab_size} over {self.config.vocab_size}"
            )
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def draft_token_ids(self) -> torch.Tensor:
        """Target id of each draft id (ascending): `target = draft + d2t[draft]`."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- compute ------------------------------------------------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[..., 3*Ht] target features (ascending layer ids) -> [..., H] draft feature.

        The one way into the layer (P-EAGLE's mask_hidden too): vLLM's `combine_hidden_states`
        order, input_norm over the whole, then fc_norm per aux layer, then fc."""
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        if self.fc_norm is not None:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def layer(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        past: Past | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """The decoder layer alone: training computes logits only where a loss needs them.

        Returns the hidden state the next draft step reads (normed by the final norm with
        `norm_output`, as vLLM feeds it back) and this call's rotated K/V."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(hidden, position_ids)
        out, kv = self.midlayer(embeds, hidden, cos, sin, mask, past)
        return (self.norm(out) if self.norm_output else out), kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of a hidden state as `layer` returns it (already normed with
        `norm_output`: the engines norm once either way)."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))

    def step(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        past: Past | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, KV]:
        """One draft forward over T new positions.

        hidden [B,T,H]: fused target feature (first step) or the hidden a previous step returned.
        input_ids [B,T]: the token that follows each position. mask: bool [B|1,1,T,P+T] with
        True = may attend (or additive), P the past length (a `KVStore`: all it returns); None
        means plain causal without a past.
        Returns (hidden to feed back: pre-norm, or post-norm with `norm_output`; draft-vocab
        logits; this call's rotated K/V).
        """
        out, kv = self.layer(hidden, input_ids, position_ids, mask, past)
        return out, self.logits(out), kv

    # ---- folder format ------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path, state: dict | None = None) -> Path:
        """`state` replaces the live weights (ZeRO-3 gathers them elsewhere)."""
        skip = ("embed_tokens.", "rotary.")
        tensors = {k: v for k, v in (state or self.state_dict()).items() if not k.startswith(skip)}
        return save_head(out_dir, self.kind, self.config.to_dict(), self.target, tensors)

    @classmethod
    def from_pretrained(cls, path: str | Path, target_model, target_name: str) -> Eagle3Head:
        """Load a saved head against `target_model`; refuse one trained for another target."""
        config_dict, spec, tensors = load_head(path, cls.kind)
        spec.check(TargetSpec.from_model(target_model, target_name), f"head={str(path)!r}")
        head = cls(LlamaConfig(**config_dict), spec)
        missing, unexpected = head.load_state_dict(tensors, strict=False)
        missing = [k for k in missing if not k.startswith(("embed_tokens.", "rotary."))]
        if missing or unexpected:
            raise UserError(f"head={str(path)!r}: missing {missing}, unexpected {unexpected}")
        head.embed_tokens.weight.data.copy_(target_model.get_input_embeddings().weight.float())
        return head


def load_for_decoding(
    path: str | Path, target_model, target_name: str, head_class: type[Eagle3Head] = Eagle3Head
) -> tuple[Eagle3Head, object]:
    """(head, the model that verifies its drafts) for decoding: the head refuses a target other
    than its own, and aux layer ids this target lacks, before anything is decoded. `head_class`:
    a kind built on EAGLE-3 loads its own module the same way."""
    head = head_class.from_pretrained(path, target_model, target_name)
    n_layers = target_model.config.get_text_config().num_hidden_layers
    resolve_aux_layer_ids(head.aux_layer_ids, n_layers, f"the head at {str(path)!r}: aux_layer_ids")
    return head, target_model
