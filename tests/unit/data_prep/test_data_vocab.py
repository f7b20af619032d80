"""Draft vocabulary: top masked-token frequencies, engines' d2t/t2d convention."""

from __future__ import annotations

import pytest
import torch

from conf.errors import UserError
from data_prep.folders.vocab import (
    build_draft_vocab,
    count_masked_tokens,
    coverage,
    load_draft_vocab,
    save_draft_vocab,
)
from data_prep.template import Tokenized


def test_counts_only_masked_tokens():
    s = [Tokenized([1, 2, 2, 3], [False, True, True, True], False), Tokenized([3], [True], False)]
    assert count_masked_tokens(s, 5).tolist() == [0, 0, 2, 2, 0]


def test_top_k_sorted_with_offsets_and_coverage():
    counts = torch.tensor([0, 5, 1, 9, 0, 5, 2, 0])
    d2t, t2d = build_draft_vocab(counts, 4)
    kept = torch.arange(4) + d2t
    assert kept.tolist() == [1, 3, 5, 6]  # ascending target ids; tie 1/5 both kept
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.nonzero().flatten().tolist() == kept.tolist()
    assert coverage(counts, t2d) == pytest.approx(21 / 22)
    # Ties at the cut go to the lower id; a size above the vocabulary is capped.
    d2t, _ = build_draft_vocab(torch.tensor([1, 1, 1]), 2)
    assert (torch.arange(2) + d2t).tolist() == [0, 1]
    # Slots beyond the ids the data contains go to the lowest unseen ids.
    d2t, t2d = build_draft_vocab(counts, 6)
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 5, 6] and int(t2d.sum()) == 6


def test_saved_vocab_round_trips(tmp_path):
    counts = torch.tensor([3, 0, 1, 7])
    d2t, t2d = build_draft_vocab(counts, 2)
    save_draft_vocab(tmp_path, d2t, t2d)
    d2t2, t2d2 = load_draft_vocab(tmp_path)
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    with pytest.raises(UserError, match="draft_vocab.safetensors"):
        load_draft_vocab(tmp_path / "nothing")
