"""The soft-target cross-entropy at every block size and on every path equals the plain unfused
chain, values, argmax and gradients: a CPU's L2-sized chunks, a GPU's whole-row blocks, one row,
an uneven tail, eager and compiled (torch.compile builds C++ kernels on this CPU from the same
bodies it builds Triton kernels from on CUDA), float32 and bf16 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer import objective
from trainer.objective import CHUNK_BYTES, GPU_BLOCK_BYTES, rows_per_block, soft_cross_entropy

VOCAB = 32000  # SpecForge's draft vocabulary
ROWS = 20
CPU_ROWS = rows_per_block("cpu", VOCAB)  # 8: blocks of 8, 8 and a tail of 4

PATHS = [  # (rows per block, compiled)
    (1, False),
    (CPU_ROWS, False),
    (rows_per_block("cuda", VOCAB), False),  # every row in one block
    (7, False),  # 7, 7 and a tail of 6
    (rows_per_block("cuda", VOCAB), True),
    (7, True),
]


def test_rows_per_block_by_device_and_budget():
    assert rows_per_block("cpu", VOCAB) == CHUNK_BYTES // (4 * VOCAB) == 8
    assert rows_per_block("cuda", VOCAB) == GPU_BLOCK_BYTES // (4 * VOCAB) == 2097
    assert rows_per_block("cuda", 8192, budget=1 << 20) == 32
    assert rows_per_block("cpu", 1 << 20) == 1  # a row wider than the budget still runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_block_size_and_path_equals_the_plain_chain(dtype):
    """Targets that do not sum to one too (the sum(p) term of the gradient)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(2 * torch.randn(ROWS, VOCAB, generator=g), -1) * torch.linspace(0.5, 1, ROWS)[:, None]
    logits = (4 * torch.randn(ROWS, VOCAB, generator=g)).to(dtype)
    weight = torch.randn(ROWS, generator=g)
    plain = logits.clone().requires_grad_()
    expected = -(p * F.log_softmax(plain.float(), -1)).sum(-1)
    (expected * weight).sum().backward()
    exact = dict(rtol=1e-6, atol=1e-5) if dtype == torch.float32 else {}
    for rows, compiled in PATHS:
        blocked = logits.clone().requires_grad_()
        loss, top = soft_cross_entropy(blocked, p, rows=rows, compiled=compiled)
        (loss * weight).sum().backward()
        assert loss.dtype == torch.float32 and blocked.grad.dtype == dtype
        path = f"rows={rows} compiled={compiled}"
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-5, msg=path)
        torch.testing.assert_close(blocked.grad, plain.grad, **exact, msg=path)
        assert torch.equal(top, logits.float().argmax(-1))


def test_the_default_path_is_the_devices(monkeypatch):
    """A CPU tensor takes the CPU's chunks, eagerly."""
    taken = {}
    monkeypatch.setattr(objective.SoftCrossEntropy, "apply", lambda *args: taken.update(args=args[2:]))
    soft_cross_entropy(torch.zeros(3, VOCAB), torch.zeros(3, VOCAB))
    assert taken["args"] == (CPU_ROWS, False)


def test_without_compile_the_loss_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    objective.compile_works.cache_clear()
    try:
        assert not objective.compile_works("cuda") and not objective.compile_works("cuda")
    finally:
        objective.compile_works.cache_clear()
    assert capsys.readouterr().out.count("torch.compile is unavailable on cuda") == 1
