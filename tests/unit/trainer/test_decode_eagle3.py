"""EAGLE-3 drafting: the head's own KV cache holds exactly the verified positions, whatever was
drafted and accepted, and every node of the EAGLE-2 dynamic tree is a top-k child of the head run
along its own path (so the tree mask and positions inside the head are right)."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode import (
    chaotic_target,
    path_to,
    random_eagle3_head,
    single_thread,  # noqa: F401 (fixture)
)
from trainer.decoding import Chain, Eagle3Drafter, Tree
from trainer.decoding.tree import tree_depths
from trainer.decoding.verify import Sampling

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return chaotic_target("llama")


def position_sensitive_head(target, **kw):
    """A random head whose output leans on attention (large q/k/o), so that a wrong mask or
    position changes its top-k instead of hiding behind the residual stream."""
    head = random_eagle3_head(target, **kw)
    attn = head.midlayer.self_attn
    for proj, scale in ((attn.q_proj, 4.0), (attn.k_proj, 4.0), (attn.o_proj, 20.0)):
        proj.weight.data.mul_(scale)
    return head


def features(target, head, seq: torch.Tensor) -> list[torch.Tensor]:
    hs = target(seq[None], output_hidden_states=True).hidden_states
    return [hs[i][0] for i in head.aux_layer_ids]


def from_scratch(target, head, seq: torch.Tensor, nxt: int):
    """Step 0 over the whole verified sequence at once, no cache: (hidden, logits, K/V)."""
    following = torch.cat([seq[1:], torch.tensor([nxt])])
    fused = head.fuse(torch.cat(features(target, head, seq), -1))[None]
    return head.step(fused, following[None], torch.arange(seq.numel())[None])


def chain_logits(head, hidden, kv, start: int, tokens: list[int]) -> torch.Tensor:
    """Draft logits after feeding `tokens` one by one from the pre-norm `hidden`, no tree."""
    past, logits = kv, None
    for j, tok in enumerate(tokens):
        hidden, logits, new = head.step(hidden, torch.tensor([[tok]]), torch.tensor([[start + j]]),
                                        None, past)
        past = (torch.cat([past[0], new[0]], 2), torch.cat([past[1], new[1]], 2))
    return logits[0, -1]


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
