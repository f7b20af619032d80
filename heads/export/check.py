"""Prove an exported folder is the trained head: same tensors, same config, same outputs.

Runs on the folder as written (before it is renamed into place), through the format's own strict
reader, so a dropped, extra or misnamed tensor fails the export instead of an engine silently
serving uninitialised weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LlamaConfig

from conf.errors import UserError
from heads.eagle3 import norm_flags
from heads.export import medusa as export_medusa
from heads.export.core import cast_weights
from heads.export.eagle3 import build_head, head_outputs
from heads.folder import TargetSpec
from heads.medusa import MedusaHead

Tensors = dict[str, torch.Tensor]


def tensor_mismatches(expected: Tensors, actual: Tensors) -> list[str]:
    """Every difference in names, dtypes, shapes or values (exact: export only renames/casts)."""
    problems = [f"missing {k}" for k in sorted(set(expected) - set(actual))]
    problems += [f"unexpected {k}" for k in sorted(set(actual) - set(expected))]
    for k in sorted(set(expected) & set(actual)):
        a, b = expected[k], actual[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{k}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a, b):
            problems.append(f"{k}: values differ")
    return problems


def output_mismatches(expected: Tensors, actual: Tensors) -> list[str]:
    return [
        f"{k}: max |diff| {(expected[k] - actual[k]).abs().max().item():.3g}"
        for k in expected
        if not torch.equal(expected[k], actual[k])
    ]


def max_abs_diff(a: Tensors, b: Tensors) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@dataclass(frozen=True)
class KindOps:
    """What the check needs to know about one head kind."""

    build: Callable[[dict, TargetSpec, Tensors, object], torch.nn.Module]
    outputs: Callable[[torch.nn.Module], Tensors]
    config_fields: Callable[[dict], dict]  # the fields an engine config must reproduce


def _target_embed(cfg: dict, target_model) -> torch.Tensor:
    """The target's input embeddings, or a fixed random stand-in: they are never exported, so
    any shared matrix tests the exported weights equally well."""
    if target_model is not None:
        return target_model.get_input_embeddings().weight.detach().float().cpu()
    g = torch.Generator().manual_seed(0)
    return torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g)


def _eagle3_fields(cfg: dict) -> dict:
    c = LlamaConfig(**cfg)
    keys = (
        "hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim "
        "rms_norm_eps max_position_embeddings vocab_size rope_parameters draft_vocab_size "
        "target_hidden_size"
    ).split()
    return (
        {k: getattr(c, k) for k in keys}
        | {"aux_layer_ids": sorted(cfg["aux_layer_ids"])}
        | norm_flags(cfg)
    )


def _build_medusa(cfg: dict, spec: TargetSpec, tensors: Tensors, target_model) -> MedusaHead:
    head = MedusaHead(cfg, spec)
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    return head.eval()


def _medusa_fields(cfg: dict) -> dict:
    return {k: cfg[k] for k in ("num_heads", "num_layers", "hidden_size", "vocab_size", "fc_bias")}


KINDS: dict[str, KindOps] = {
    "eagle3": KindOps(
        build=lambda cfg, spec, t, target: build_head(cfg, spec, t, _target_embed(cfg, target)),
        outputs=head_outputs,
        config_fields=_eagle3_fields,
    ),
    "medusa": KindOps(
        build=_build_medusa,
        outputs=export_medusa.head_outputs,
        config_fields=_medusa_fields,
    ),
}


def verify_export(
    kind: str,
    src_cfg: dict,
    spec: TargetSpec,
    src_tensors: Tensors,
    read_back: tuple[dict, Tensors],
    dtype: torch.dtype,
    target_model=None,
    where: str = "export",
) -> dict:
    """Raise UserError on any difference; return what was checked and the storage-dtype drift."""
    ops = KINDS[kind]
    cfg, tensors = read_back
    stored = cast_weights(src_tensors, dtype)
    problems = tensor_mismatches(stored, tensors)
    want, got = ops.config_fields(src_cfg), ops.config_fields(cfg)
    problems += [
        f"config {k}: {want[k]!r} != {got.get(k)!r}" for k in want if want[k] != got.get(k)
    ]
    if problems:
        raise UserError(f"{where}: self-check failed: {'; '.join(problems[:8])}")
    exported = ops.outputs(ops.build(cfg, spec, tensors, target_model))
    same_weights = ops.outputs(ops.build(src_cfg, spec, stored, target_model))
    problems = output_mismatches(same_weights, exported)
    if problems:
        raise UserError(f"{where}: self-check outputs differ: {'; '.join(problems)}")
    trained = ops.outputs(ops.build(src_cfg, spec, src_tensors, target_model))
    return {
        "tensors": len(tensors),
        "outputs_identical": True,
        "max_abs_diff_vs_trained_float32": max_abs_diff(trained, exported),
    }
