"""DSpark training and drafting: the trainee's logits for a label are the drafter's for that slot
when the slot before drew the data's token (what trains is what drafts, Markov bias included), the
drafter draws its slots one after the other on the bias of the token drawn before, the loss
reaches the Markov and confidence heads, and greedy speculative decoding with a briefly trained
head equals transformers' `generate` token for token."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode import chaotic_target
from tests.support.heads import assert_block_drafts_are_lossless, batch_of, random_dspark_head
from trainer.decoding import Chain
from trainer.decoding.dspark import DSparkDrafter
from trainer.decoding.verify import Sampling
from trainer.kinds.dspark import DSparkTrainee

pytestmark = pytest.mark.usefixtures("single_thread")
T = 32


@pytest.fixture(scope="module")
def target():
    return chaotic_target("llama")


def test_the_drafter_draws_each_slot_on_the_bias_of_the_token_drawn_before(target):
    head = random_dspark_head(target, block_size=4, aux_layer_ids=[1, 2, 3])
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    hs = target(ids, output_hidden_states=True).hidden_states
    drafter = DSparkDrafter(head)
    drafter.start(ids[0, :11], [hs[i][0, :11] for i in head.aux_layer_ids], int(ids[0, 11]))
    base = drafter.block_logits()
    draft = drafter.propose(Chain(3), Sampling())
    prev, expected = int(ids[0, 11]), []
    for row in base:
        prev = int((row + head.bias(torch.tensor(prev))).argmax())
        expected.append(prev)
    assert draft.tokens.tolist() == expected
    # the bias matters here: without it the block's own argmax differs somewhere
    assert base.argmax(-1).tolist() != expected or head.bias(torch.tensor(expected)).abs().max() > 0


def test_the_trainees_logits_are_the_drafters_with_the_datas_previous_token(target):
    head = random_dspark_head(target, block_size=4, aux_layer_ids=[1, 2, 3])
    trainee = DSparkTrainee(head, anchors_per_sample=3)
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(2))
    batch = batch_of(target, head, ids)
    anchors = trainee.batch_index(batch)["dflash_anchors"]
    with torch.no_grad():
        blocks = trainee.blocks(batch["aux_hidden"], ids, anchors, torch.arange(T)[None])
    hs = target(ids, output_hidden_states=True).hidden_states
    for j, a in enumerate(anchors[0].tolist()):
        drafter = DSparkDrafter(head)
        drafter.start(ids[0, :a], [hs[i][0, :a] for i in head.aux_layer_ids], int(ids[0, a]))
        for k in range(1, 4):
            if a + k >= T:
                break
            prev = ids[0, a + k - 1]
            trained = trainee.draft_logits(blocks[0, 4 * j + k], prev)
            drafted = drafter.block_logits()[k - 1] + head.bias(prev)
            torch.testing.assert_close(trained, drafted, atol=1e-5, rtol=1e-4)


def test_the_loss_reaches_the_markov_and_confidence_heads_and_not_the_targets_weights(target):
    head = random_dspark_head(target)
    trainee = DSparkTrainee(head, anchors_per_sample=4)
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(3))
    out = trainee(batch_of(target, head, ids))
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    for p in (head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight,
              head.confidence_head.proj.weight, head.fc.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert head.lm_head.weight.grad is None and head.embed_tokens.weight.grad is None
    without = DSparkTrainee(head, anchors_per_sample=4, confidence_weight=0.0)
    assert out["loss"] > without(batch_of(target, head, ids))["loss"]  # the BCE term is in it


def test_greedy_speculative_decoding_equals_generate_and_accepts(target):
    torch.manual_seed(0)
    head = random_dspark_head(target, block_size=4, aux_layer_ids=[1, 2, 3])
    assert_block_drafts_are_lossless(target, DSparkTrainee(head, anchors_per_sample=16), DSparkDrafter)
