"""Acceptance rules: which drafted tokens the target keeps, and the token it adds.

Pure functions over the target's logits/probabilities of one verify step, so the two promises
(greedy output == plain greedy, sampled output ~ the target's distribution) are tested on them
directly. Sampling follows the standard rejection rule (Leviathan et al., Chen et al.): accept a
draft x with probability min(1, p(x)/q(x)), on rejection sample from norm(max(p - q, 0)). A draft
chosen deterministically (argmax, top-k of a tree) has q = a point mass on x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.decoding.tree import children_of


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Logits [..., V] -> sampling probabilities after temperature and nucleus (top-p) filtering.

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (as transformers'
    TopPLogitsWarper), then renormalises.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def _rng_device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draws on the generator's device: a CPU generator keeps GPU runs reproducible too."""
    return int(torch.multinomial(probs.to(_rng_device(generator)), 1, generator=generator))


def greedy_accept_chain(draft: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """draft [k], target_argmax [k+1] -> (accepted count, next token).

    Keep the longest prefix of the draft equal to the target's argmax; the next token is the
    target's argmax after it (the bonus token when everything was accepted).
    """
    k = draft.numel()
    accepted = int((draft == target_argmax[:k]).long().cumprod(0).sum())
    return accepted, int(target_argmax[accepted])


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, device=_rng_device(generator)))


def _residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(p - q, 0)); q None = point mass on `token`."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    # Unreachable in exact arithmetic (a rejection implies p(x) < q(x), so mass remains); guard
    # against rounding by falling back to p itself.
    return r / total if total > 0 else p


def rejection_sample_chain(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """draft [k], target probs p [k+1, V], draft probs q [k, V] (None: point masses)
    -> (accepted count, next token): the output is distributed exactly as sampling from p."""
    tokens = draft.tolist()
    for j, x in enumerate(tokens):
        qx = 1.0 if q is None else float(q[j, x])
        px = float(p[j, x])
        if _uniform(generator) * qx < px:
            continue
        return j, sample(_residual(p[j], None if q is None else q[j], x), generator)
    return len(tokens), sample(p[len(tokens)], generator)


def greedy_accept_tree(
    tokens: torch.Tensor, parents: list[int], target_argmax: torch.Tensor
) -> tuple[list[int], int]:
    """tokens [n] (root first), target_argmax [n] -> (accepted path of node ids from the root,
    next token). Siblings hold distinct tokens, so at most one child matches at each level."""
    kids = children_of(parents)
    wanted = target_argmax.tolist()
    toks = tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        match = next((c for c in kids[node] if toks[c] == wanted[node]), None)
        if match is None:
            return path, wanted[node]
        path.append(match)


def rejection_sample_tree(
    tokens: torch.Tensor,
    parents: list[int],
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Recursive rejection over siblings (SpecInfer, EAGLE) for deterministically chosen children.

    At a node with target probs p, try its children in order: child x is accepted with the
    current p(x); on rejection p(x) is zeroed and p renormalised before the next sibling. If all
    are rejected, sample from what is left. Each try is a rejection step with a point-mass
    proposal, so the emitted token is distributed exactly as p.
    """
    kids = children_of(parents)
    toks = tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        dist = p[node]
        for child in kids[node]:
            x = toks[child]
            if _uniform(generator) < float(dist[x]):
                path.append(child)
                break
            dist = _residual(dist, None, x)
        else:
            return path, sample(dist, generator)


@dataclass(frozen=True)
class Sampling:
    """How a decode chooses tokens, in one object so that every caller says it the same way:
    greedy when `temperature` is 0, else sampling after temperature and top-p, drawn with
    `generator` (None: torch's global one). When sampling, drafts are the drafter's argmax (as
    vLLM drafts, so acceptance figures compare) unless `draft_sampling`: then chain drafts are
    sampled from the drafter's own warped distribution q and accepted with min(1, p/q)."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    draft_sampling: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def drafting(self) -> Sampling:
        """How drafters choose their tokens under this sampling."""
        return self if self.draft_sampling else GREEDY

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> the probabilities tokens are sampled from."""
        return warp(logits, self.temperature, self.top_p)

    def pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """logits [V] -> (token, the probabilities it was drawn from; None when greedy)."""
        if self.greedy:
            return int(logits.argmax()), None
        probs = self.probs(logits)
        return sample(probs, self.generator), probs


GREEDY = Sampling()
