"""DFlash training and drafting: the anchors and block mask, the one-forward block the drafter
computes equals the trainee's for the same block (so what trains is what drafts), its cache holds
exactly the verified positions' context K/V, and greedy speculative decoding with a briefly
trained head is accepted sometimes and equals transformers' `generate` token for token."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode import chaotic_target
from tests.support.heads import assert_block_drafts_are_lossless, batch_of, random_dflash_head
from trainer.decoding import Tree
from trainer.decoding.dflash import DFlashDrafter
from trainer.decoding.verify import Sampling
from trainer.kinds.dflash import (
    ANCHOR_VALID,
    ANCHORS,
    ROWS,
    SLOTS,
    DFlashTrainee,
    block_attention_mask,
    dflash_batch_index,
)
from trainer.objective import Objective

pytestmark = pytest.mark.usefixtures("single_thread")
T = 32


@pytest.fixture(scope="module")
def target():
    return chaotic_target("llama")


def test_anchors_have_context_and_a_trained_next_token_and_repeat_per_batch():
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros(2, T, dtype=torch.bool)
    loss_mask[0, 10:20] = True
    loss_mask[1, 0:T] = True
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids)}
    index = dflash_batch_index(batch, block_size=4, per_sample=6)
    anchors, valid = index[ANCHORS], index[ANCHOR_VALID]
    assert valid.sum(1).tolist() == [6, 6]
    a0 = anchors[0][valid[0]]
    assert ((a0 >= 10) & (a0 <= 18)).all()  # its token and the next one are answers
    assert (anchors[1][valid[1]] >= 1).all()  # never position 0: no context before it
    assert torch.equal(dflash_batch_index(batch, 4, 6)[ANCHORS], anchors)  # same batch, same draw
    # Labels: slot k >= 1 whose position a+k is an answer of the same sample.
    rows, slots = index[ROWS], index[SLOTS]
    block, k = rows // 4, slots
    labels = anchors.flatten()[block] + k
    row = block // anchors.shape[1]
    assert (k >= 1).all() and loss_mask[row, labels].all()


def test_block_mask_sees_its_own_samples_context_before_the_anchor():
    places = torch.cat([torch.arange(5), torch.arange(7)])[None]  # two packed samples
    anchors = torch.tensor([[3, 9]])
    inside = torch.block_diag(torch.ones(2, 2), torch.ones(2, 2)).bool()
    mask = block_attention_mask(anchors, places, 12, inside)[0, 0]
    assert mask.shape == (4, 16)
    assert mask[0, :12].nonzero().squeeze(1).tolist() == [0, 1, 2]
    assert mask[2, :12].nonzero().squeeze(1).tolist() == [5, 6, 7, 8]  # not the first sample
    assert mask[:, 12:].tolist() == inside.tolist()


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 16)])
def test_drafter_block_equals_the_trainees_block(target, causal, window):
    """A window (`head.sliding_window`) included: anchors past it see only its last positions."""
    head = random_dflash_head(target, block_size=4, causal=causal, aux_layer_ids=[1, 2, 3],
                              sliding_window=window)
    trainee = DFlashTrainee(head, anchors_per_sample=5)
    assert DFlashDrafter(head).window == window
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(1))
    batch = batch_of(target, head, ids)
    anchors = trainee.batch_index(batch)[ANCHORS]
    with torch.no_grad():
        blocks = trainee.blocks(batch["aux_hidden"], ids, anchors, torch.arange(T)[None])
    hs = target(ids, output_hidden_states=True).hidden_states
    for j, a in enumerate(anchors[0].tolist()):
        drafter, p = DFlashDrafter(head), min(2, a)
        # Verified tokens arrive in pieces, as they do while decoding: the cache joins them.
        drafter.start(ids[0, :p], [hs[i][0, :p] for i in head.aux_layer_ids], int(ids[0, p]))
        if a > p:
            drafter.commit(ids[0, p:a], [hs[i][0, p:a] for i in head.aux_layer_ids], int(ids[0, a]))
        expected = head.logits(blocks[0, 4 * j + 1 : 4 * j + 4])
        torch.testing.assert_close(drafter.block_logits(), expected, atol=1e-5, rtol=1e-4)


def test_a_tree_is_refused_in_one_line(target):
    drafter = DFlashDrafter(random_dflash_head(target))
    with pytest.raises(Exception, match="eval.mode=tree"):
        drafter.propose(Tree(), Sampling())


@pytest.mark.parametrize("weights", ["decay", "dpace"])
def test_loss_is_finite_and_reaches_only_the_trainable_weights(target, weights):
    head = random_dflash_head(target)
    trainee = DFlashTrainee(head, anchors_per_sample=4, position_weights=weights,
                            objective=Objective(loss="lk"))
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(2))
    out = trainee(batch_of(target, head, ids))
    out["loss"].backward()
    total = out["total"].tolist()  # a block near the row's end has fewer labels
    assert torch.isfinite(out["loss"]) and total[0] == 8 and total == sorted(total, reverse=True)
    assert head.fc.weight.grad is not None and head.lm_head.weight.grad is None
    assert head.embed_tokens.weight.grad is None


def test_dpace_weights_are_the_acceptance_each_slot_still_leads_to(target):
    head = random_dflash_head(target, block_size=4)
    trainee = DFlashTrainee(head, 1, position_weights="dpace", dpace_alpha=0.0)
    rows, slots = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])
    c = torch.tensor([0.5, 0.4, 0.1])
    w = trainee.slot_weights(slots, c, rows, 4)
    expected = [0.5 + 0.2 + 0.02, 0.2 + 0.02, 0.02]
    torch.testing.assert_close(w, torch.tensor(expected))


@pytest.mark.parametrize("causal", [False, True])
def test_greedy_speculative_decoding_equals_generate_and_accepts(target, causal):
    torch.manual_seed(0)
    head = random_dflash_head(target, block_size=4, causal=causal, aux_layer_ids=[1, 2, 3])
    assert_block_drafts_are_lossless(target, DFlashTrainee(head, anchors_per_sample=16), DFlashDrafter)
