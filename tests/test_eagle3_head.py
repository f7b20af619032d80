"""The EAGLE-3 head: its TTT unroll sees exactly what a chain decoder sees, its folder round-trips,
and it refuses a target it was not trained for."""

from __future__ import annotations

import pytest
import torch

from conf.errors import UserError
from conf.schema import Eagle3Config
from data_prep.target import load_target
from heads.eagle3 import Eagle3Head
from tests.conftest import build_tiny_target
from trainer.eagle3_trainee import Eagle3Trainee, ttt_attention_mask
from trainer.trainee import simulated_acceptance_length


def identity_vocab(vocab_size: int, keep: int):
    """The `keep` lowest target ids as the draft vocabulary."""
    d2t = torch.zeros(keep, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:keep] = True
    return d2t, t2d


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model, _ = load_target(str(tiny_llama_dir))
    torch.manual_seed(0)
    d2t, t2d = identity_vocab(model.config.vocab_size, 3000)
    head = Eagle3Head.from_target(model, str(tiny_llama_dir), Eagle3Config(), d2t, t2d)
    return model, head


def aux_features(model, head, ids):
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in head.aux_layer_ids], dim=-1), hs[-1]


def test_ttt_mask_by_hand():
    m = ttt_attention_mask(torch.arange(3)[None], 3, 2)[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]
    # Later steps computing positions 1 and 2 of 3: causal over the context, own branch after.
    m = ttt_attention_mask(torch.tensor([[1, 2]]), 3, 1)[0, 0].int().tolist()
    assert m == [[1, 1, 0, 1, 0], [1, 1, 1, 0, 1]]


def test_ttt_unroll_equals_chain_decoding(tiny):
    """Step k of training at position t == the k-th chained draft step after verifying 0..t."""
    model, head = tiny
    torch.manual_seed(1)
    ids = torch.randint(0, 3000, (1, 12))
    aux, _ = aux_features(model, head, ids)
    trainee = Eagle3Trainee(head, model.get_output_embeddings().weight, ttt_length=4, step_weight=0.8)
    with torch.no_grad():
        unrolled = [head.logits(hidden) for _, hidden, _, _ in trainee.unroll(aux, ids)]
        # Later steps on a subset of positions (a different count per row, so one row is
        # padded) give the same rows as the full unroll.
        keep = torch.zeros(2, 12, dtype=torch.bool)
        keep[0, [3, 7, 8]] = True
        keep[1, 5] = True
        for k, hidden, pos, valid in trainee.unroll(aux.expand(2, -1, -1), ids.expand(2, -1), keep):
            if k > 0:
                assert pos[0].tolist() == [3, 7, 8] and pos[1, valid[1]].tolist() == [5]
            torch.testing.assert_close(head.logits(hidden)[valid], unrolled[k][0, pos[valid]])
        for t in (3, 7):
            # Inference: step 0 over the verified prefix 0..t, then chain on position t alone.
            pos = torch.arange(t + 1)[None]
            hidden, logits, (k_cache, v_cache) = head.step(
                head.fuse(aux[:, : t + 1]), ids[:, 1 : t + 2], pos
            )
            torch.testing.assert_close(logits[:, t], unrolled[0][:, t], atol=1e-5, rtol=1e-4)
            hidden = hidden[:, t:]
            for k in range(1, 4):
                token = ids[:, t + 1 + k : t + 2 + k]
                hidden, logits, (kn, vn) = head.step(
                    hidden, token, torch.tensor([[t + k]]), None, (k_cache, v_cache)
                )
                k_cache, v_cache = torch.cat([k_cache, kn], 2), torch.cat([v_cache, vn], 2)
                torch.testing.assert_close(logits[:, 0], unrolled[k][:, t], atol=1e-5, rtol=1e-4)


def test_loss_is_finite_and_metrics_count_labels(tiny):
    model, head = tiny
    ids = torch.randint(0, 3000, (2, 10))
    aux, final = aux_features(model, head, ids)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 5:] = True
    trainee = Eagle3Trainee(head, model.get_output_embeddings().weight, ttt_length=3, step_weight=0.8)
    out = trainee({"input_ids": ids, "loss_mask": mask, "aux_hidden": aux, "final_hidden": final})
    assert torch.isfinite(out["loss"])
    # label positions t+2+k in 5..9 -> positions t in 3-k..7-k: 5 per row at every step
    assert out["total"].tolist() == [10.0, 10.0, 10.0]


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)


def test_save_load_roundtrip(tiny, tmp_path, tiny_llama_dir):
    model, head = tiny
    head.save_pretrained(tmp_path / "h")
    again = Eagle3Head.from_pretrained(tmp_path / "h", model, str(tiny_llama_dir))
    ids = torch.randint(0, 3000, (1, 6))
    hidden = torch.randn(1, 6, 64)
    pos = torch.arange(6)[None]
    torch.testing.assert_close(head.step(hidden, ids, pos)[1], again.step(hidden, ids, pos)[1])
    assert torch.equal(again.d2t, head.d2t) and torch.equal(again.t2d, head.t2d)
    assert not (tmp_path / "h").with_name("h.tmp").exists()
    # Readable by an engine running as another user (mkdtemp alone would leave 0700 / 0600).
    assert oct((tmp_path / "h").stat().st_mode & 0o777) == "0o755"
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "h").iterdir()} == {"0o644"}


def test_refuses_other_target(tiny, tmp_path, smol_tokenizer):
    _, head = tiny
    head.save_pretrained(tmp_path / "h")
    other_dir = build_tiny_target(tmp_path / "other", "llama", smol_tokenizer, num_hidden_layers=6)
    other, _ = load_target(str(other_dir))
    with pytest.raises(UserError, match="num_hidden_layers 8 != 6"):
        Eagle3Head.from_pretrained(tmp_path / "h", other, str(other_dir))
