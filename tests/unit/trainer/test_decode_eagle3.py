"""EAGLE-3 drafting: the head's own KV cache holds exactly the verified positions, whatever was
drafted and accepted, and every node of the EAGLE-2 dynamic tree is a top-k child of the head run
along its own path (so the tree mask and positions inside the head are right)."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode import (
    chain_logits,
    chaotic_target,
    features,
    from_scratch,
    path_to,
    position_sensitive_head,
)
from trainer.decoding import Chain, Eagle3Drafter, Tree
from trainer.decoding.tree import tree_depths
from trainer.decoding.verify import Sampling

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return chaotic_target("llama")


@torch.no_grad()
def test_head_cache_holds_only_verified_positions(target):
    head = position_sensitive_head(target, draft_vocab=64)
    drafter = Eagle3Drafter(head)
    g = torch.Generator().manual_seed(0)
    seq, nxt = torch.randint(0, 256, (9,), generator=g), 5
    drafter.start(seq, features(target, head, seq), nxt)
    tree = Tree(total_tokens=8, depth=3, topk=2)
    for accepted, shape in [(2, Chain(3)), (0, tree), (3, Chain(3)), (1, tree), (0, Chain(2))]:
        drafter.propose(shape, Sampling())
        chunk = torch.cat([torch.tensor([nxt]), torch.randint(0, 256, (accepted,), generator=g)])
        seq = torch.cat([seq, chunk])
        hidden = [h[-chunk.numel() :] for h in features(target, head, seq)]
        nxt = int(torch.randint(0, 256, (), generator=g))
        drafter.commit(chunk, hidden, nxt)
    draft = drafter.propose(Chain(1), Sampling())
    _, logits, (k, v) = from_scratch(target, head, seq, nxt)
    n = drafter.length
    torch.testing.assert_close(drafter.cache.keys[0][:, :, :n], k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(drafter.cache.values[0][:, :, :n], v, atol=1e-5, rtol=1e-4)
    assert draft.tokens.tolist() == [int(head.to_target_ids(logits[0, -1].argmax()))]
    assert draft.tokens[0] % 2 == 0  # reduced vocabulary: even target ids only


@torch.no_grad()
def test_dynamic_tree_nodes_are_topk_children_along_their_path(target):
    head = position_sensitive_head(target)
    drafter = Eagle3Drafter(head)
    seq, nxt = torch.arange(3, 14), 7
    drafter.start(seq, features(target, head, seq), nxt)
    shape = Tree(total_tokens=12, depth=3, topk=3)
    draft = drafter.propose(shape, Sampling())
    parents = draft.parents
    assert len(parents) == 13 and draft.tokens.numel() == 12
    assert all(0 <= parents[i] < i for i in range(1, 13)) and max(tree_depths(parents)) <= 3
    hidden, logits, kv = from_scratch(target, head, seq, nxt)
    root_hidden = hidden[:, -1:]
    tokens = [nxt, *draft.tokens.tolist()]
    for node in range(1, 13):
        ancestors = [tokens[i] for i in path_to(parents, node)[1:-1]]
        step_logits = chain_logits(head, root_hidden, kv, seq.numel(), ancestors) if ancestors \
            else logits[0, -1]
        assert tokens[node] in step_logits.topk(shape.topk).indices.tolist()
    siblings = {}
    for node in range(1, 13):
        siblings.setdefault(parents[node], []).append(tokens[node])
    assert all(len(set(s)) == len(s) for s in siblings.values())


@torch.no_grad()
def test_a_draft_window_drafts_what_the_window_alone_drafts(target):
    """`eval.sliding_window`: RoPE scores depend on distance alone and the head has one layer, so
    the first draft over the last W positions equals the draft computed from those W positions'
    features alone; a window the prompt fits in changes nothing, and a short one changes it."""
    head = position_sensitive_head(target)
    g = torch.Generator().manual_seed(1)
    seq, nxt, w = torch.randint(0, 256, (40,), generator=g), 5, 16

    def first_logits(window: int | None) -> torch.Tensor:
        drafter = Eagle3Drafter(head)
        drafter.window = window
        drafter.start(seq, features(target, head, seq), nxt)
        return drafter._catch_up()[1]

    following = torch.cat([seq[1:], torch.tensor([nxt])])[-w:]
    fused = head.fuse(torch.cat(features(target, head, seq), -1)[-w:])[None]
    _, alone, _ = head.step(fused, following[None], torch.arange(w)[None])
    torch.testing.assert_close(first_logits(w), alone[0, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first_logits(seq.numel()), first_logits(None))
    assert not torch.allclose(first_logits(w), first_logits(None), atol=1e-2)
