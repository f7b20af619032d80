"""The pure rules of the decoder: tree masks/positions by hand, acceptance by hand, and the
sampling rules' output distribution by a chi-square test over many draws."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode import chi_square_pvalue
from trainer.decoding.tree import (
    chain_parents,
    expand_frontier,
    select_nodes,
    static_tree,
    tree_attention_mask,
    tree_position_ids,
    with_prefix,
)
from trainer.decoding.verify import (
    greedy_accept_chain,
    greedy_accept_tree,
    rejection_sample_chain,
    rejection_sample_tree,
    warp,
)

# root 0 -> {1, 2}; 1 -> {3, 4}; 2 -> {5}
TWO_LEVEL = [-1, 0, 0, 1, 1, 2]


def test_two_level_tree_mask_and_positions_by_hand():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree_attention_mask(TWO_LEVEL), expected)
    assert tree_position_ids(TWO_LEVEL, start=10).tolist() == [10, 11, 11, 12, 12, 12]
    full = with_prefix(expected, prefix_len=3)
    assert full.shape == (1, 1, 6, 9) and full[0, 0, :, :3].all()


def test_chain_is_a_causal_tree():
    assert torch.equal(tree_attention_mask(chain_parents(4)), torch.ones(4, 4).tril().bool())


def test_static_tree_from_medusa_choices():
    parents, heads, ranks = static_tree(((1, 0), (0,), (0, 1), (1,), (0, 0)))
    assert parents == TWO_LEVEL[:3] + [1, 1, 2]
    assert heads == [-1, 0, 0, 1, 1, 1] and ranks == [-1, 0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="lacks its parent"):
        static_tree(((0,), (1, 0)))


def test_expand_frontier_keeps_best_cumulative_scores():
    scores = torch.tensor([-0.1, -2.0])
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]))
    ids, cand, best = expand_frontier(scores, logp, topk=2)
    assert ids.tolist()[:3] == [0, 1, 0]
    torch.testing.assert_close(cand[:2], scores[0] + logp[0, :2])
    assert sorted(best.tolist()) == [0, 1]  # both children of the strong parent win


def test_select_nodes_keeps_ancestors_even_on_ties():
    # candidates 0,1 children of the root; 2,3 children of 0; 4 child of 2 with a tie.
    scores = torch.tensor([-1.0, -5.0, -1.0, -3.0, -1.0])
    keep, parents = select_nodes(scores, [-1, -1, 0, 0, 2], total=3)
    assert keep == [0, 2, 4] and parents == [-1, 0, 1, 2]


def test_warp_temperature_and_top_p_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(warp(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(warp(logits, 1.0, top_p=0.8), torch.tensor([0.625, 0.375, 0, 0]))
    torch.testing.assert_close(warp(logits, 1.0, top_p=0.81).sum(), torch.tensor(1.0))
    assert warp(logits, 1.0, top_p=0.81)[2] > 0
    hot = warp(logits, 2.0)
    assert hot[0] < 0.5 and hot[3] > 0.05


def test_greedy_chain_acceptance_by_hand():
    target = torch.tensor([5, 6, 7, 8])
    assert greedy_accept_chain(torch.tensor([5, 6, 7]), target) == (3, 8)
    assert greedy_accept_chain(torch.tensor([5, 9, 7]), target) == (1, 6)
    assert greedy_accept_chain(torch.tensor([1, 6, 7]), target) == (0, 5)


def test_greedy_tree_acceptance_follows_the_matching_branch():
    tokens = torch.tensor([0, 11, 12, 21, 22, 23])
    # target argmax at each node: root wants 12, node 2 wants 23, node 5 wants 40.
    argmax = torch.tensor([12, 22, 23, 0, 0, 40])
    assert greedy_accept_tree(tokens, TWO_LEVEL, argmax) == ([0, 2, 5], 40)
    argmax[0] = 99
    assert greedy_accept_tree(tokens, TWO_LEVEL, argmax) == ([0], 99)


def _dist(v: int, seed: int, sharp: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(v, generator=g), -1)


@pytest.mark.parametrize("draft_kind", ["sampled", "point_mass"])
def test_chain_rejection_sampling_reproduces_the_target_distribution(draft_kind):
    v, draws = 6, 6000
    p = torch.stack([_dist(v, 1), _dist(v, 2)])
    q = _dist(v, 3, sharp=3.0)[None]
    g = torch.Generator().manual_seed(0)
    first = torch.zeros(v)
    second_after = torch.zeros(v)  # second emitted token when the first was the draft
    drafted = torch.zeros(v)
    for _ in range(draws):
        if draft_kind == "sampled":
            d = torch.multinomial(q[0], 1, generator=g)
            n, nxt = rejection_sample_chain(d, p, q, g)
        else:
            d = torch.tensor([int(q[0].argmax())])
            n, nxt = rejection_sample_chain(d, p, None, g)
        emitted = d[:n].tolist() + [nxt]
        drafted[d[0]] += 1
        first[emitted[0]] += 1
        if n == 1:
            second_after[emitted[1]] += 1
    assert chi_square_pvalue(first, p[0]) > 1e-3
    assert chi_square_pvalue(second_after, p[1]) > 1e-3
    assert chi_square_pvalue(drafted, p[0]) < 1e-6  # the test has power: raw drafts fail it


def test_tree_recursive_rejection_reproduces_the_target_distribution():
    v, draws = 6, 6000
    p = torch.stack([_dist(v, s) for s in range(6)])
    # Drafted children are each parent's most likely tokens (what a good drafter proposes).
    top0, top1 = p[0].topk(2).indices.tolist(), p[1].topk(2).indices.tolist()
    tokens = torch.tensor([0, *top0, *top1, int(p[2].argmax())])
    g = torch.Generator().manual_seed(1)
    first, after_1 = torch.zeros(v), torch.zeros(v)
    for _ in range(draws):
        path, nxt = rejection_sample_tree(tokens, TWO_LEVEL, p, g)
        emitted = tokens[path[1:]].tolist() + [nxt]
        first[emitted[0]] += 1
        if len(path) > 1 and path[1] == 1:
            after_1[emitted[1]] += 1  # below node 1 the law is p[1]
    assert chi_square_pvalue(first, p[0]) > 1e-3
    assert chi_square_pvalue(after_1, p[1]) > 1e-3
