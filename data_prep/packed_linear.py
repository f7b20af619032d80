"""Pre-packed float32 GEMM weights for CPU decoding.

A decode step multiplies a few dozen rows by every weight matrix of the model. At that size
MKL's sgemm spends a fifth of its time re-packing the weight into its blocked layout on every
call (the regeneration engine measured 630 ms a step at 128 rows on 2 cores, 517 ms packed
once). `packed_linears` packs each `nn.Linear` once for one row count and routes calls with
exactly that many rows through the packed kernel; any other row count (prefill, a thinning
batch) falls back to the plain kernel inside the same op, with the same result.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def can_pack(model) -> bool:
    """Packing pays on CPU float32 with MKL, and doubles the linear weights in memory: only when
    they take under a quarter of the machine's RAM."""
    weight = model.get_input_embeddings().weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return False
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    linear = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 4 * linear < ram


@contextmanager
def packed_linears(model, rows: int) -> Iterator[None]:
    """Within the block, every `nn.Linear` of `model` called on `rows` rows uses a packed copy
    of its weight; on leaving, the modules are as they were. A no-op where `can_pack` is False."""
    if not can_pack(model):
        yield
        return
    modules = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        for m in modules:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), rows)
            m.forward = _packed_forward(m.weight.detach(), m.bias, packed, rows)
        yield
    finally:
        for m in modules:
            m.__dict__.pop("forward", None)


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor, rows: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)

    return forward
