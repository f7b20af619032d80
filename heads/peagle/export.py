"""P-EAGLE heads in vLLM's two folder layouts: "peagle" (native) and "peagle-speculators".

Both are the EAGLE-3 layouts (`heads/eagle3/export.py`) plus what parallel drafting reads (vLLM
0.32 `llama_eagle3.py`, `v1/spec_decode/llm_base_proposer.py`,
`transformers_utils/configs/speculators/algos.py`): the tensor `mask_hidden` [1, n_aux * Ht] and
the mask token id, `pard_token` in the native config (what vLLM's own speculators conversion
writes) and `mask_token_id` in the speculators one. The native config also records K
(`parallel_tokens`), which vLLM does not read: the serve command passes it.

vLLM drafts a P-EAGLE folder in parallel only when told: the native folder needs
`"parallel_drafting": true` in `speculative_config` (without it vLLM drafts it as sequential
EAGLE-3, skipping `mask_hidden` with a warning); a speculators folder served as `vllm serve <dir>`
turns it on itself, but given as `speculative_config` it needs the key too. The method is
"eagle3" either way (`speculative_keys`, which the model card and scripts/check_vllm.py use).
"""

from __future__ import annotations

import json

from transformers import LlamaConfig

from conf.errors import UserError
from heads.eagle3 import export as eagle3
from heads.export.card import CardFacts, hub_id
from heads.export.check import KindOps
from heads.export.core import Layout
from heads.parts import norm_flags
from heads.peagle.model import PEagleHead

PARALLEL = ("mask_token_id", "parallel_tokens")  # our config keys beyond EAGLE-3's


def speculative_keys(fmt: str) -> dict:
    """vLLM's speculative_config keys for either format, besides model and num_speculative_tokens."""
    return {"method": "eagle3", "parallel_drafting": True}


def served_tokens(cfg: dict | LlamaConfig, asked: int) -> int:
    """The K the head was trained for: exports serve it whatever the evaluator drafted (`cfg`: a
    saved head's config, or a loaded head's, as scripts/check_vllm.py passes it)."""
    return (cfg if isinstance(cfg, dict) else vars(cfg))["parallel_tokens"]


def mask_shape(cfg: dict) -> dict[str, tuple[int, ...]]:
    return {"mask_hidden": (1, len(cfg["aux_layer_ids"]) * cfg["target_hidden_size"])}


def _token(top: dict, key: str, where: str) -> int:
    value = top.get(key)
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or not 0 <= value < top["vocab_size"]:
        raise UserError(f"{where}: {key}={value!r}: expected the mask token id, an int below vocab_size")
    return value


def _read_native_extra(top: dict, cfg: dict, where: str) -> tuple[dict, dict]:
    k = top.get("parallel_tokens")
    if not isinstance(k, int) or k < 2:
        raise UserError(f"{where}: parallel_tokens={k!r}: expected the K it drafts, an int >= 2")
    return {"mask_token_id": _token(top, "pard_token", where), "parallel_tokens": k}, mask_shape(cfg)


def _read_speculators_extra(top: dict, cfg: dict, where: str) -> tuple[dict, dict]:
    layer = top["transformer_layer_config"]
    methods = top.get("speculators_config", {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens")
    if not isinstance(k, int) or k < 2:
        raise UserError(f"{where}: speculative_tokens={k!r}: expected the K it drafts, an int >= 2")
    token = _token({**top, "vocab_size": layer["vocab_size"]}, "mask_token_id", where)
    return {"mask_token_id": token, "parallel_tokens": k}, mask_shape(cfg)


def native_config(cfg: dict, dtype: str) -> dict:
    """EAGLE-3's native config.json plus the mask token and K."""
    parallel = {"pard_token": cfg["mask_token_id"], "parallel_tokens": cfg["parallel_tokens"]}
    return {**eagle3.native_config(cfg, dtype), **parallel}


def speculators_config(cfg: dict, dtype: str, verifier: str, verifier_arch: list[str]) -> dict:
    """EAGLE-3's speculators config.json as speculators writes a P-EAGLE one. vLLM's "peagle"
    reader (`update_peagle`) copies neither `fc_norm` nor `norm_output`: the latter only shapes the
    hidden fed back between sequential steps, which one forward has none of; the former would be
    dropped, so a head with it is refused here."""
    if cfg.get("fc_norm"):
        raise UserError("format=peagle-speculators: vLLM 0.32 reads no fc_norm for it; export format=peagle")
    top = eagle3.speculators_config(cfg, dtype, cfg["parallel_tokens"], verifier, verifier_arch)
    top["speculators_config"]["algorithm"] = "peagle"
    return {
        **top,
        "speculators_model_type": "peagle",
        # speculators' own name for the class (vLLM replaces it by PeagleLlamaForCausalLM).
        "architectures": ["PEagleSpeculator"],
        "mask_token_id": cfg["mask_token_id"],
    }


def head_outputs(head: PEagleHead, seed: int = 0) -> dict:
    """EAGLE-3's outputs on fixed inputs plus the state every mask slot reads."""
    import torch

    out = eagle3.head_outputs(head, seed)
    with torch.no_grad():
        out["mask_state"] = head.mask_state()
    return out


def config_fields(cfg: dict) -> dict:
    return eagle3.config_fields(cfg) | {k: cfg[k] for k in PARALLEL}


CHECK = KindOps(
    build=lambda cfg, spec, t, target: eagle3.build_head(
        cfg, spec, t, eagle3.target_embed(cfg, target), PEagleHead
    ),
    outputs=head_outputs,
    config_fields=config_fields,
)


def card_facts(cfg: dict, fmt: str) -> dict:
    """vLLM's aux-layer ids (the only engine the card names) and how it must be served."""
    on = [k for k, v in norm_flags(cfg).items() if v]
    notes = [
        f"A P-EAGLE head: it drafts {cfg['parallel_tokens']} tokens in one forward (mask token id "
        f"{cfg['mask_token_id']}). vLLM runs it in parallel only with `\"parallel_drafting\": "
        "true`; without it vLLM drafts it as sequential EAGLE-3 (skipping `mask_hidden`, with a "
        "warning), which it was not trained for."
    ]
    if on:
        notes.append(f"Trained with the layer variants {', '.join(on)}, which vLLM reads from this config.")
    return {"layer_ids": {"vllm": sorted(cfg["aux_layer_ids"])}, "notes": notes}


def serve_lines(f: CardFacts) -> list[str]:
    """vLLM's commands: the speculators folder alone, or either folder as speculative_config."""
    base = hub_id(f.target_name) or f.target_name
    loc = f.location
    spec = {"method": "eagle3", "model": loc, "num_speculative_tokens": f.num_speculative_tokens}
    lines = []
    if f.fmt == "peagle-speculators":
        lines += [
            "vLLM (the config names the target and turns parallel drafting on):",
            "",
            "```bash",
            f"vllm serve {loc}",
            "```",
            "",
            "or explicitly:",
            "",
        ]
    else:
        lines += ["vLLM (`parallel_drafting` is required):", ""]
    keys = json.dumps(spec | f.speculative_keys)
    return lines + ["```bash", f"vllm serve {base} --speculative-config '{keys}'", "```", ""]


FORMATS = {
    "peagle": Layout(
        eagle3.WEIGHTS_FILE,
        lambda cfg, ctx: native_config(cfg, ctx.dtype),
        lambda folder: eagle3.read_native(folder, _read_native_extra, "peagle"),
        lambda top: "draft_vocab_size" in top and "speculators_model_type" not in top and "pard_token" in top,
        "vllm",
        eagle3.native_tensors,
    ),
    "peagle-speculators": Layout(
        eagle3.WEIGHTS_FILE,
        lambda cfg, ctx: speculators_config(cfg, ctx.dtype, ctx.verifier, ctx.verifier_architectures),
        lambda folder: eagle3.read_speculators(folder, _read_speculators_extra, "peagle"),
        lambda top: top.get("speculators_model_type") == "peagle",
        "vllm",
        eagle3.speculators_tensors,
    ),
}
