"""GGUF files, the one-file format llama.cpp loads: typed key/values, then tensors.

Written and read with the `gguf` package (llama.cpp's own gguf-py, a project dependency), whose
writer and reader take any architecture name and key, so an architecture its constants do not list
is written the same way. A kind's llama.cpp layout (`heads/<kind>/llama_cpp.py`) says which keys
and tensors; this module only stores them faithfully and reads them back, each tensor in the dtype
it was stored in (BF16, which numpy lacks, as its raw 16-bit words). Storage follows llama.cpp's
converter (`conversion/base.py` `prepare_tensors`): 1-D tensors (norms) in F32, since "most of the
codebase that takes in 1D tensors or norms only handles F32"; matrices in the export dtype, or, in a
file whose `general.file_type` is MOSTLY_Q8_0 (`export.gguf_type=q8_0`), as Q8_0 blocks.

Q8_0 (ggml's `block_q8_0`, written and read by gguf-py's own `gguf.quants`): each run of 32
values along a row is one f16 scale d = max|w| / 127 and 32 int8 q = round(w / d), 34 bytes, read
back as q * d. Every weight is then within one step d of its block's own (half a step from the
rounding, up to 127 x the f16 rounding of d: `within_q8_0_steps`). A matrix whose rows are not
whole blocks stays F32 (the converter falls back to another type for those as well), and is read
back as the float32 the dequantized ones are, so a reader sees one matrix dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

from conf.errors import UserError, first_line

ARCH_KEY = "general.architecture"

# Storage dtype -> (GGML tensor type, numpy view the writer takes, `general.file_type`).
_TYPES = {
    torch.float32: (GGMLQuantizationType.F32, np.float32, LlamaFileType.ALL_F32),
    torch.float16: (GGMLQuantizationType.F16, np.float16, LlamaFileType.MOSTLY_F16),
    torch.bfloat16: (GGMLQuantizationType.BF16, np.uint16, LlamaFileType.MOSTLY_BF16),
    torch.int64: (GGMLQuantizationType.I64, np.int64, None),
}
_TORCH = {ggml: dtype for dtype, (ggml, _, _) in _TYPES.items()}
Q8_0, Q8_0_BLOCK = GGMLQuantizationType.Q8_0, 32
# `export.gguf_type` -> (the dtype the matrices are handed to the writer in, `general.file_type`).
GGUF_TYPES = {
    "f32": (torch.float32, LlamaFileType.ALL_F32),
    "f16": (torch.float16, LlamaFileType.MOSTLY_F16),
    "bf16": (torch.bfloat16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (torch.float32, LlamaFileType.MOSTLY_Q8_0),  # quantized by the writer
}
# `export.dtype` -> its GGUF type: the GGUF's storage where `export.gguf_type` is null.
OF_DTYPE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


class Value(NamedTuple):
    """One metadata entry as GGUF types it (`sub_type`: an ARRAY's element type)."""

    type: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None


def file_type(gguf_type: str) -> int:
    """`general.file_type` of matrices stored as `gguf_type` (llama.cpp prints it; norms stay F32)."""
    return int(GGUF_TYPES[gguf_type][1])


def storage_dtype(gguf_type: str) -> torch.dtype:
    """The dtype a layout casts matrices to for `gguf_type` (float32 for Q8_0: the writer quantizes)."""
    return GGUF_TYPES[gguf_type][0]


def q8_0_blocks(t: torch.Tensor) -> bool:
    """Whether the Q8_0 writer quantizes `t`: a float matrix of whole 32-value blocks per row."""
    return t.dim() == 2 and t.is_floating_point() and t.shape[-1] % Q8_0_BLOCK == 0


def q8_0_round_trip(t: torch.Tensor) -> torch.Tensor:
    """`t` as a Q8_0 file gives it back (float32): what the self-check expects to read."""
    array = t.detach().float().cpu().numpy()
    return torch.from_numpy(dequantize(quantize(array, Q8_0), Q8_0).reshape(array.shape).copy())


def within_q8_0_steps(trained: torch.Tensor, stored: torch.Tensor) -> float:
    """The largest |stored - trained| of a Q8_0 matrix in units of its block's step max|w| / 127:
    at most 1 by construction (module docstring), so a larger value is a broken file."""
    w = trained.detach().float().reshape(-1, Q8_0_BLOCK)
    step = (w.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return float(((stored.float().reshape(-1, Q8_0_BLOCK) - w).abs() / step).max())


def write_gguf(path: Path, arch: str, metadata: dict[str, Value], tensors: dict[str, torch.Tensor]) -> None:
    """One GGUF file: `general.architecture` = `arch`, `metadata`, then `tensors` in their own
    dtypes (float32, float16, bfloat16 or int64), in the order given; with `general.file_type`
    MOSTLY_Q8_0, the float32 matrices of whole blocks (`q8_0_blocks`) as Q8_0."""
    kind = metadata.get("general.file_type")
    q8_0 = kind is not None and kind.value == LlamaFileType.MOSTLY_Q8_0
    writer = GGUFWriter(path, arch)
    for key, (vtype, value, sub_type) in metadata.items():
        writer.add_key_value(key, value, vtype, sub_type)
    for name, t in tensors.items():
        ggml, view, _ = _TYPES[t.dtype]
        data = t.detach().contiguous().cpu()
        array = data.view(torch.int16).numpy().view(view) if t.dtype == torch.bfloat16 else data.numpy()
        if q8_0 and q8_0_blocks(t):
            array, ggml = quantize(array.astype(np.float32), Q8_0), Q8_0
        writer.add_tensor(name, array, raw_dtype=ggml)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensor(t, where: str) -> torch.Tensor:
    """A reader tensor as torch, in its stored dtype (Q8_0: dequantized to float32), copied out of
    the memory map."""
    if t.tensor_type == Q8_0:
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml's ne is torch's shape reversed
        return torch.from_numpy(dequantize(np.array(t.data), Q8_0).reshape(shape).copy())
    if t.tensor_type not in _TORCH:
        raise UserError(f"{where}: tensor {t.name} is {t.tensor_type.name}; expected F32, F16, BF16, "
                        "Q8_0 or I64")
    data = np.array(t.data)
    if t.tensor_type == GGMLQuantizationType.BF16:  # the reader gives BF16 as bytes
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(data)


def read_gguf(path: Path, where: str) -> tuple[dict[str, Value], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a GGUF file, or one line naming it when it is missing, cut off or not
    a GGUF file. The reader's own `GGUF.*` header fields are left out of the metadata."""
    try:
        reader = GGUFReader(path)
    except FileNotFoundError:
        raise UserError(f"{where}: {path} does not exist") from None
    except (ValueError, OSError) as err:  # a bad magic, a cut-off header or tensor data
        raise UserError(f"{where}: {path} is not a readable GGUF file ({first_line(err)})") from None
    metadata = {
        key: Value(field.types[0], field.contents(), field.types[-1] if len(field.types) > 1 else None)
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
    }
    return metadata, {t.name: _tensor(t, where) for t in reader.tensors}
