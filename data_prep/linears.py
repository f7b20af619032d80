"""How the target's linear layers compute while it writes data (regeneration and capture), and
while the evaluator decodes with it.

Three CPU speed-ups for a float32 target, each confined to a `with` block, so that training and
export see the model exactly as it was loaded:

- **bf16 GEMMs** (`data.matmul_dtype`). On a CPU with native bf16 dot products (AVX512-BF16 or
  AMX) a bf16 matmul runs ~2.5-3x a float32 one (64 rows x 576 x 1536 on the 2-core EPYC here:
  305 vs 130 GFLOPS). Each `nn.Linear` then rounds its input and weight to bf16, accumulates in
  float32 (oneDNN) and hands float32 back: norms, attention, softmax and the residual stream stay
  float32. That is closer to float32 than the all-bf16 forward a GPU serves the target with, and
  data prep is where a target forward costs the most. Evaluation keeps the loaded precision: its
  lossless check compares decodes of different shapes, which bf16 rounding would set apart.
- **Packed float32 weights.** A decode step multiplies a few dozen rows by every weight matrix;
  at that size MKL's sgemm spends a fifth of its time re-packing the weight on every call (the
  regeneration engine measured 630 ms a step at 128 rows on 2 cores, 517 ms packed once). The
  weights are packed once for the engine's row count; any other row count (prefill, a thinning
  batch) falls back to the plain kernel inside the same op, with the same result.
- **oneDNN's packed float32 linear while decoding** (`DecodeLinears`, the evaluator's). A decode
  step of batch 1 multiplies 1 to 5 rows (a token, a verify of 4) by every weight: memory-bound,
  so a verify of 4 should cost about what one token costs. MKL's sgemm does not: its 4-row GEMM
  took 2.2x its 1-row one on the 2-core EPYC here (576 x 1536: 527 vs 250 us, weights out of
  cache; the 49k-row lm_head 19.3 vs 8.5 ms), which made a 4-token verify cost 1.7-1.8x a
  greedy token. oneDNN's linear on weights reordered once runs 4 rows in 241 us and 1 row in
  171 us (lm_head 6.7 and 4.7 ms). Its sums are ordered otherwise than MKL's (1e-4 apart), so
  the evaluator's greedy baseline and speculative runs both decode inside the block (the
  lossless check compares like with like), and the reference it holds them to, transformers'
  `generate`, runs outside it on the model as loaded (a near-tie between the two is a "tie").
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature flags ("" where /proc/cpuinfo is unreadable), read once per process:
    what bf16 GEMMs pay on (`native_bf16`) and what code built with `-march=native` runs on."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in info.splitlines() if line.startswith("flags")), "")


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (the reason bf16 GEMMs pay on it); an
    older CPU emulates them at a fraction of the float32 speed."""
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", cpu_flags()) is not None


def resolve_matmul_dtype(setting: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`data.matmul_dtype` for a target loaded as `dtype` on `device`. auto: bfloat16 for a
    float32 target on a CPU with native bf16, else the target's own; target: its own; bfloat16:
    bf16 GEMMs (only a float32 or float16 target changes)."""
    if setting == "auto":
        faster = device.type == "cpu" and dtype == torch.float32 and native_bf16()
        return torch.bfloat16 if faster else dtype
    return torch.bfloat16 if setting == "bfloat16" else dtype


def can_pack(model) -> bool:
    """Packing pays on CPU float32 with MKL, and doubles the linear weights in memory: only when
    they take under a quarter of the machine's RAM."""
    weight = model.get_input_embeddings().weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return False
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    linear = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 4 * linear < ram


class DataLinears:
    """A reusable `with` block in which every `nn.Linear` of `model` computes in `matmul_dtype`
    (bf16 GEMMs when it differs from the model's dtype) or, for a float32 model given `rows`,
    through weights packed for that row count. The converted weights are made once, here; entering
    only swaps the modules' forwards, and leaving restores them. A no-op when neither applies.
    """

    def __init__(self, model, matmul_dtype: torch.dtype | None = None, rows: int | None = None):
        self.modules = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.forwards = []
        dtype = model.get_input_embeddings().weight.dtype
        if matmul_dtype is not None and matmul_dtype != dtype:
            self.forwards = [_cast_forward(m, matmul_dtype) for m in self.modules]
        elif rows and can_pack(model):
            self.forwards = [_packed_forward(m, rows) for m in self.modules]

    def __enter__(self) -> DataLinears:
        for m, forward in zip(self.modules, self.forwards):
            m.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for m in self.modules[: len(self.forwards)]:
            m.__dict__.pop("forward", None)


class DecodeLinears(DataLinears):
    """`DataLinears` for batch-1 decoding: every `nn.Linear` of a float32 CPU `model` computes
    through oneDNN on weights reordered once, here (module docstring); a no-op elsewhere (a GPU,
    half precision, no oneDNN, too little RAM for the copy)."""

    def __init__(self, model):
        self.modules = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.forwards = []
        if torch.backends.mkldnn.is_available() and can_pack(model):
            self.forwards = [_onednn_forward(m) for m in self.modules]


def _onednn_forward(m: torch.nn.Linear):
    packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
    bias = None if m.bias is None else m.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def _cast_forward(m: torch.nn.Linear, dtype: torch.dtype):
    weight = m.weight.detach().to(dtype)
    bias = None if m.bias is None else m.bias.detach().to(dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(dtype), weight, bias).to(x.dtype)

    return forward


def _packed_forward(m: torch.nn.Linear, rows: int):
    weight, bias = m.weight.detach(), m.bias
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)

    return forward
