"""Capture: the stored hidden states are the target's, in the project's layer convention."""

from __future__ import annotations

import pytest
import torch

from conf.errors import UserError
from conf.schema import DataConfig
from data_prep.states.capture import (
    CaptureSpec,
    HfCapturer,
    capture_shard,
    decode,
    dequantize_fp8,
    length_batches,
    quantize_fp8,
)
from data_prep.template import Tokenized


def samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(5, 40000, (n,), generator=g).tolist()
        out.append(Tokenized(ids, [i % 3 == 0 for i in range(n)], False))
    return out


def test_length_batches_respect_the_token_budget():
    assert length_batches([3, 4, 4, 9, 10], 12) == [[0, 1, 2], [3], [4]]
    assert length_batches([50], 10) == [[0]]  # an over-long sample still gets its own batch
    assert length_batches([], 10) == []


def test_fp8_round_trip_keeps_about_three_bits_per_row():
    x = torch.randn(7, 3 * 16) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(16)
    q, scale = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, 3)
    back = dequantize_fp8(q, scale)
    rel = (back - x).abs() / x.reshape(7, 3, 16).abs().amax(-1).repeat_interleave(16, -1)
    assert rel.max() < 2**-4  # e4m3: 3 mantissa bits, relative to each row-layer's max
    assert torch.equal(dequantize_fp8(*quantize_fp8(torch.zeros(2, 6), 2)), torch.zeros(2, 6))


@pytest.mark.parametrize("storage", ["bfloat16", "fp8"])
def test_shard_holds_each_samples_own_hidden_states(tiny_model, storage):
    aux_ids, n = (2, 4, 5), tiny_model.config.num_hidden_layers
    spec = CaptureSpec(aux_ids, n, storage)
    batch = samples([5, 9, 9, 17, 30])
    # several padded batches
    shard = capture_shard(HfCapturer(tiny_model, spec, batch_tokens=40), batch, spec)
    offsets = shard["offsets"].tolist()
    assert offsets == [0, 5, 14, 23, 40, 70]
    assert shard["input_ids"].dtype == torch.int32 and shard["loss_mask"].dtype == torch.bool
    aux, final = decode(shard, "aux_hidden"), decode(shard, "final_hidden")
    tol = 2**-7 if storage == "bfloat16" else 2**-4
    for s, a, b in zip(batch, offsets, offsets[1:]):
        ids = torch.tensor([s.input_ids])
        with torch.no_grad():
            out = tiny_model(ids, output_hidden_states=True)
        hs = out.hidden_states
        want = torch.cat([hs[i] for i in aux_ids], -1)[0]
        assert torch.allclose(aux[a:b], want, rtol=tol, atol=tol * want.abs().max())
        assert torch.allclose(final[a:b], hs[n][0], rtol=tol, atol=tol * hs[n].abs().max())
        # hidden_states[N] is what lm_head reads (after the final norm).
        assert torch.allclose(tiny_model.lm_head(hs[n])[0], out.logits[0], atol=1e-4)
        assert shard["input_ids"][a:b].tolist() == s.input_ids
        assert shard["loss_mask"][a:b].tolist() == s.loss_mask


def test_medusa_final_only_and_joint_tokens_only(tiny_model):
    batch = samples([4, 6])
    final = CaptureSpec((), 8)
    final_only = capture_shard(HfCapturer(tiny_model, final, 4096), batch, final)
    assert set(final_only) == {"input_ids", "loss_mask", "offsets", "final_hidden"}
    assert final_only["final_hidden"].shape == (10, 64)
    tokens = capture_shard(None, batch, CaptureSpec((), None))
    assert set(tokens) == {"input_ids", "loss_mask", "offsets"}


def test_unknown_storage_dtype_is_a_user_error():
    with pytest.raises(UserError, match="data.storage_dtype='fp4'"):
        DataConfig(storage_dtype="fp4")
