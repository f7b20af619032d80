"""Greedy speculative decoding must equal plain greedy decoding token for token, whatever the
drafter proposes: a random EAGLE-3 head, a Medusa head, the target itself, an always-wrong and a
partly right drafter, in chain and tree mode, on Llama and Qwen2 targets."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode import (
    SHAPES,
    NoisyOracle,
    chaotic_target,
    medusa_drafter,
    path_to,
    random_eagle3_head,
)
from trainer.decoding import (
    Chain,
    Eagle3Drafter,
    OracleDrafter,
    Tree,
    greedy_generate,
    speculative_generate,
)
from trainer.decoding.kv_cache import TargetKV

NEW = 24
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return chaotic_target(request.param)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g) for n in (5, 17)]


DRAFTERS = {
    "eagle3": lambda m: Eagle3Drafter(random_eagle3_head(m)),
    "eagle3-reduced-vocab": lambda m: Eagle3Drafter(random_eagle3_head(m, draft_vocab=64)),
    "medusa": medusa_drafter,
    "oracle": OracleDrafter,
    "always-wrong": lambda m: OracleDrafter(m, shift=1),
    "partly-right": NoisyOracle,
}


def test_plain_greedy_equals_transformers_generate(target, prompts):
    for ids in prompts:
        mask = torch.ones(1, ids.numel(), dtype=torch.long)
        ref = target.generate(ids[None], attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        assert greedy_generate(target, ids, NEW).tokens == ref[0, ids.numel() :].tolist()


@pytest.mark.parametrize("shape", SHAPES, ids=["chain", "tree"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_speculative_output_equals_plain_greedy(target, prompts, name, shape):
    drafter = DRAFTERS[name](target)
    ids = prompts[1]
    plain = greedy_generate(target, ids, NEW).tokens
    spec = speculative_generate(target, drafter, ids, NEW, shape)
    assert spec.tokens == plain
    assert spec.stats.new_tokens == NEW and spec.stats.drafts == spec.stats.target_forwards - 1


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_acceptance_length_is_k_plus_one(target, prompts, k):
    stats = speculative_generate(target, OracleDrafter(target), prompts[1], NEW, Chain(k)).stats
    assert stats.mean_acceptance_length == k + 1
    assert stats.accepted_per_position == [stats.drafts] * k


def test_oracle_tree_acceptance_is_depth_plus_one_and_wrong_is_one(target, prompts):
    tree = Tree(depth=4)
    stats = speculative_generate(target, OracleDrafter(target), prompts[0], NEW, tree).stats
    assert stats.mean_acceptance_length == 5
    wrong = speculative_generate(target, OracleDrafter(target, 1), prompts[0], NEW, tree).stats
    assert wrong.mean_acceptance_length == 1 and wrong.drafts == NEW - 1


def test_generation_stops_at_eos(target, prompts):
    plain = greedy_generate(target, prompts[1], NEW).tokens
    eos = plain[6]
    expected = plain[: plain.index(eos) + 1]
    assert greedy_generate(target, prompts[1], NEW, {eos}).tokens == expected
    for shape in SHAPES:
        out = speculative_generate(target, OracleDrafter(target), prompts[1], NEW, shape,
                                   eos_ids={eos})
        assert out.tokens == expected


def test_tree_verification_matches_plain_forwards(target, prompts):
    """One tree forward gives each node the logits of a plain forward over its own path, and
    the gathered cache continues exactly like a plain cache of the accepted path."""
    prefix = prompts[1]
    parents = [-1, 0, 0, 1, 1, 2]
    tokens = torch.tensor([7, 8, 9, 10, 11, 12])
    kv = TargetKV(target, [])
    kv.prefill(prefix)
    logits, _ = kv.forward(tokens, parents)
    for node in range(len(parents)):
        seq = torch.cat([prefix, tokens[path_to(parents, node)]])
        plain = target(seq[None]).logits[0, -1]
        torch.testing.assert_close(logits[node], plain, atol=1e-4, rtol=1e-4)
    kv.keep([0, 2, 5])
    nxt, _ = kv.forward(torch.tensor([13]))
    seq = torch.cat([prefix, tokens[[0, 2, 5]], torch.tensor([13])])
    torch.testing.assert_close(nxt[0], target(seq[None]).logits[0, -1], atol=1e-4, rtol=1e-4)

