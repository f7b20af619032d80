"""Pre-packed oneDNN linears for small-batch decoding on a CPU.

Verifying k+1 tokens multiplies a [k+1, H] activation by every weight matrix. PyTorch's default
CPU path (MKL sgemm) packs the whole weight matrix again on every such call, so on the CPUs
measured here a 4-token SmolLM2 forward cost about twice a 1-token one: the gain of speculation,
gone. oneDNN with the weights packed once (the kernel inductor's CPU backend uses) keeps a short
forward close to a 1-token one. Applied to every model of a comparison, baselines included, so
speedups compare like with like.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn


def packed_linears_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor):
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@contextmanager
def packed_linears(*modules: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, every float32 CPU `nn.Linear` in `modules` runs on packed weights.

    Yields how many layers were switched (0 when disabled, unavailable, or nothing qualifies).
    The weights must not change inside the block; on exit the layers are plain again.
    """
    switched: list[nn.Linear] = []
    if enabled and packed_linears_available():
        with torch.no_grad():
            for module in modules:
                for layer in module.modules():
                    w = layer.weight if type(layer) is nn.Linear else None
                    if w is None or w.device.type != "cpu" or w.dtype != torch.float32:
                        continue
                    if "forward" in vars(layer):  # already switched (shared or nested)
                        continue
                    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
                    bias = None if layer.bias is None else layer.bias.detach()
                    layer.forward = partial(_packed_forward, packed, bias)
                    switched.append(layer)
    try:
        yield len(switched)
    finally:
        for layer in switched:
            del layer.forward
