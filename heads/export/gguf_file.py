"""GGUF files, the one-file format llama.cpp loads: typed key/values, then tensors.

Written and read with the `gguf` package (llama.cpp's own gguf-py, a project dependency), whose
writer and reader take any architecture name and key, so an architecture its constants do not list
is written the same way. A kind's llama.cpp layout (`heads/<kind>/llama_cpp.py`) says which keys
and tensors; this module only stores them faithfully and reads them back, each tensor in the dtype
it was stored in (BF16, which numpy lacks, as its raw 16-bit words). Storage follows llama.cpp's
converter (`conversion/base.py` `prepare_tensors`): 1-D tensors (norms) in F32, since "most of the
codebase that takes in 1D tensors or norms only handles F32"; matrices in the export dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

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


class Value(NamedTuple):
    """One metadata entry as GGUF types it (`sub_type`: an ARRAY's element type)."""

    type: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None


def file_type(dtype: torch.dtype) -> int:
    """`general.file_type` of matrices stored in `dtype` (llama.cpp prints it; norms stay F32)."""
    return int(_TYPES[dtype][2])


def write_gguf(path: Path, arch: str, metadata: dict[str, Value], tensors: dict[str, torch.Tensor]) -> None:
    """One GGUF file: `general.architecture` = `arch`, `metadata`, then `tensors` in their own
    dtypes (float32, float16, bfloat16 or int64), in the order given."""
    writer = GGUFWriter(path, arch)
    for key, (vtype, value, sub_type) in metadata.items():
        writer.add_key_value(key, value, vtype, sub_type)
    for name, t in tensors.items():
        ggml, view, _ = _TYPES[t.dtype]
        data = t.detach().contiguous().cpu()
        array = data.view(torch.int16).numpy().view(view) if t.dtype == torch.bfloat16 else data.numpy()
        writer.add_tensor(name, array, raw_dtype=ggml)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensor(t, where: str) -> torch.Tensor:
    """A reader tensor as torch, in its stored dtype, copied out of the memory map."""
    if t.tensor_type not in _TORCH:
        raise UserError(f"{where}: tensor {t.name} is {t.tensor_type.name}; expected F32, F16, BF16 or I64")
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
