"""Prove an exported folder is the trained head: same tensors, same config, same outputs.

Runs on the folder as written (before it is renamed into place), through the format's own strict
reader, so a dropped, extra or misnamed tensor fails the export instead of an engine silently
serving uninitialised weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conf.errors import UserError
from heads.export.core import cast_weights
from heads.export.gguf_file import q8_0_blocks, q8_0_round_trip, within_q8_0_steps
from heads.folder import TargetSpec

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
    """What the check needs to know about one head kind (its export module defines it)."""

    build: Callable[[dict, TargetSpec, Tensors, object], torch.nn.Module]
    outputs: Callable[[torch.nn.Module], Tensors]
    config_fields: Callable[[dict], dict]  # the fields an engine config must reproduce


def verify_export(
    ops: KindOps,
    src_cfg: dict,
    spec: TargetSpec,
    src_tensors: Tensors,
    read_back: tuple[dict, Tensors],
    dtype: torch.dtype,
    target_model=None,
    where: str = "export",
    q8_0: bool = False,
) -> dict:
    """Raise UserError on any difference; return what was checked and the storage-dtype drift.
    `q8_0`: a GGUF whose matrices are Q8_0 blocks (`gguf_file`): each must read back exactly as our
    quantization of the trained weights gives it, and so within one quantization step of them
    (`within_q8_0_steps`), checked here as the stated tolerance."""
    cfg, tensors = read_back
    stored = cast_weights(src_tensors, dtype)
    steps = 0.0
    if q8_0:
        quantized = [k for k, v in stored.items() if q8_0_blocks(v)]
        stored |= {k: q8_0_round_trip(stored[k]) for k in quantized}
        steps = max((within_q8_0_steps(src_tensors[k], tensors[k]) for k in quantized if k in tensors),
                    default=0.0)
        if steps > 1.0:
            raise UserError(f"{where}: self-check failed: a Q8_0 weight is {steps:.3g} quantization "
                            "steps from the trained one (at most 1)")
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
        **({"q8_0_max_error_in_steps": round(steps, 4)} if q8_0 else {}),
    }
