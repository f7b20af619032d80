"""Token trees for speculative decoding: masks, positions, static and dynamic tree shapes.

A tree is a list `parents` over its nodes in topological order: node 0 is the root (the last
verified token, parent -1), every other node's parent has a smaller index. One target forward
verifies all nodes at once; each node sees the cached prefix, its ancestors and itself, and sits
at position `prefix_len + depth`. Keeping the shape in a plain list makes every rule here a pure
function that a test can check by hand.
"""

from __future__ import annotations

import torch

# Medusa-style static tree for 4 heads: each path lists, per head, the rank of the token taken
# from that head's top-k. Small on purpose (16 nodes): on a CPU every verified token costs time.
DEFAULT_MEDUSA_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1),
)  # fmt: skip


def chain_parents(n: int) -> list[int]:
    """A chain of n nodes (root included) as a tree."""
    return list(range(-1, n - 1))


def tree_depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """bool [n, n]: row i may attend to column j iff j is i or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def tree_position_ids(parents: list[int], start: int) -> torch.Tensor:
    """long [n]: each node's position in the sequence, `start` being the root's."""
    return torch.tensor(tree_depths(parents), dtype=torch.long) + start


def with_prefix(local: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[T, T] mask among new tokens -> [1, 1, T, prefix_len + T]: the cached prefix is visible."""
    seen = torch.ones(local.shape[0], prefix_len, dtype=torch.bool, device=local.device)
    return torch.cat([seen, local], dim=1)[None, None]


def children_of(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def static_tree(choices: tuple[tuple[int, ...], ...]) -> tuple[list[int], list[int], list[int]]:
    """Medusa choice paths -> (parents, head of each node, rank of each node), root first.

    Node for path (r1..rd) takes rank rd of head d-1's top-k; its parent is the path (r1..rd-1).
    """
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    index = {(): 0}
    parents, heads, ranks = [-1], [-1], [-1]
    for path in paths:
        if not path or path[:-1] not in index:
            raise ValueError(f"tree choice {list(path)} lacks its parent {list(path[:-1])}")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        heads.append(len(path) - 1)
        ranks.append(path[-1])
    return parents, heads, ranks


def expand_frontier(
    frontier_scores: torch.Tensor, child_logprobs: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One EAGLE-2 level: every frontier node proposes its top-k children, scored by cumulative
    log-prob; the best `topk` of all of them form the next frontier.

    frontier_scores [F], child_logprobs [F, V] -> (candidate ids [F*k], candidate scores [F*k],
    positions of the next frontier inside the candidates [topk]). Candidate c's parent is the
    frontier slot c // k.
    """
    top = child_logprobs.topk(topk, dim=-1)
    scores = (frontier_scores[:, None] + top.values).flatten()
    best = scores.topk(min(topk, scores.numel())).indices
    return top.indices.flatten(), scores, best


def select_nodes(scores: torch.Tensor, cand_parents: list[int], total: int) -> tuple[list[int], list[int]]:
    """The `total` best candidates by score -> (kept candidate ids, tree parents with the root).

    cand_parents: each candidate's parent candidate, -1 for a child of the root. Candidates come
    in level order and a child never scores above its parent, so a stable sort ranks every
    parent before its children and the top slice keeps whole paths.
    """
    keep = sorted(torch.sort(scores, descending=True, stable=True).indices[:total].tolist())
    node_of = {c: i + 1 for i, c in enumerate(keep)}
    parents = [-1] + [0 if cand_parents[c] < 0 else node_of[cand_parents[c]] for c in keep]
    return keep, parents
