"""An MTP head's two exports: the target's folder with its MTP layer stitched back (`mtp-stitched`),
and the MTP weights alone in speculators' `mtp` layout (`mtp-speculators`).

`mtp-stitched` is what vLLM serves (`--speculative-config '{"method": "mtp", ...}'` on the
stitched folder itself, as for the shipped checkpoint): a folder beside the target whose files are
links to the target's, except each safetensors shard holding an MTP tensor, rewritten with the
trained tensors in place of the shipped ones (every other tensor of that shard, and the MTP
layer's shared copies `embed_tokens` / `shared_head.head`, as they were). The index, config.json
and tokenizer are the target's own files, linked: a 600 GB target costs the MTP shards' bytes.
The target's README.md is not linked, since the model card is written in its place.

`mtp-speculators` follows speculators' MTP draft model (`models/mtp/`: `mtp_layers.0.*` with
`hidden_layernorm` = hnorm, `token_layernorm` = enorm, `input_proj` = eh_proj over [embedding ;
hidden], `final_layernorm` = shared_head.norm, the decoder layer's own names beside them; no
embedding or lm_head; `speculators_model_type: "mtp"`). speculators' loader lists Qwen3-family
decoder classes only, and vLLM 0.32 registers no speculators "mtp" config: the folder is for
speculators' own tools (`stitch-mtp`), the stitched one for serving.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conf.errors import UserError
from conf.files import read_json
from heads.export.card import CardFacts, hub_id
from heads.export.check import KindOps
from heads.export.core import Layout, Tensors, check_layout, read_folder, write_folder
from heads.folder import TargetSpec
from heads.mtp.model import (
    FAMILIES,
    INDEX,
    MtpHead,
    build,
    from_checkpoint_names,
    read_checkpoint_layer,
    to_checkpoint_names,
    weight_map,
)

STITCHED, SPECULATORS = "mtp-stitched", "mtp-speculators"
SPEC_WEIGHTS = "model.safetensors"
# Our names -> speculators' (`mtp_layers.0.` before each); the block's own names are kept.
SPEC_NAMES = {
    "hnorm.weight": "hidden_layernorm.weight",
    "enorm.weight": "token_layernorm.weight",
    "eh_proj.weight": "input_proj.weight",
    "shared_head.norm.weight": "final_layernorm.weight",
}
SPEC_PREFIX = "mtp_layers.0."
CONFIG_FIELDS = ("family", "layer_index", "recycle_norm")


def _expected(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every trained tensor's name and shape, in our names (a head built on the meta device)."""
    with torch.device("meta"):
        head = MtpHead(cfg, TargetSpec("", 0, 0, 0))
    return {k: tuple(v.shape) for k, v in head.trained_state().items()}


def _head_config(top: dict, num_steps: int) -> dict:
    """A head config from a target's config.json (the stitched folder's own)."""
    family = top.get("model_type")
    if family not in FAMILIES:
        raise UserError(f"{STITCHED} export: model_type {family!r} is none of {', '.join(FAMILIES)}")
    return {
        "family": family,
        "layer_index": top["num_hidden_layers"],
        "recycle_norm": FAMILIES[family].recycle_norm,
        "num_steps": num_steps,
        "target_config": {k: v for k, v in top.items() if k != "architectures"},
    }


# ---- stitched ----------------------------------------------------------------------------


def stitched_config(cfg: dict, ctx) -> dict:
    """What `save_stitched` needs: the target's folder (the verifier, a local path)."""
    folder = Path(ctx.verifier)
    if not (folder / "config.json").exists():
        raise UserError(
            f"format={STITCHED}: the target {ctx.verifier!r} is not a local folder to stitch into"
        )
    return {"target_folder": str(folder), "num_steps": cfg["num_steps"]}


def stitched_tensors(tensors: Tensors, cfg: dict, dtype: torch.dtype) -> Tensors:
    """Our names -> the checkpoint's (`model.layers.{N}.*`, experts one by one), in `dtype`."""
    return {k: v.to(dtype) for k, v in to_checkpoint_names(tensors, cfg["layer_index"]).items()}


def save_stitched(folder: Path, weights_file: str, config: dict, tensors: Tensors) -> None:
    """The target's folder with `tensors` in place of its own: each shard holding one of them
    rewritten, every other entry linked (README.md left for the card)."""
    src = Path(config["target_folder"]).resolve()
    where = weight_map(src)
    missing = sorted(set(tensors) - set(where))
    if missing:
        raise UserError(f"format={STITCHED}: the target {src} holds no {missing[:3]} to replace")
    shards = {where[k] for k in tensors}
    for entry in sorted(src.iterdir()):
        if entry.name == "README.md":
            continue
        if entry.name in shards:
            with safe_open(entry, "pt") as f:
                merged = {k: tensors.get(k, f.get_tensor(k)).contiguous() for k in f.keys()}
                meta = f.metadata() or {"format": "pt"}
            save_file(merged, folder / entry.name, metadata=meta)
        else:
            os.symlink(entry, folder / entry.name)
    (folder / "draftsmith_stitched.json").write_text(json.dumps(config, indent=2) + "\n")


def read_stitched(folder: Path) -> tuple[dict, Tensors]:
    """Our strict reader: the stitched folder's MTP layer back in our names, checked against the
    head its config.json describes."""
    top = read_json(folder / "config.json", "export")
    marker = folder / "draftsmith_stitched.json"
    steps = read_json(marker, "export")["num_steps"] if marker.exists() else 1
    cfg = _head_config(top, steps)
    tensors = from_checkpoint_names(read_checkpoint_layer(folder, cfg["layer_index"]))
    check_layout(tensors, _expected(cfg), f"{STITCHED} export {folder}")
    return cfg, tensors


def stitched_differences(original: Path, stitched: Path) -> dict[str, list[str]]:
    """What differs between a target folder and its stitched copy, tensor by tensor: {"changed":
    tensor names whose values differ, "missing": names the copy lacks, "linked": the entries
    that are links to the original's}. Only the MTP layer's trained tensors may change."""
    a, b = weight_map(original), weight_map(stitched)
    changed = []
    for name, file in a.items():
        if name not in b:
            continue
        with safe_open(original / file, "pt") as f, safe_open(stitched / b[name], "pt") as g:
            x, y = f.get_tensor(name), g.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x, y):
                changed.append(name)
    linked = sorted(p.name for p in stitched.iterdir() if p.is_symlink())
    return {"changed": sorted(changed), "missing": sorted(set(a) - set(b)), "linked": linked}


# ---- speculators ---------------------------------------------------------------------------


def speculators_config(cfg: dict, ctx) -> dict:
    k = cfg["num_steps"]
    return {
        "architectures": ["MTPDraftModel"],
        "speculators_model_type": "mtp",
        "num_speculative_steps": k,
        "transformer_layer_config": cfg["target_config"],
        "speculators_config": {
            "algorithm": "mtp",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": ctx.verifier, "architectures": ctx.verifier_architectures},
        },
        "draftsmith": {k: cfg[k] for k in CONFIG_FIELDS},
        "torch_dtype": ctx.dtype,
    }


def speculators_tensors(tensors: Tensors, cfg: dict, dtype: torch.dtype) -> Tensors:
    return {SPEC_PREFIX + SPEC_NAMES.get(k, k.removeprefix("block.")): v.to(dtype)
            for k, v in tensors.items()}


def read_speculators(folder: Path) -> tuple[dict, Tensors]:
    top, raw = read_folder(folder, SPEC_WEIGHTS)
    back = {v: k for k, v in SPEC_NAMES.items()}
    tensors = {}
    for name, value in raw.items():
        own = name.removeprefix(SPEC_PREFIX)
        tensors[back.get(own, f"block.{own}")] = value
    cfg = {**top["draftsmith"], "num_steps": top["num_speculative_steps"],
           "target_config": top["transformer_layer_config"]}
    check_layout(tensors, _expected(cfg), f"{SPECULATORS} export {folder}")
    return cfg, tensors


# ---- the self-check and the card -------------------------------------------------------------


def head_outputs(head: MtpHead, seed: int = 0) -> Tensors:
    """Two recursive steps' logits on fixed random inputs, for comparing two heads."""
    g = torch.Generator().manual_seed(seed)
    h = head.text_config.hidden_size
    hidden = torch.randn(1, 6, h, generator=g)
    ids = torch.randint(0, head.vocab_size, (1, 6), generator=g)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        feed, first, _ = head.step(hidden, ids, pos)
        _, second, _ = head.step(feed, ids.roll(1, 1), pos + 1)
    return {"step0": first, "step1": second}


def _build(cfg: dict, spec: TargetSpec, tensors: Tensors, target_model) -> MtpHead:
    return build(cfg, spec, tensors, target_model, "export")


def config_fields(cfg: dict) -> dict:
    """The fields an exported config must reproduce for the self-check."""
    return {k: cfg[k] for k in CONFIG_FIELDS}


CHECK = KindOps(build=_build, outputs=head_outputs, config_fields=config_fields)


def served_tokens(cfg: dict, asked: int) -> int:
    """The draft steps the head was trained for (vLLM chains the one MTP layer that many times)."""
    return cfg["num_steps"]


def serve_lines(f: CardFacts) -> list[str]:
    """vLLM serves the stitched folder as the target, its MTP layer as the draft."""
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": f.num_speculative_tokens})
    if f.fmt == SPECULATORS:
        base = hub_id(f.target_name) or f.target_name
        return [
            "speculators (write it back into the target with its `stitch-mtp`, or export "
            f"format={STITCHED}), then vLLM on the stitched target:",
            "",
            "```bash",
            f"vllm serve <{base} with these MTP weights> --speculative-config '{spec}'",
            "```",
        ]
    return ["vLLM (the folder is the target, its MTP layer fine-tuned):", "", "```bash",
            f"vllm serve {f.location} --speculative-config '{spec}'", "```"]


FORMATS = {
    STITCHED: Layout(
        INDEX,
        stitched_config,
        read_stitched,
        lambda top: top.get("model_type") in FAMILIES and bool(top.get("num_nextn_predict_layers")),
        "vllm",
        stitched_tensors,
        save=save_stitched,
    ),
    SPECULATORS: Layout(
        SPEC_WEIGHTS,
        speculators_config,
        read_speculators,
        lambda top: top.get("speculators_model_type") == "mtp",
        "speculators",
        speculators_tensors,
        save=write_folder,
    ),
}
