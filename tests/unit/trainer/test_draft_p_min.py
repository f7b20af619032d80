"""`Chain.p_min` (`eval.draft_p_min`, llama.cpp's --draft-p-min): a chain stops before the first
position whose draft top probability is below p_min, greedy output stays the target's own, and
p_min=0 drafts exactly as before. The threshold is the median confidence the drafter showed at
p_min=0, so that some steps are cut and some are not."""

from __future__ import annotations

import statistics

import pytest
import torch

from tests.support.decode import chaotic_target, medusa_drafter, random_eagle3_head
from tests.support.heads import random_dflash_head, random_dspark_head
from trainer.decoding import Chain, Eagle3Drafter, greedy_generate, speculative_generate
from trainer.decoding.dflash import DFlashDrafter
from trainer.decoding.drafters import confident_prefix
from trainer.decoding.dspark import DSparkDrafter

NEW = 24
K = 3
pytestmark = pytest.mark.usefixtures("single_thread")

DRAFTERS = {
    "eagle3": lambda m: Eagle3Drafter(random_eagle3_head(m, draft_vocab=64)),  # one forward a token
    "medusa": medusa_drafter,  # every position from one forward
    "dflash": lambda m: DFlashDrafter(random_dflash_head(m, block_size=4, aux_layer_ids=[1, 2, 3])),
    # one forward, then each slot on the bias of the token drawn before
    "dspark": lambda m: DSparkDrafter(random_dspark_head(m, block_size=4, aux_layer_ids=[1, 2, 3])),
}


@pytest.fixture(scope="module")
def target():
    return chaotic_target("llama")


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_p_min_cuts_chains_and_stays_lossless(target, name):
    drafter = DRAFTERS[name](target)
    ids = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(0))
    plain = greedy_generate(target, ids, NEW).tokens
    full = speculative_generate(target, drafter, ids, NEW, Chain(K))
    assert full.tokens == plain
    assert all(len(s.confidence) == K for s in full.stats.steps) and full.stats.steps
    assert len(full.stats.steps) == full.stats.drafts
    p_min = statistics.median(c for s in full.stats.steps for c in s.confidence)

    cut = speculative_generate(target, drafter, ids, NEW, Chain(K, p_min))
    assert cut.tokens == plain  # lossless whatever the cut
    steps = cut.stats.steps
    assert all(c >= p_min for s in steps for c in s.confidence)
    assert any(len(s.confidence) < K for s in steps), "no chain was cut"
    assert cut.stats.drafted_tokens == sum(len(s.confidence) for s in steps) < K * len(steps)
    assert all(s.accepted <= len(s.confidence) for s in steps)
    # Tokens per target forward still count every step, drafted or not.
    assert cut.stats.drafts == cut.stats.target_forwards - 1


def test_the_cut_is_the_first_unsure_position():
    assert confident_prefix([0.9, 0.4, 0.8], 0.5) == 1
    assert confident_prefix([0.2, 0.9], 0.5) == 0
    assert confident_prefix([0.6, 0.5], 0.5) == 2
    assert confident_prefix([0.1, 0.1], 0.0) == 2
