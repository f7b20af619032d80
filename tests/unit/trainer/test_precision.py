"""The precision a training step computes in, whatever the strategy and device: DeepSpeed's step
under DDP's autocast, TF32 for float32 matmuls on CUDA devices that have it and nowhere else."""

from __future__ import annotations

import pytest
import torch

from conf.schema import DistConfig
from trainer.distributed import autocast_dtype, fast_float32_matmuls, own_autocast


@pytest.mark.parametrize("precision", ["bf16", "fp16", "no"])
def test_deepspeed_steps_autocast_as_ddp_steps(precision):
    """accelerate enters DDP's autocast (in `autocast_dtype`); draftsmith enters DeepSpeed's.
    tests/e2e/test_train.py::test_dist_settings_reach_every_rank sees it inside the forward."""
    ddp = DistConfig(strategy="ddp", mixed_precision=precision)
    zero = DistConfig(strategy="deepspeed", zero_stage=2, mixed_precision=precision)
    assert own_autocast(zero) == autocast_dtype(ddp) == autocast_dtype(zero)
    assert own_autocast(ddp) is None and own_autocast(DistConfig(mixed_precision=precision)) is None


@pytest.fixture
def tf32_flag():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("device, capability, tf32", [
    ("cuda", (8, 0), True),  # A100
    ("cuda", (9, 0), True),  # H100
    ("cuda", (7, 0), False),  # V100: no TF32 cores
    ("cpu", None, False),
])
def test_tf32_on_cuda_devices_that_have_it_only(tf32_flag, device, capability, tf32):
    mkldnn = torch.backends.mkldnn.matmul.fp32_precision
    fast_float32_matmuls(device, capability)
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.backends.mkldnn.matmul.fp32_precision == mkldnn  # a CPU's matmuls untouched
