"""EAGLE-3 heads in the engines' two folder layouts, "native" (yuhuili/SpecForge) and "speculators",
and as llama.cpp's GGUF draft (`gguf`: `heads.eagle3.llama_cpp`, which documents its own keys).

Every key below was read off the loaders (vLLM 0.32 `llama_eagle3.py` and
`transformers_utils/configs/speculators/`, SGLang `llama_eagle3.py` + `model_runner.py`,
TensorRT-LLM `modeling_speculative.py` + `speculative/eagle3.py`, vllm-project/speculators
`models/eagle3/config.py`). The engines disagree on what an aux-layer id means; the project keeps
one convention (HF `hidden_states` index) and translates only here, in `engine_layer_ids`: the
config carries vLLM's ids (the project's own) at the top level and SGLang's (one less) in
`eagle_config`; TensorRT-LLM takes `eagle3_layers_to_capture` (one less) at serve time, which
the model card prints.

Both folder layouts carry the same tensors; only the decoder layer's prefix differs (`midlayer.` vs
`layers.0.`). Reading a folder back is strict: an unknown or missing name is an error, because
engine loaders may drop a misnamed tensor without a word. The layer-variant flags are written
explicitly in every config and read back the same way: an engine fills a missing one with its own
default (vLLM's speculators path: `norm_before_residual` true) and drops `input_norm.weight`
when `norm_before_fc` is off, so a flag that is not written is a head served differently. Both
formats name the per-aux-layer norms (`fc_norm`) `fc_norm.{i}.weight` and write the flag at the
top level, where vLLM (both paths) and TensorRT-LLM read it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig

from conf.errors import UserError
from heads.eagle3 import llama_cpp
from heads.eagle3.model import Eagle3Head
from heads.export.card import CardFacts, hub_id
from heads.export.check import KindOps
from heads.export.core import (
    Layout,
    Tensors,
    as_float32,
    cast_weights,
    check_layout,
    legacy_rope,
    read_folder,
)
from heads.folder import TargetSpec
from heads.parts import NORM_FLAGS, norm_flags
from heads.window import window_fields, window_of

WEIGHTS_FILE = "model.safetensors"

# Names in our head (`Eagle3Head.state_dict()` minus the target-owned embed/rotary).
OUR_LAYER_PREFIX = "midlayer."
SPECULATORS_LAYER_PREFIX = "layers.0."  # vLLM maps both to model.layers.0; TRT-LLM too


def engine_layer_ids(aux_layer_ids: list[int]) -> dict[str, list[int]]:
    """The same three target features, in each engine's own numbering.

    ours / vLLM: k = residual stream after k decoder layers (HF `hidden_states[k]`).
    SGLang: `set_eagle3_layers_to_capture` adds one to every configured id before capturing the
    stream *entering* layer id+1, so it needs k-1. TensorRT-LLM captures the *output* of layer i
    (0-based), which is HF index i+1, so it needs k-1 as well.
    """
    ids = sorted(aux_layer_ids)
    if ids[0] < 1:
        raise UserError(
            f"head aux_layer_ids={ids}: id 0 (the embeddings) cannot be captured by SGLang or "
            "TensorRT-LLM (they count layer outputs); export format=speculators for vLLM instead"
        )
    shifted = [k - 1 for k in ids]
    return {"vllm": ids, "sglang": shifted, "trtllm": shifted}


def layer_fields(cfg: dict) -> dict:
    """The draft decoder layer's LlamaConfig fields, spelled for every engine."""
    theta, scaling = legacy_rope(cfg["rope_parameters"])
    return {
        "model_type": "llama",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": cfg["rms_norm_eps"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": cfg["vocab_size"],
        # SGLang ties lm_head to embed_tokens when this is true; the draft has its own lm_head.
        "tie_word_embeddings": False,
        **window_fields(window_of(cfg), 1),
    }


def read_variant_flags(top: dict, where: str) -> dict[str, bool]:
    """The head's flags from an exported config; refuse one missing or not a bool (an engine would
    apply its own default)."""
    flags = {k: top.get(k) for k in NORM_FLAGS}
    bad = {k: v for k, v in flags.items() if not isinstance(v, bool)}
    if bad:
        raise UserError(f"{where}: layer variant flags {bad} must each be written as true or false")
    return flags


def serving_notes(cfg: dict, fmt: str) -> list[str]:
    """Model-card lines for engines that would serve this head's layer variants wrongly.

    Read off their loaders: SGLang `llama_eagle3.py` reads none of the flags and skips an unknown
    `input_norm.weight`; TensorRT-LLM `modeling_speculative.py` reads `eagle_config.norm_before_fc`,
    `fc_norm` and `norm_output` but not `norm_before_residual`. vLLM reads all four in both
    formats."""
    on = [k for k, v in norm_flags(cfg).items() if v]
    if fmt != "eagle3" or not on:
        return []
    ignored = ["SGLang reads none of these flags"]
    if "norm_before_residual" in on:
        ignored.append("TensorRT-LLM does not read norm_before_residual")
    return [
        f"Trained with the layer variants {', '.join(on)}: serve it with vLLM. "
        f"{'; '.join(ignored)}: it would draft with another layer than the one trained "
        "(lower acceptance, no error)."
    ]


def native_config(cfg: dict, dtype: str) -> dict:
    """config.json of the native layout (vLLM, SGLang and TensorRT-LLM read it)."""
    ids = engine_layer_ids(cfg["aux_layer_ids"])
    flags = norm_flags(cfg)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_fields(cfg),
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        # vLLM reads the top-level list before eagle_config; SGLang reads only eagle_config.
        "eagle_aux_hidden_state_layer_ids": ids["vllm"],
        # vLLM reads norm_before_fc here before the top level; TensorRT-LLM reads it only here.
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ids["sglang"],
            "use_aux_hidden_state": True,
            "norm_before_fc": flags["norm_before_fc"],
        },
        **flags,
        "torch_dtype": dtype,
    }


def speculators_config(
    cfg: dict, dtype: str, num_speculative_tokens: int, verifier: str, verifier_arch: list[str]
) -> dict:
    """config.json of the speculators layout (`vllm serve <dir>` needs nothing else)."""
    if len(cfg["aux_layer_ids"]) != 3:
        raise UserError("format=speculators: vLLM sizes fc for exactly 3 aux layers")
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer_fields(cfg),
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": sorted(cfg["aux_layer_ids"]),
        **norm_flags(cfg),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": num_speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_arch},
        },
        "torch_dtype": dtype,
    }


def rename_layer(tensors: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()}


def has_d2t(cfg: dict) -> bool:
    """Whether the layout holds `d2t`: the engines allocate it only for a draft vocabulary smaller
    than the target's (vLLM 0.32 `llama_eagle3.py`, TensorRT-LLM `modeling_speculative.py`;
    SGLang reads it if present), and vLLM refuses one it did not allocate. A full draft vocabulary
    maps by identity (all offsets zero), so a head on a target of at most `draft_vocab_size` ids
    is written without it."""
    return cfg["draft_vocab_size"] != cfg["vocab_size"]


def expected_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the layout holds, in our names, with the shape the engines allocate."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = (
        cfg["num_attention_heads"] * hd,
        cfg["num_key_value_heads"] * hd,
        cfg["intermediate_size"],
    )
    p = OUR_LAYER_PREFIX
    fused = len(cfg["aux_layer_ids"]) * cfg["target_hidden_size"]
    flags = norm_flags(cfg)
    input_norm = {"input_norm.weight": (fused,)} if flags["norm_before_fc"] else {}
    n_aux, ht = len(cfg["aux_layer_ids"]), cfg["target_hidden_size"]
    fc_norm = {f"fc_norm.{i}.weight": (ht,) for i in range(n_aux)} if flags["fc_norm"] else {}
    return {
        **input_norm,
        **fc_norm,
        "fc.weight": (h, fused),
        f"{p}self_attn.q_proj.weight": (q, 2 * h),
        f"{p}self_attn.k_proj.weight": (kv, 2 * h),
        f"{p}self_attn.v_proj.weight": (kv, 2 * h),
        f"{p}self_attn.o_proj.weight": (h, q),
        f"{p}mlp.gate_proj.weight": (inter, h),
        f"{p}mlp.up_proj.weight": (inter, h),
        f"{p}mlp.down_proj.weight": (h, inter),
        f"{p}input_layernorm.weight": (h,),
        f"{p}hidden_norm.weight": (h,),
        f"{p}post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
        **({"d2t": (cfg["draft_vocab_size"],)} if has_d2t(cfg) else {}),
        "t2d": (cfg["vocab_size"],),
    }


def check_tensor_names(
    tensors: dict[str, torch.Tensor], cfg: dict, where: str, extra: dict[str, tuple[int, ...]] | None = None
) -> None:
    """Refuse a folder whose tensors are not exactly the ones the engines load (`extra`: what a
    kind built on EAGLE-3 adds)."""
    check_layout(tensors, expected_tensor_shapes(cfg) | (extra or {}), where)
    d2t = tensors.get("d2t")
    if (d2t is not None and d2t.dtype != torch.int64) or tensors["t2d"].dtype != torch.bool:
        raise UserError(f"{where}: d2t must be int64 offsets and t2d bool")


def native_tensors(tensors: dict[str, torch.Tensor], cfg: dict, dtype: torch.dtype) -> dict:
    """Our tensors as the native layout stores them: cast, without `d2t` where `has_d2t` says so."""
    out = cast_weights(tensors, dtype)
    return out if has_d2t(cfg) else {k: v for k, v in out.items() if k != "d2t"}


def speculators_tensors(tensors: dict[str, torch.Tensor], cfg: dict, dtype: torch.dtype) -> dict:
    return rename_layer(native_tensors(tensors, cfg, dtype), OUR_LAYER_PREFIX, SPECULATORS_LAYER_PREFIX)


def with_d2t(tensors: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """A read-back layout in our names, which always hold `d2t`: a full draft vocabulary's zero
    offsets where the layout has none (the self-check then refuses a head whose were not zero)."""
    if "d2t" in tensors:
        return tensors
    return {**tensors, "d2t": torch.zeros(cfg["draft_vocab_size"], dtype=torch.long)}


def _head_config(layer: dict, top: dict, aux_layer_ids: list[int], flags: dict[str, bool]) -> dict:
    """Our draft LlamaConfig kwargs rebuilt from an exported config (legacy rope keys included)."""
    keys = (
        "hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim "
        "rms_norm_eps max_position_embeddings vocab_size rope_theta rope_scaling"
    ).split()
    return {
        **{k: layer[k] for k in keys},
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "draft_vocab_size": top["draft_vocab_size"],
        "target_hidden_size": top["target_hidden_size"],
        "aux_layer_ids": aux_layer_ids,
        **flags,
        **window_fields(window_of(layer), 1),
    }


def _no_extra(top: dict, cfg: dict, where: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    return {}, {}


# What a kind built on EAGLE-3 reads beyond it: (config.json, our config kwargs so far, where) ->
# (more config kwargs, more tensor shapes), refusing what is missing or wrong.
Extra = Callable[[dict, dict, str], tuple[dict, dict[str, tuple[int, ...]]]]


def read_native(
    folder: Path, extra: Extra = _no_extra, fmt: str = "eagle3", loaded: tuple[dict, Tensors] | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Our loader for the native layout: (draft config kwargs, tensors in our names). `loaded`:
    the folder's (config.json, tensors) already read and completed (`native_as_vllm_reads`)."""
    top, tensors = loaded or read_folder(folder, WEIGHTS_FILE)
    where = f"{fmt} export {folder}"
    ids = top["eagle_aux_hidden_state_layer_ids"]
    sglang = top.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if sglang != engine_layer_ids(ids)["sglang"]:
        raise UserError(f"{where}: eagle_config ids {sglang} are not the vLLM ids {ids} minus one")
    flags = read_variant_flags(top, where)
    nested = top["eagle_config"].get("norm_before_fc")
    if nested is not flags["norm_before_fc"]:
        raise UserError(
            f"{where}: eagle_config.norm_before_fc={nested} but norm_before_fc="
            f"{flags['norm_before_fc']}; vLLM and TensorRT-LLM read the eagle_config one"
        )
    cfg = _head_config(top, top, ids, flags)
    more, shapes = extra(top, cfg, where)
    cfg |= more
    check_tensor_names(tensors, cfg, where, shapes)
    return cfg, with_d2t(tensors, cfg)


def read_speculators(
    folder: Path,
    extra: Extra = _no_extra,
    model_type: str = "eagle3",
    loaded: tuple[dict, Tensors] | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Our loader for the speculators layout: (draft config kwargs, tensors in our names).
    `loaded`: as `read_native`'s (`speculators_as_vllm_reads`)."""
    top, tensors = loaded or read_folder(folder, WEIGHTS_FILE)
    where = f"speculators export {folder}"
    if top.get("speculators_model_type") != model_type:
        raise UserError(f"{where}: speculators_model_type is not {model_type}")
    flags = read_variant_flags(top, where)
    foreign = [k for k in tensors if k.startswith(OUR_LAYER_PREFIX)]
    if foreign:
        raise UserError(f"{where}: {foreign[0]} uses the native prefix, expected layers.0.")
    tensors = rename_layer(tensors, SPECULATORS_LAYER_PREFIX, OUR_LAYER_PREFIX)
    cfg = _head_config(
        top["transformer_layer_config"], top, top["eagle_aux_hidden_state_layer_ids"], flags
    )
    more, shapes = extra(top, cfg, where)
    cfg |= more
    check_tensor_names(tensors, cfg, where, shapes)
    return cfg, with_d2t(tensors, cfg)


# ---- folders written elsewhere, read as vLLM reads them ----------------------------------------
# Our exports write every key; a folder from speculators, SpecForge or the EAGLE authors may leave
# some out, and vLLM 0.32 fills them in (`llama_eagle3.py`, the model runner's aux-layer lookup,
# `speculators/algos.update_eagle3`). `heads.formats` completes such a config.json with vLLM's
# values before the strict readers above read it, so what is evaluated or trained from is what
# vLLM would serve.
LAYER_INPUT_KEYS = (
    "hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim rms_norm_eps "
    "max_position_embeddings vocab_size rope_theta rope_scaling rope_parameters"
).split()
LAYER_SIZE_KEYS = LAYER_INPUT_KEYS[:8]


def vllm_layer_fields(layer: dict) -> dict:
    """The draft layer's fields as transformers' LlamaConfig (and so vLLM) reads `layer`: its
    defaults where a key is missing (head_dim from the heads), either rope spelling, the rope
    given back as the legacy pair our readers take."""
    c = LlamaConfig(**{k: layer[k] for k in LAYER_INPUT_KEYS if k in layer})
    theta, scaling = legacy_rope(c.rope_parameters)
    return {k: getattr(c, k) for k in LAYER_SIZE_KEYS} | {"rope_theta": theta, "rope_scaling": scaling}


def vllm_aux_layer_ids(ids: list[int] | None, target_layers: int) -> list[int]:
    """The target layers vLLM captures for a config naming `ids`: those, or its Llama default
    (2, N//2, N-3) where the config names none."""
    return sorted(ids) if ids else [2, target_layers // 2, target_layers - 3]


def _one_layer(layer: dict, where: str) -> None:
    n = layer.get("num_hidden_layers", 1)
    if n != 1:
        raise UserError(f"{where}: num_hidden_layers={n}: draftsmith's EAGLE-3 head has one decoder layer")


def vllm_vocab(tensors: Tensors, draft_vocab: int, vocab: int, where: str) -> Tensors:
    """`d2t` and `t2d` as vLLM reads a folder from elsewhere: without `d2t`, zero offsets (its
    parameter's initial value); `t2d`, which vLLM skips, rebuilt from `d2t` where it is absent."""
    out = dict(tensors)
    if "d2t" not in out and draft_vocab != vocab:
        out["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    if "t2d" not in out:
        d2t = out.get("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        ids = torch.arange(draft_vocab) + d2t.long() if tuple(d2t.shape) == (draft_vocab,) else None
        if ids is None or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise UserError(f"{where}: d2t must map each of the {draft_vocab} draft ids to one of {vocab}")
        out["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    return out


def native_as_vllm_reads(top: dict, tensors: Tensors, target_config, where: str) -> tuple[dict, Tensors]:
    """A native config.json from elsewhere completed as vLLM reads it: the aux-layer ids from the
    top level, else `eagle_config`, else vLLM's default for the target; `norm_before_fc` from
    `eagle_config` first; any other flag false where absent; `target_hidden_size` the draft's
    width where absent."""
    eagle = dict(top.get("eagle_config") or {})
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise UserError(f"{where}: eagle_config.use_aux_hidden_state is not true: an EAGLE-1/2 head")
    _one_layer(top, where)
    layer = vllm_layer_fields(top)
    named = top.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = vllm_aux_layer_ids(named, target_config.num_hidden_layers)
    flags = {k: top.get(k, False) for k in NORM_FLAGS}
    flags["norm_before_fc"] = eagle.get("norm_before_fc", flags["norm_before_fc"])
    sglang = engine_layer_ids(ids)["sglang"]
    nested = {"eagle_aux_hidden_state_layer_ids": sglang, "use_aux_hidden_state": True}
    filled = {
        **top,
        **layer,
        **flags,
        "target_hidden_size": top.get("target_hidden_size") or layer["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {**eagle, **nested, "norm_before_fc": flags["norm_before_fc"]},
    }
    return filled, vllm_vocab(tensors, filled["draft_vocab_size"], layer["vocab_size"], where)


def speculators_as_vllm_reads(
    top: dict, tensors: Tensors, target_config, where: str
) -> tuple[dict, Tensors]:
    """A speculators config.json from elsewhere completed as vLLM reads it (`update_eagle3`): the
    layer's LlamaConfig defaults; `norm_before_residual` true where absent (vLLM's default, not
    speculators' own), the other flags false; `target_hidden_size` the draft's width where null;
    `draft_vocab_size` the target's vocabulary and the aux-layer ids vLLM's default where absent."""
    layer = top.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UserError(f"{where}: config.json has no transformer_layer_config object (vLLM needs it)")
    _one_layer(layer, where)
    layer = {**layer, **vllm_layer_fields(layer)}
    flags = {k: top.get(k, False) for k in NORM_FLAGS}
    flags["norm_before_residual"] = top.get("norm_before_residual", True)
    named = top.get("eagle_aux_hidden_state_layer_ids")
    filled = {
        **top,
        **flags,
        "transformer_layer_config": layer,
        "draft_vocab_size": top.get("draft_vocab_size") or layer["vocab_size"],
        "target_hidden_size": top.get("target_hidden_size") or layer["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(named, target_config.num_hidden_layers),
    }
    return filled, vllm_vocab(tensors, filled["draft_vocab_size"], layer["vocab_size"], where)


def build_head(
    cfg: dict,
    spec: TargetSpec,
    tensors: dict[str, torch.Tensor],
    embed: torch.Tensor,
    head_class: type[Eagle3Head] = Eagle3Head,
) -> Eagle3Head:
    """An `Eagle3Head` (or `head_class`) from config kwargs and tensors; `embed` is the target's
    (never exported)."""
    head = head_class(LlamaConfig(**cfg), spec)
    missing, unexpected = head.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "rotary."))]
    if missing or unexpected:
        raise UserError(f"{head.kind} head: missing {missing}, unexpected {unexpected}")
    head.embed_tokens.weight.data.copy_(embed.float())
    return head.eval()


def head_outputs(head: Eagle3Head, seed: int = 0) -> dict[str, torch.Tensor]:
    """The head's fc and one draft step on fixed random inputs, for comparing two heads."""
    g = torch.Generator().manual_seed(seed)
    cfg = head.config
    t = 6
    aux = torch.randn(1, t, len(head.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, t), generator=g)
    with torch.no_grad():
        fused = head.fuse(aux)
        hidden, logits, _ = head.step(fused, ids, torch.arange(t).unsqueeze(0))
    return {"fused": fused, "fed_back_hidden": hidden, "draft_logits": logits}


def target_embed(cfg: dict, target_model) -> torch.Tensor:
    """The target's input embeddings, or a fixed random stand-in: they are never exported, so
    any shared matrix tests the exported weights equally well."""
    if target_model is not None:
        return target_model.get_input_embeddings().weight.detach().float().cpu()
    g = torch.Generator().manual_seed(0)
    return torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g)


def config_fields(cfg: dict) -> dict:
    """The fields an exported config must reproduce for the self-check. `rms_norm_eps` as the
    float32 the norms add it in: a GGUF stores only that (and a target converted from a GGUF
    holds it as its config's value), finer digits change no output."""
    c = LlamaConfig(**cfg)
    keys = (
        "hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim "
        "max_position_embeddings vocab_size rope_parameters draft_vocab_size target_hidden_size"
    ).split()
    return (
        {k: getattr(c, k) for k in keys}
        | {"rms_norm_eps": as_float32(c.rms_norm_eps)}
        | {"aux_layer_ids": sorted(cfg["aux_layer_ids"]), "sliding_window": window_of(cfg)}
        | norm_flags(cfg)
    )


CHECK = KindOps(
    build=lambda cfg, spec, t, target: build_head(cfg, spec, t, target_embed(cfg, target)),
    outputs=head_outputs,
    config_fields=config_fields,
)


def card_facts(cfg: dict, fmt: str) -> dict:
    """The model card's EAGLE-3 facts: each engine's aux-layer ids (the native format is the one
    SGLang and TensorRT-LLM read; llama.cpp's GGUF numbers them as we do) and the notes on engines
    that would serve the head wrongly."""
    ids = {}
    if fmt == "eagle3":
        ids = engine_layer_ids(cfg["aux_layer_ids"])
    elif fmt == "gguf":
        ids = {"llama.cpp": sorted(cfg["aux_layer_ids"])}
    return {"layer_ids": ids, "notes": serving_notes(cfg, fmt)}


def serve_lines(f: CardFacts) -> list[str]:
    """The model card's serve commands: vLLM for the two folder formats, SGLang and TensorRT-LLM
    for the native one, llama.cpp for the GGUF."""
    if f.fmt == "gguf":
        return llama_cpp.serve_lines(f)
    base = hub_id(f.target_name) or f.target_name
    k, loc = f.num_speculative_tokens, f.location
    spec = json.dumps({"method": "eagle3", "model": loc, "num_speculative_tokens": k} | f.speculative_keys)
    lines = []
    if f.fmt == "speculators":
        lines += [
            "vLLM (the config names the target, so one argument is enough):",
            "",
            "```bash",
            f"vllm serve {loc}",
            "```",
            "",
            "or explicitly:",
            "",
        ]
    else:
        lines += ["vLLM:", ""]
    lines += ["```bash", f"vllm serve {base} --speculative-config '{spec}'", "```", ""]
    if f.fmt == "eagle3":
        ids = f.layer_ids["trtllm"]
        lines += [
            "SGLang:",
            "",
            "```bash",
            f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {loc} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
            "```",
            "",
            "TensorRT-LLM (PyTorch backend; it takes the layer ids at serve time, in its own "
            "numbering):",
            "",
            "```yaml",
            "speculative_config:",
            "  decoding_type: Eagle3",
            f"  max_draft_len: {k}",
            f"  speculative_model: {loc}",
            f"  eagle3_layers_to_capture: {ids}",
            "```",
        ]
    return lines


# The mask-token keys of a parallel-drafting head (vLLM 0.32 `_init_parallel_drafting_params`):
# a native config with one is not an EAGLE-3 head's.
PARALLEL_DRAFTING_KEYS = {"mask_token_id", "pard_token", "ptd_token_id", "dspark_noise_token_id"}

FORMATS = {
    "eagle3": Layout(
        WEIGHTS_FILE,
        lambda cfg, ctx: native_config(cfg, ctx.dtype),
        read_native,
        lambda top: "draft_vocab_size" in top
        and "speculators_model_type" not in top
        and not PARALLEL_DRAFTING_KEYS & set(top),
        "vllm",
        native_tensors,
        native_as_vllm_reads,
    ),
    "speculators": Layout(
        WEIGHTS_FILE,
        lambda cfg, ctx: speculators_config(
            cfg, ctx.dtype, ctx.num_speculative_tokens, ctx.verifier, ctx.verifier_architectures
        ),
        read_speculators,
        lambda top: top.get("speculators_model_type") == "eagle3",
        "vllm",
        speculators_tensors,
        speculators_as_vllm_reads,
    ),
    "gguf": llama_cpp.LAYOUT,
}
