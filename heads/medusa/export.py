"""Medusa heads in vLLM's and TGI's folder layouts.

Keys read off the loaders: vLLM 0.32 `model_executor/models/medusa.py` (`blocks.{h}.layers.{l}`,
`lm_heads.{h}`, bias only with `medusa_fc_bias`; unknown names are dropped without a word) and
`transformers_utils/configs/medusa.py` (any key holding "num"+"heads" becomes num_heads, so only
one such key may exist); TGI `layers/medusa.py` (`{h}.{l}.linear.weight|bias`, the head's
lm_head at `{h}.{num_layers}.weight`, bias always loaded), `layers/speculative.py` (a config with
`architectures` is not taken for Medusa) and `models/__init__.py` (`medusa_num_heads`,
`base_model_name_or_path`, weights in `medusa_lm_head.safetensors`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conf.errors import UserError
from heads.export.card import CardFacts, hub_id
from heads.export.check import KindOps
from heads.export.core import Layout, Tensors, cast_weights, check_layout, read_folder
from heads.folder import TargetSpec
from heads.medusa.model import MedusaHead

VLLM_WEIGHTS = "model.safetensors"
TGI_WEIGHTS = "medusa_lm_head.safetensors"


def check_exportable(cfg: dict) -> None:
    if cfg.get("target_update"):
        raise UserError(
            f"Medusa-2 head (target_update={cfg['target_update']}): its heads only fit the "
            "jointly trained target in <head>/target, which the engines would not load; export "
            "a Medusa-1 head (head.joint=false)"
        )


def expected_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Medusa head in our (= vLLM's) names."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg["num_heads"]):
        for j in range(cfg["num_layers"]):
            shapes[f"blocks.{i}.layers.{j}.weight"] = (h, h)
            if cfg["fc_bias"]:
                shapes[f"blocks.{i}.layers.{j}.bias"] = (h,)
        shapes[f"lm_heads.{i}.weight"] = (v, h)
    return shapes


def check_tensor_names(tensors: Tensors, cfg: dict, where: str) -> None:
    check_layout(tensors, expected_tensor_shapes(cfg), where)


def vllm_config(cfg: dict, dtype: str) -> dict:
    check_exportable(cfg)
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "truncated_vocab_size": cfg["vocab_size"],
        # vLLM overwrites num_heads with num_speculative_tokens: serve with the same number.
        "num_heads": cfg["num_heads"],
        "num_hidden_layers": cfg["num_layers"],
        "medusa_fc_bias": cfg["fc_bias"],
        "torch_dtype": dtype,
    }


def tgi_config(cfg: dict, dtype: str, base_model: str) -> dict:
    check_exportable(cfg)
    return {
        "medusa_num_heads": cfg["num_heads"],
        "medusa_num_layers": cfg["num_layers"],
        "base_model_name_or_path": base_model,
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        # TGI always loads a bias; this records whether ours was trained or is zero padding.
        "medusa_fc_bias": cfg["fc_bias"],
        "torch_dtype": dtype,
    }


def tgi_tensors(tensors: Tensors, cfg: dict, dtype: torch.dtype) -> Tensors:
    """Our names -> TGI's; a head without biases gets zero biases (same function)."""
    t = cast_weights(tensors, dtype)
    h, n = cfg["hidden_size"], cfg["num_layers"]
    out: Tensors = {}
    for i in range(cfg["num_heads"]):
        for j in range(n):
            w = t[f"blocks.{i}.layers.{j}.weight"]
            out[f"{i}.{j}.linear.weight"] = w
            out[f"{i}.{j}.linear.bias"] = t.get(
                f"blocks.{i}.layers.{j}.bias", torch.zeros(h, dtype=w.dtype)
            )
        out[f"{i}.{n}.weight"] = t[f"lm_heads.{i}.weight"]
    return out


def _head_config(top: dict, heads: str, layers: str) -> dict:
    return {
        "num_heads": top[heads],
        "num_layers": top[layers],
        "hidden_size": top["hidden_size"],
        "vocab_size": top["vocab_size"],
        "fc_bias": bool(top.get("medusa_fc_bias", False)),
        "target_update": None,
    }


def read_vllm(folder: Path, loaded: tuple[dict, Tensors] | None = None) -> tuple[dict, Tensors]:
    """Our strict loader for the medusa-vllm layout (`loaded`: the folder's config.json and
    tensors already read and completed, `vllm_as_read`)."""
    top, tensors = loaded or read_folder(folder, VLLM_WEIGHTS)
    where = f"medusa-vllm export {folder}"
    counted = [k for k in top if "num" in k and ("heads" in k or "layers" in k)]
    if sorted(counted) != ["num_heads", "num_hidden_layers"]:
        raise UserError(f"{where}: vLLM renames every num*heads/num*layers key; found {counted}")
    cfg = _head_config(top, "num_heads", "num_hidden_layers")
    check_tensor_names(tensors, cfg, where)
    return cfg, tensors


def read_tgi(folder: Path, loaded: tuple[dict, Tensors] | None = None) -> tuple[dict, Tensors]:
    """Our strict loader for the medusa-tgi layout (back to our names; `loaded`: as `read_vllm`'s,
    `tgi_as_read`)."""
    top, raw = loaded or read_folder(folder, TGI_WEIGHTS)
    where = f"medusa-tgi export {folder}"
    if "architectures" in top:
        raise UserError(f"{where}: TGI takes a config with `architectures` for another speculator")
    cfg = _head_config(top, "medusa_num_heads", "medusa_num_layers")
    n = cfg["num_layers"]
    tensors: Tensors = {}
    for name, value in raw.items():
        parts = name.split(".")
        if len(parts) == 3 and parts[1] == str(n) and parts[2] == "weight":
            tensors[f"lm_heads.{parts[0]}.weight"] = value
        elif len(parts) == 4 and parts[2] == "linear":
            if parts[3] == "bias" and not cfg["fc_bias"]:
                if torch.count_nonzero(value):
                    raise UserError(f"{where}: {name} is not zero but medusa_fc_bias is false")
                continue
            tensors[f"blocks.{parts[0]}.layers.{parts[1]}.{parts[3]}"] = value
        else:
            tensors[name] = value  # reported as unknown below
    check_tensor_names(tensors, cfg, where)
    return cfg, tensors


def _target_sizes(top: dict, target_config) -> dict:
    return {"hidden_size": target_config.hidden_size, "vocab_size": target_config.vocab_size, **top}


def vllm_as_read(top: dict, tensors: Tensors, target_config, where: str) -> tuple[dict, Tensors]:
    """A vLLM Medusa config.json from elsewhere completed as vLLM reads it: the target's hidden
    size and vocabulary where absent (vLLM takes the target's vocabulary)."""
    return _target_sizes(top, target_config), tensors


def tgi_as_read(top: dict, tensors: Tensors, target_config, where: str) -> tuple[dict, Tensors]:
    """A TGI Medusa config.json from elsewhere (FasterDecoding's keeps to the head counts and the
    base model) completed as TGI reads it: the target's sizes, and `medusa_fc_bias` true where
    absent (TGI always loads the biases, so a head trained for it has them)."""
    return {"medusa_fc_bias": True, **_target_sizes(top, target_config)}, tensors


def head_outputs(head, seed: int = 0) -> Tensors:
    """All heads' logits on fixed random final hidden states, for comparing two heads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 6, head.config["hidden_size"], generator=g)
    with torch.no_grad():
        return {"logits": head(x)}


def _build(cfg: dict, spec: TargetSpec, tensors: Tensors, target_model) -> MedusaHead:
    head = MedusaHead(cfg, spec)
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    return head.eval()


def config_fields(cfg: dict) -> dict:
    """The fields an exported config must reproduce for the self-check."""
    return {k: cfg[k] for k in ("num_heads", "num_layers", "hidden_size", "vocab_size", "fc_bias")}


CHECK = KindOps(build=_build, outputs=head_outputs, config_fields=config_fields)


def served_tokens(cfg: dict, asked: int) -> int:
    """Every head drafts one token, and vLLM sets num_heads from num_speculative_tokens: an
    export serves with as many tokens as it has heads, whatever was asked."""
    return cfg["num_heads"]


def serve_lines(f: CardFacts) -> list[str]:
    """The model card's serve command: TGI for its format, vLLM for the other."""
    base = hub_id(f.target_name) or f.target_name
    k, loc = f.num_speculative_tokens, f.location
    if f.fmt == "medusa-tgi":
        return [
            "Text Generation Inference (the config names the base model):",
            "",
            "```bash",
            f"text-generation-launcher --model-id {loc} --speculate {k}",
            "```",
        ]
    spec = json.dumps({"method": "medusa", "model": loc, "num_speculative_tokens": k})
    return [
        "vLLM (num_speculative_tokens must equal the number of heads):",
        "",
        "```bash",
        f"vllm serve {base} --speculative-config '{spec}'",
        "```",
    ]


FORMATS = {
    "medusa-vllm": Layout(
        VLLM_WEIGHTS,
        lambda cfg, ctx: vllm_config(cfg, ctx.dtype),
        read_vllm,
        lambda top: top.get("model_type") == "medusa",
        "vllm",
        defaults=vllm_as_read,
    ),
    "medusa-tgi": Layout(
        TGI_WEIGHTS,
        lambda cfg, ctx: tgi_config(cfg, ctx.dtype, ctx.verifier),
        read_tgi,
        lambda top: "medusa_num_heads" in top,
        "text-generation-inference",
        tgi_tensors,
        tgi_as_read,
    ),
}
