"""The head attention a CUDA device runs (`heads.eagle3.model.FUSED_KERNELS`: step 0 exactly
causal without a mask, for flash with GQA; K/V repeated to every query head under a mask, for the
memory-efficient kernel; later TTT steps in chunks sized by the device) equals the path the CPU
runs, values and gradients. The choice is forced on the CPU, so the same code runs here as there.

DFlash and DSpark are not here: their blocks always attend under a mask that is not causal (the
context before each anchor, then the block), and their attention already repeats K/V to every
query head (`heads.dflash.model.DFlashAttention`), the memory-efficient kernel's form; nothing of
theirs changed.
"""

from __future__ import annotations

import pytest
import torch

from heads.eagle3 import model as eagle3_model
from heads.eagle3.model import context_attention
from tests.support.syncs import assert_steps_never_sync, samples
from tests.support.syncs import eagle3 as eagle3_trainee
from tests.support.syncs import peagle as peagle_trainee
from trainer.batching import collate, collate_packed
from trainer.kinds.eagle3 import attention_kernels, ttt_attention_mask

pytestmark = pytest.mark.usefixtures("single_thread")

WINDOW = 16  # the least a head takes: samples of up to 40 tokens, so it cuts keys off
# (length, labelled spans): rows longer than the window, of different lengths, two labelled turns.
LONG = [(40, [range(5, 18), range(24, 40)]), (29, [range(3, 29)]), (21, [range(12, 21)]), (8, [])]


def eagle3(model, **head):
    torch.manual_seed(0)
    return eagle3_trainee(model, ttt_length=3, **head)


def peagle(model, **head):
    torch.manual_seed(0)
    return peagle_trainee(model, slots=3, anchor_fraction=1.0, **head)


def grads_of(trainee, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The trainee's outputs on `batch` (as the loop hands it over on the CPU: floats in float32)
    and its loss's gradients."""
    batch = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    out = trainee(batch)
    params = [p for p in trainee.parameters() if p.requires_grad]
    return out, list(torch.autograd.grad(out["loss"], params))


@pytest.mark.parametrize("layout", ["causal", "packed", "window"])
def test_context_attention_fused_equals_the_masked_path(layout):
    """Step 0's attention, grouped K/V heads (6 query heads over 2): without a mask (exactly
    causal) or with K/V repeated under a packed or windowed mask, against SDPA over the bool mask
    with `enable_gqa` (the CPU's path), values and gradients."""
    g = torch.Generator().manual_seed(0)
    b, heads, groups, t, d = 2, 6, 2, 9, 8
    pos = torch.arange(t).expand(b, t)  # a window of 4: the maths hold at any width
    starts = {"causal": None, "window": None, "packed": torch.tensor([[0] * 4 + [4] * 5, [0] * 9])}[layout]
    window = 4 if layout == "window" else None
    mask = ttt_attention_mask(pos, t, 0, starts, window)
    q = torch.randn(b, heads, t, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, groups, t, d, generator=g, requires_grad=True) for _ in range(2))
    outs = []
    for fused in (False, True):
        out = context_attention(q, k, v, None if fused and layout == "causal" else mask, fused)
        outs.append((out, torch.autograd.grad(out.square().sum(), (q, k, v))))
    (want, want_grads), (got, got_grads) = outs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("build", [eagle3, peagle])
def test_fused_path_keeps_the_loss_and_gradients(tiny_model, build, packing, window, monkeypatch):
    """A whole EAGLE-3 / P-EAGLE step (every TTT step or slot, rows of different lengths, two
    samples a row when packed, with and without a window shorter than the rows) on the
    fused-kernel path against the CPU's: the same loss, metric sums and gradients."""
    trainee, fields = build(tiny_model, sliding_window=window)
    items = samples(tiny_model, fields, LONG)
    batch = (collate_packed([items[:2], items[2:]], trainee.batch_index) if packing
             else collate(items, trainee.batch_index))
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(eagle3_model, "FUSED_KERNELS", fused)
        runs.append(grads_of(trainee, batch))
    (want, want_grads), (got, got_grads) = runs
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    for mine, theirs in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("build", [eagle3, peagle])
def test_fused_path_never_syncs(tiny_model, build, packed, tmp_path, monkeypatch):
    """The fused-kernel path decides from the batch's layout on the host: its steps read nothing
    back from the device, padded or packed."""
    monkeypatch.setattr(eagle3_model, "FUSED_KERNELS", True)
    trainee, fields = build(tiny_model)
    assert_steps_never_sync(trainee, samples(tiny_model, fields), tmp_path, packed=packed)


def test_attention_kernels_reports_each_path(tiny_model, monkeypatch):
    """The GPU check's report: on the CPU path step 0 always has a mask; forced to the fused path,
    an unpacked batch without a window has none, a packed one keeps it; the later steps' chunk
    follows `branch_scores`. SDPA's math kernel takes every call (the CPU has no other here)."""
    trainee, _ = eagle3(tiny_model)
    cpu = attention_kernels(trainee.head, 2, 64)
    assert cpu["fused"] is False and cpu["step0_mask"] == "bool"
    assert "math" in cpu["step0_kernels"]
    heads = trainee.head.config.num_attention_heads
    assert cpu["ttt_rows_per_chunk"] == eagle3_model.BRANCH_SCORES // (2 * heads * 64)
    monkeypatch.setattr(eagle3_model, "FUSED_KERNELS", True)
    assert attention_kernels(trainee.head, 2, 64)["step0_mask"] is None
    assert attention_kernels(trainee.head, 2, 64, packed=True)["step0_mask"] == "bool"
