"""The regeneration engine's decode attention kernel computes what PyTorch's attention computes
over each row's own positions (on a sliding layer, its window's), read from strided slot-cache
views, and only where it applies.
(The engine's answers with it and without it: `test_regen_engine`.)"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F

from data_prep.answers import decode_attention as da


@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 4, 128), (2, 1, 16), (1, 4, 8)])
def test_kernel_equals_masked_sdpa_over_each_rows_own_positions(kv_heads, group, dim):
    if da.kernel() is None:
        pytest.skip("no C compiler")
    torch.manual_seed(0)
    rows, max_len = 7, 50
    # A slot cache with a spare slot, read through views as the engine does (strides of max_len).
    keys, values = (torch.randn(rows + 1, kv_heads, max_len, dim) for _ in range(2))
    # transformers hands the query over as [rows, heads, 1, dim], transposed from [rows, 1, heads, dim].
    query = torch.randn(rows, 1, kv_heads * group, dim).transpose(1, 2)
    counts = torch.tensor([1, 2, 17, 40, 33, 5, 40])
    width = int(counts.max())
    k, v = keys[:rows, :, :width], values[:rows, :, :width]
    got = da.decode_attention(query, k, v, counts, scale=0.3)

    mask = torch.zeros(rows, 1, 1, width).masked_fill(
        (torch.arange(width) >= counts[:, None])[:, None, None], float("-inf")
    )
    want = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=0.3, enable_gqa=group > 1)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    # Positions past a row's count are never read: garbage there changes nothing.
    keys[:rows, :, 40:] = float("nan")
    values[:rows, :, 40:] = float("nan")
    assert torch.equal(da.decode_attention(query, keys[:rows], values[:rows], counts, scale=0.3), got)
    for bad in (counts - 1, counts + 1):  # a row with no position; one past the view
        with pytest.raises(ValueError, match="counts must lie in"):
            da.decode_attention(query, k, v, bad, scale=0.3)


@pytest.mark.parametrize("window,dim", [(None, 64), (6, 64), (6, 128), (None, 16)])  # each copy
def test_kernel_on_bf16_values_computes_what_it_computes_on_those_values_in_float32(window, dim):
    """With bf16 linears the engine stores values in bf16: the kernel widens each as it reads
    it, so its output is the float32 kernel's over the same values (to float rounding: the
    compiler may order the sums otherwise), and garbage past a row's count is still never read."""
    if da.kernel() is None:
        pytest.skip("no C compiler")
    torch.manual_seed(2)
    rows, kv_heads, group, max_len = 6, 3, 3, 56
    keys = torch.randn(rows, kv_heads, max_len, dim)
    values = torch.randn(rows, kv_heads, max_len, dim).bfloat16()
    query = torch.randn(rows, 1, kv_heads * group, dim).transpose(1, 2)
    counts = torch.tensor([1, 9, 48, 30, 2, 17])
    got = da.decode_attention(query, keys, values, counts, scale=0.125, window=window)
    want = da.decode_attention(query, keys, values.float(), counts, scale=0.125, window=window)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    keys[:, :, 48:], values[:, :, 48:] = float("nan"), float("nan")  # past every row's count
    assert torch.equal(da.decode_attention(query, keys, values, counts, scale=0.125, window=window), got)


@pytest.mark.parametrize("window", [1, 6, 64])
def test_kernel_on_a_sliding_layer_reads_only_each_rows_window(window):
    """A sliding layer (Mistral, Gemma 3) sees a row's last `window` positions only, as
    transformers' mask `key > query - window` says; positions before them are never read."""
    if da.kernel() is None:
        pytest.skip("no C compiler")
    torch.manual_seed(1)
    rows, kv_heads, group, dim, width = 5, 2, 2, 16, 40
    keys, values = (torch.randn(rows, kv_heads, width, dim) for _ in range(2))
    query = torch.randn(rows, 1, kv_heads * group, dim).transpose(1, 2)
    counts = torch.tensor([1, 7, 20, 40, 33])
    got = da.decode_attention(query, keys, values, counts, scale=0.25, window=window)

    pos, last = torch.arange(width), counts[:, None] - 1  # the query sits at position count - 1
    seen = (pos <= last) & (pos > last - window)
    mask = torch.zeros(rows, 1, 1, width).masked_fill(~seen[:, None, None], float("-inf"))
    want = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    before = (pos[None] <= last - window)[:, None, :, None].expand_as(keys)
    keys[before], values[before] = float("nan"), float("nan")
    assert torch.equal(da.decode_attention(query, keys, values, counts, scale=0.25, window=window), got)


def test_slot_attention_applies_to_a_float32_cpu_model_only_and_restores_it(tiny_model):
    model = tiny_model
    before = model.config._attn_implementation
    with da.slot_attention(model) as counted:
        assert counted == (shutil.which("cc") is not None)  # CI has a compiler: the kernel runs there
        if counted:
            assert model.config._attn_implementation != before
    assert model.config._attn_implementation == before
    with da.slot_attention(copy.deepcopy(model).to(torch.bfloat16)) as counted:  # the shared target stays
        assert not counted


def test_keys_and_values_of_unequal_widths_go_to_the_models_own_attention():
    """MLA (DeepSeek-V3) expands its latents into keys wider than its values: the kernel, which
    reads both with the keys' strides, declines them, and the model's own attention runs."""
    if da.kernel() is None:
        pytest.skip("no C compiler")
    query, key = torch.randn(2, 4, 1, 48), torch.randn(2, 4, 9, 48)
    assert da.supported(query, key, torch.randn(2, 4, 9, 48))
    assert not da.supported(query, key, torch.randn(2, 4, 9, 32))
