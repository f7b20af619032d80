"""Drafters: who proposes the tokens the target verifies.

Every drafter follows one protocol, so the decoding loop never knows which it drives:
- `hidden_layers`: the target `hidden_states` indices it needs for verified positions;
- `start(prompt, hidden, next_token)` and `commit(tokens, hidden, next_token)`: the target has
  verified these tokens (hidden: their features) and chosen `next_token`, not yet run;
- `propose(shape, sampling) -> Draft`: a chain or a tree hanging below `next_token`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conf.errors import UserError
from heads.window import window_of
from trainer.decoding.graphs import StepGraphs
from trainer.decoding.kv_cache import StaticCache, capacity_for, causal
from trainer.decoding.tree import (
    DEFAULT_MEDUSA_CHOICES,
    chain_parents,
    expand_frontier,
    select_nodes,
    static_tree,
)
from trainer.decoding.verify import Sampling


@dataclass(frozen=True)
class Chain:
    """A chain of up to `k` drafted tokens (vLLM's num_speculative_tokens), cut before the first
    position whose draft distribution's top probability is below `p_min` (llama.cpp's
    `--draft-p-min`; 0: always `k`): a draft unsure of its next token is mostly rejected, and
    verifying it costs more than it saves. A cut chain may hold no token: that step is a plain
    target forward. Greedy output is the target's whatever the cut (the target decides every
    token)."""

    k: int = 3
    p_min: float = 0.0


@dataclass(frozen=True)
class Tree:
    """A draft tree. EAGLE drafters grow it dynamically (EAGLE-2: expand the `topk` best nodes by
    cumulative log-prob for `depth` levels, keep the `total_tokens` best); Medusa drafters use the
    static `choices` paths."""

    total_tokens: int = 16
    depth: int = 4
    topk: int = 4
    choices: tuple[tuple[int, ...], ...] = DEFAULT_MEDUSA_CHOICES


Shape = Chain | Tree


def draft_size(shape: Shape) -> int:
    """The most tokens a draft of `shape` holds, whichever drafter grows it."""
    if isinstance(shape, Chain):
        return shape.k
    return max(shape.total_tokens, len(static_tree(shape.choices)[0]) - 1, shape.depth)


@dataclass
class Draft:
    """tokens [n]: target ids of the drafted nodes (the root, `next_token`, excluded).
    parents: None for a chain, else the tree's parent list with the root as node 0 (len n+1).
    q [n, V]: target-vocab probabilities each token was sampled from; None = chosen
    deterministically (a point mass for the rejection rule)."""

    tokens: torch.Tensor
    parents: list[int] | None = None
    q: torch.Tensor | None = None
    # A chain's: the draft's top probability at each drafted position (what `Chain.p_min` is
    # compared with), so the evaluator can tell what a higher p_min or a shorter chain would
    # have drafted (`trainer.evaluate.settings`). None for trees.
    confidence: list[float] | None = None


def stack_probs(qs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """A chain's `Draft.q` from its tokens' probabilities (None: drafted deterministically, or no
    token drafted)."""
    return None if not qs or qs[0] is None else torch.stack(qs)


def top_probs(logits: torch.Tensor) -> list[float]:
    """Draft logits [..., V] -> the probability of the likeliest token at each row (softmax at
    temperature 1, as llama.cpp's draft sampler compares with `--draft-p-min`), read to the host
    in one copy."""
    return torch.softmax(logits.float(), -1).amax(-1).reshape(-1).tolist()


def confident_prefix(confidence: list[float], p_min: float) -> int:
    """How many leading positions reach `p_min`: the chain stops at the first that does not."""
    return next((j for j, p in enumerate(confidence) if p < p_min), len(confidence))


def one_forward_chain(rows: torch.Tensor, p_min: float, pick) -> Draft:
    """A chain from the per-position draft logits `rows` [k, V] of one head forward (Medusa's
    heads, P-EAGLE's and DFlash's slots): each position's token by `pick` (row -> (target id, the
    probabilities it was drawn from or None)), cut before the first below `p_min`."""
    confidence = top_probs(rows)
    n = confident_prefix(confidence, p_min)
    picks = [pick(row) for row in rows[:n]]
    tokens = torch.tensor([t for t, _ in picks], dtype=torch.long)
    return Draft(tokens, None, stack_probs([q for _, q in picks]), confidence[:n])


class Eagle3Drafter:
    """EAGLE-3: step 0 reads the fused target features of the newly verified tokens, later steps
    feed the head's own hidden back (normed when the head has norm_output). The head's KV cache
    holds only verified positions: after each verify step the drafted entries are dropped and
    step 0 re-runs on the verified tokens with their real target features (as vLLM does).

    The cache is static (`kv_cache.StaticCache`): drafted entries are written after the `length`
    committed ones and dropped by leaving `length` alone. It and the step graphs outlive a
    request, so a drafter decodes one request at a time."""

    def __init__(self, head):
        self.head = head
        self.hidden_layers = list(head.aux_layer_ids)
        self.vocab_size = head.config.vocab_size
        self.draft_ids = head.draft_token_ids()
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        self.cache = StaticCache()
        self.graphs = StepGraphs(self.device)
        self.length = 0
        self.window = window_of(head.config)  # draft attention over the last `window` positions

    def start(self, prompt: torch.Tensor, hidden: list[torch.Tensor], next_token: int) -> None:
        self.length = 0
        self.commit(prompt, hidden, next_token)

    def commit(self, tokens: torch.Tensor, hidden: list[torch.Tensor], next_token: int) -> None:
        # Position t pairs the target feature of token t with token t+1.
        following = torch.cat([tokens[1:].to(self.device), self._ids(next_token)])
        feats = torch.cat(hidden, dim=-1).to(self.device, self.dtype)
        self.pending = (self.head.fuse(feats)[None], following[None])

    def _ids(self, token: int) -> torch.Tensor:
        return torch.tensor([token], device=self.device)

    def _step(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        positions: torch.Tensor,
        local: torch.Tensor,
        graphed: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over T new positions -> (hidden to feed back [1,T,H], logits [1,T,Vd]).
        They see the committed prefix and, as `local` [T, n] says, the n slots after it, the last
        T of which are their own (the n - T before are this draft's earlier steps)."""
        t, n = ids.shape[1], local.shape[1]
        first = self.length + n - t
        if self.cache.reserve(capacity_for(first + t, self.graphs.enabled), keep=first):
            self.graphs.clear()
        mask = self.cache.mask(local, self.length, self.dtype, self.window, positions)
        inputs = [x.to(self.device) for x in (hidden, ids, positions, mask, torch.arange(first, first + t))]
        return self.graphs("step", self._forward, *inputs) if graphed else self._forward(*inputs)

    def _forward(self, hidden, ids, positions, mask, slots):
        """What a graph records: one `head.step` writing its K/V at `slots`."""
        self.cache.slots = slots
        out, logits, _ = self.head.step(hidden, ids, positions, mask, self.cache)
        return out, logits

    def _catch_up(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Step 0 over the pending verified positions -> (last fed-back hidden [1,1,H], its
        draft logits [Vd], position of the first drafted token). The prompt's runs eagerly: its
        length is the request's own."""
        feats, ids = self.pending
        t = ids.shape[1]
        pos = torch.arange(self.length, self.length + t, device=self.device)[None]
        out, logits = self._step(feats, ids, pos, causal(t, self.device), graphed=self.length > 0)
        self.length += t
        return out[:, -1:], logits[0, -1], self.length

    def _pick(self, logits: torch.Tensor, sampling: Sampling) -> tuple[int, torch.Tensor | None]:
        draft, probs = sampling.pick(logits)
        if probs is None:
            return int(self.draft_ids[draft]), None
        q = torch.zeros(self.vocab_size, device=probs.device)
        q[self.draft_ids] = probs
        return int(self.draft_ids[draft]), q

    @torch.no_grad()
    def propose(self, shape: Shape, sampling: Sampling) -> Draft:
        hidden, logits, pos = self._catch_up()
        if isinstance(shape, Tree):
            return self._tree(shape, hidden, logits, pos)
        tokens, qs, confidence = [], [], []
        for j in range(shape.k):
            top = top_probs(logits)[0]
            if top < shape.p_min:  # stop before drafting it: the later head steps are saved too
                break
            token, q = self._pick(logits, sampling)
            tokens.append(token)
            qs.append(q)
            confidence.append(top)
            if j + 1 < shape.k:
                position = torch.tensor([[pos + j]], device=self.device)
                seen = torch.ones(1, j + 1, dtype=torch.bool, device=self.device)
                hidden, step_logits = self._step(hidden, self._ids(token)[None], position, seen)
                logits = step_logits[0, -1]
        return Draft(torch.tensor(tokens, dtype=torch.long), None, stack_probs(qs), confidence)

    def _tree(self, shape: Tree, hidden: torch.Tensor, logits: torch.Tensor, pos: int) -> Draft:
        k = shape.topk
        top = torch.log_softmax(logits.float(), -1).topk(k)
        cand_ids, cand_scores = [top.indices], [top.values]
        cand_parents = [torch.full((k,), -1, device=self.device)]
        frontier, scores, ids = torch.arange(k, device=self.device), top.values, top.indices
        hidden = hidden.expand(1, k, -1)
        ancestors = torch.eye(k, dtype=torch.bool, device=self.device)
        n_cand = k
        for level in range(1, shape.depth):
            position = torch.full((1, k), pos + level - 1, device=self.device)
            out, step_logits = self._step(hidden, self.draft_ids[ids][None], position, ancestors)
            child_logp = torch.log_softmax(step_logits[0].float(), -1)
            new_ids, new_scores, best = expand_frontier(scores, child_logp, k)
            cand_ids.append(new_ids)
            cand_scores.append(new_scores)
            cand_parents.append(frontier.repeat_interleave(k))
            slot = best // k
            frontier, scores, ids = n_cand + best, new_scores[best], new_ids[best]
            hidden = out[:, slot]
            eye = torch.eye(len(best), dtype=torch.bool, device=self.device)
            ancestors = torch.cat([ancestors[slot], eye], dim=1)
            n_cand += new_ids.numel()
        keep, parents = select_nodes(
            torch.cat(cand_scores), torch.cat(cand_parents).tolist(), shape.total_tokens
        )
        return Draft(self.draft_ids[torch.cat(cand_ids)[keep]].cpu(), parents, None)


class MedusaDrafter:
    """Medusa: every head reads the last verified position's final (post-norm) hidden state at
    once; head j proposes the token j+2 positions after it (j+1 after `next_token`)."""

    def __init__(self, head, num_target_layers: int):
        self.head = head
        self.hidden_layers = [num_target_layers]  # HF hidden_states[N]: after the final norm
        self.weight = next(head.parameters())
        self.graphs = StepGraphs(self.weight.device)

    def start(self, prompt: torch.Tensor, hidden: list[torch.Tensor], next_token: int) -> None:
        self.commit(prompt, hidden, next_token)

    def commit(self, tokens: torch.Tensor, hidden: list[torch.Tensor], next_token: int) -> None:
        self.last = hidden[0][-1:]

    def check(self, shape: Shape) -> None:
        """Refuse a shape that asks for more heads than the head has."""
        need = shape.k if isinstance(shape, Chain) else max(len(c) for c in shape.choices)
        if need > self.head.num_heads:
            what = "eval.num_speculative_tokens" if isinstance(shape, Chain) else "eval.tree"
            raise UserError(f"{what} needs {need} Medusa heads; the head has {self.head.num_heads}")

    @torch.no_grad()
    def propose(self, shape: Shape, sampling: Sampling) -> Draft:
        last = self.last.to(self.weight.device, self.weight.dtype)[None]
        logits = self.graphs("heads", self.head, last)[:, 0, -1]
        if isinstance(shape, Tree):
            parents, heads, ranks = static_tree(shape.choices)
            top = logits.topk(max(ranks) + 1, dim=-1).indices
            return Draft(top[heads[1:], ranks[1:]].cpu(), parents, None)
        return one_forward_chain(logits[: shape.k], shape.p_min, sampling.pick)


class OracleDrafter:
    """The target drafting for itself, for tests: `shift=0` proposes exactly what the target
    would choose, `shift=1` the token after its argmax (always wrong in greedy mode). A tree
    shape gets a chain of `depth` tokens, sent through tree verification."""

    hidden_layers: list[int] = []

    def __init__(self, model, shift: int = 0):
        self.model, self.shift = model, shift

    def start(self, prompt: torch.Tensor, hidden: list[torch.Tensor], next_token: int) -> None:
        self.seq = torch.cat([prompt, torch.tensor([next_token])])

    def commit(self, tokens: torch.Tensor, hidden: list[torch.Tensor], next_token: int) -> None:
        self.seq = torch.cat([self.seq, tokens[1:], torch.tensor([next_token])])

    @torch.no_grad()
    def propose(self, shape: Shape, sampling: Sampling) -> Draft:
        n = shape.k if isinstance(shape, Chain) else shape.depth
        seq, qs = self.seq, []
        for _ in range(n):
            logits = self.model(seq[None]).logits[0, -1]
            if self.shift:
                token, q = (int(logits.argmax()) + self.shift) % logits.numel(), None
            else:
                token, q = sampling.pick(logits)
            seq = torch.cat([seq, torch.tensor([token])])
            qs.append(q)
        tokens = seq[self.seq.numel() :]
        if isinstance(shape, Tree):
            return Draft(tokens, chain_parents(n + 1), None)
        return Draft(tokens, None, stack_probs(qs))
