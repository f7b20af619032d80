"""What every export layout shares: its description (`Layout`), the storage cast, writing and reading
a folder, the strict name check."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from conf.errors import UserError
from conf.files import read_json
from heads.export.gguf_file import read_gguf
from heads.folder import TargetSpec, read_weights

Tensors = dict[str, torch.Tensor]


def cast_weights(tensors: Tensors, dtype: torch.dtype) -> Tensors:
    """Float weights to the storage dtype; integer and bool tensors (d2t, t2d) stay as they are."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def _cast(tensors: Tensors, cfg: dict, dtype: torch.dtype) -> Tensors:
    return cast_weights(tensors, dtype)


@dataclass(frozen=True)
class ExportContext:
    """Facts a format's config needs beyond the head itself."""

    dtype: str
    num_speculative_tokens: int
    verifier: str  # the target as the engine should load it: a Hub id or a path
    verifier_architectures: list[str]
    target: TargetSpec  # the head's target (llama.cpp captures no layer past its last)
    # A GGUF's storage (`export.gguf_type`, or export.dtype's own: `gguf_file.GGUF_TYPES`)
    gguf_type: str = "bf16"


def write_folder(folder: Path, weights_file: str, config: dict, tensors: Tensors) -> None:
    """An engine folder as most formats are: `config` as config.json, `tensors` as safetensors."""
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, folder / weights_file, metadata={"format": "pt"})


@dataclass(frozen=True)
class Layout:
    """How one export format writes and reads a head (each kind's export module defines its own,
    and `heads.kinds` lists them under the kind)."""

    weights_file: str
    config: Callable[[dict, ExportContext], dict]
    read: Callable[..., tuple[dict, Tensors]]  # our strict loader for the format: (folder) -> ...
    matches: Callable[[dict], bool]  # whether a config.json is this format's (`detect_format`)
    library: str  # the engine library the model card names (Hub `library_name`)
    tensors: Callable[[Tensors, dict, torch.dtype], Tensors] = _cast  # our names -> the format's
    # A folder written elsewhere, completed as the engine reads it where its config.json leaves a
    # key out (`heads.formats`): (config.json, tensors, the target's text config, where) -> both,
    # then read by `read(folder, loaded=...)`. None: such folders are read as our exports are.
    defaults: Callable[[dict, Tensors, Any, str], tuple[dict, Tensors]] | None = None
    # Writes the folder: (folder, weights_file, what `config` returned, what `tensors` returned).
    # A GGUF layout's config is the file's metadata, and its folder one file beside a marker.
    save: Callable[[Path, str, Any, Tensors], None] = write_folder
    # Why a head of these settings cannot be written in this format (None: it can): (a saved
    # head's config or a command's `head.*` settings, the target's layer count or None) -> reason.
    # `export.formats=null` writes every format of the kind that does not refuse the head; one
    # asked for that refuses it is refused when the command starts.
    refuses: Callable[[dict, int | None], str | None] | None = None


def read_folder(folder: Path, weights: str) -> tuple[dict, Tensors]:
    """An export folder's config.json and weights file (safetensors, or a .gguf's tensors in the
    file's names), or one line naming the one that is missing, cut off or not UTF-8 (engine checks
    and evaluations read folders copied around)."""
    path = folder / weights
    tensors = read_gguf(path, "export")[1] if weights.endswith(".gguf") else read_weights(path, "export")
    return read_json(folder / "config.json", "export"), tensors


def check_layout(tensors: Tensors, expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse tensors that are not exactly `expected` (names and shapes): engine loaders may
    drop an unknown name or leave a missing one at its random initialisation without a word."""
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    wrong = sorted(
        f"{k} {tuple(tensors[k].shape)} != {shape}"
        for k, shape in expected.items()
        if k in tensors and tuple(tensors[k].shape) != shape
    )
    if unknown or missing or wrong:
        raise UserError(f"{where}: unknown tensors {unknown}, missing {missing}, shapes {wrong}")


def as_float32(value: float) -> float:
    """A float config value at the float32 precision a GGUF key (and every norm's eps added to a
    float32 tensor) holds it: the digits past it change no output."""
    return float(torch.tensor(value, dtype=torch.float32))


def legacy_rope(rope_parameters: dict) -> tuple[float, dict | None]:
    """transformers-5 `rope_parameters` -> (`rope_theta`, `rope_scaling`).

    The legacy pair is what SGLang and TensorRT-LLM read, and transformers 5 (vLLM) converts it
    back, so one spelling serves every engine.
    """
    params = dict(rope_parameters)
    theta = float(params.pop("rope_theta"))
    if params.get("rope_type", "default") == "default" and set(params) <= {"rope_type"}:
        return theta, None
    return theta, params
