"""Sampling through the whole decoder is lossless: on a 16-token target, the joint law of three
generated tokens from speculative sampling (temperature + top-p; EAGLE-3 chain drafts sampled
from a reduced-vocabulary head or taken as its argmax, and EAGLE-2 tree drafts) matches the
target's own law (chi-square). 3 x 1000 decodes, ~25 s: the unit tier's largest statistical
test, here since #62 (every greedy decoding path stays in tests/unit/trainer/)."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode import (
    chaotic_target,
    chi_square_pvalue,
    random_eagle3_head,
)
from trainer.decoding import Chain, Eagle3Drafter, Sampling, Tree, speculative_generate
from trainer.decoding.verify import warp

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]
V, TEMPERATURE, TOP_P, DRAWS = 16, 0.8, 0.9, 1000
PROMPT = torch.tensor([3, 1, 4, 1, 5, 9])


@pytest.fixture(scope="module")
def target():
    return chaotic_target("llama", vocab=V, seed=1, layers=2)


@torch.no_grad()
def exact_joint(target) -> torch.Tensor:
    """P(t1, t2, t3) [V**3] of plain sampling, from one batched forward per depth."""
    def law(prefixes: torch.Tensor) -> torch.Tensor:
        seqs = torch.cat([PROMPT.expand(prefixes.shape[0], -1), prefixes], dim=1)
        return warp(target(seqs).logits[:, -1], TEMPERATURE, TOP_P)

    one = torch.arange(V)[:, None]
    two = torch.cartesian_prod(torch.arange(V), torch.arange(V))
    p1 = law(torch.empty(1, 0, dtype=torch.long))[0]
    p2 = law(one)
    p3 = law(two).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


# ~3 x 1000 decodes: about 8 s each on one core (20 s on 2 shared ones)
@pytest.mark.parametrize(
    "shape, draft_sampling",
    [(Chain(2), True), (Chain(2), False), (Tree(total_tokens=6, depth=2, topk=3), False)],
    ids=["chain-sampled-drafts", "chain-argmax-drafts", "tree"],
)
def test_speculative_sampling_matches_the_target_law(target, shape, draft_sampling):
    # Sampled drafts come from a reduced-vocabulary head (even ids): q lives on half the tokens.
    reduced = V // 2 if draft_sampling else None
    drafter = Eagle3Drafter(random_eagle3_head(target, draft_vocab=reduced, seed=2))
    sampling = Sampling(TEMPERATURE, TOP_P, torch.Generator().manual_seed(0), draft_sampling)
    counts = torch.zeros(V**3)
    accepted = 0
    for _ in range(DRAWS):
        out = speculative_generate(target, drafter, PROMPT, 3, shape, sampling)
        a, b, c = out.tokens
        counts[(a * V + b) * V + c] += 1
        accepted += out.stats.accepted_tokens
    assert accepted > DRAWS // 50  # drafts were really accepted, not only rejected
    assert chi_square_pvalue(counts, exact_joint(target)) > 1e-3
