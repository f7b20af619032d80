"""The decoding loop: draft, verify with one target forward, keep what the rule accepts.

Batch 1, any transformers causal LM. The same `TargetKV` serves speculative decoding and the
plain greedy baseline (`baselines.py`), so their speed is compared on equal code.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from trainer.decoding.drafters import Chain, Draft, Shape, draft_size
from trainer.decoding.kv_cache import TargetKV
from trainer.decoding.tree import tree_depths
from trainer.decoding.verify import (
    GREEDY,
    Sampling,
    greedy_accept_chain,
    greedy_accept_tree,
    rejection_sample_chain,
    rejection_sample_tree,
)


@dataclass(frozen=True)
class Step:
    """One speculative step of a chain: its draft's top probability at each drafted position
    (`Draft.confidence`) and how many of them the target kept: enough to tell what a shorter
    chain or a higher p_min would have drafted and kept at this step."""

    confidence: tuple[float, ...]
    accepted: int


@dataclass
class DecodeStats:
    """Per request. `drafts` counts verify steps (vLLM's num_drafts; with `Chain.p_min` a step may
    carry no draft and still counts, so the mean acceptance length stays tokens per target
    forward); `accepted_per_position[j]` counts steps whose (j+1)-th draft (tree depth j+1) was
    kept. Time per step splits into `draft_s` (the drafter's forwards), `verify_s` (the target's
    forward over the root and its drafts) and `other_s` (the rest: acceptance, the caches' keep,
    the drafter's commit); each is read at step granularity (on CUDA after a synchronize, which
    the loop's host reads of argmax need anyway). A greedy baseline's `verify_s` is its decode
    time after the prefill, one forward per token."""

    new_tokens: int = 0
    target_forwards: int = 0  # prefill included
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0
    steps: list[Step] = field(default_factory=list)  # chains only (`Step`)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify forward counting the bonus token: 1 + accepted / drafts."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0


def pooled_per_position(stats: Iterable[DecodeStats]) -> list[int]:
    """The steps that kept each draft position, summed over requests (a request that drafted
    shallower counts 0 past its depth): the evaluator's per-task acceptance and decoded
    validation's standard error pool them so."""
    return [sum(col) for col in itertools.zip_longest(*(s.accepted_per_position for s in stats), fillvalue=0)]


@dataclass
class Generation:
    tokens: list[int]
    stats: DecodeStats


DEFAULT_SHAPE = Chain(3)


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def extend(out: list[int], new: list[int], max_new_tokens: int, eos_ids: set[int]) -> bool:
    """Append `new` up to the first EOS (kept) or the budget; True once generation is over."""
    for t in new:
        if len(out) >= max_new_tokens:
            return True
        out.append(t)
        if t in eos_ids:
            return True
    return len(out) >= max_new_tokens


def _accept(
    draft: Draft, tokens: torch.Tensor, logits: torch.Tensor, sampling: Sampling
) -> tuple[list[int], int]:
    """-> (indices of the verified chunk that are kept, root first; the next token)."""
    if draft.parents is not None:
        if sampling.greedy:
            return greedy_accept_tree(tokens, draft.parents, logits.argmax(-1).cpu())
        return rejection_sample_tree(tokens, draft.parents, sampling.probs(logits), sampling.generator)
    if sampling.greedy:
        n, nxt = greedy_accept_chain(draft.tokens, logits.argmax(-1).cpu())
    else:
        n, nxt = rejection_sample_chain(draft.tokens, sampling.probs(logits), draft.q, sampling.generator)
    return list(range(n + 1)), nxt


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    shape: Shape = DEFAULT_SHAPE,
    sampling: Sampling = GREEDY,
    eos_ids: tuple[int, ...] | set[int] = (),
) -> Generation:
    """Generate up to `max_new_tokens` after `input_ids` [T] (or [1, T]) with `drafter`.

    Greedy output (the default) equals plain greedy decoding token for token; sampled output is
    distributed exactly as sampling the target with the same temperature and top-p.
    """
    prompt = input_ids.reshape(-1).cpu()
    eos, stats = set(eos_ids), DecodeStats()
    kv = TargetKV(target, drafter.hidden_layers, room=prompt.numel() + max_new_tokens + draft_size(shape))
    start = clock(kv.device)
    logits, hidden = kv.prefill(prompt)
    first = sampling.pick(logits[-1])[0]
    drafter.start(prompt, hidden, first)
    stats.prefill_s = clock(kv.device) - start
    stats.target_forwards = 1
    out: list[int] = []
    done = extend(out, [first], max_new_tokens, eos)
    while not done:
        t0 = clock(kv.device)
        draft = drafter.propose(shape, sampling.drafting)
        t1 = clock(kv.device)
        chunk = torch.cat([torch.tensor(out[-1:]), draft.tokens])
        logits, hidden = kv.forward(chunk, draft.parents)
        t2 = clock(kv.device)
        path, nxt = _accept(draft, chunk, logits, sampling)
        kv.keep(path)
        done = extend(out, chunk[path[1:]].tolist() + [nxt], max_new_tokens, eos)
        if not done:
            drafter.commit(chunk[path], [h[path] for h in hidden], nxt)
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.other_s += clock(kv.device) - t2
        stats.target_forwards += 1
        stats.drafts += 1
        stats.drafted_tokens += draft.tokens.numel()
        stats.accepted_tokens += len(path) - 1
        _count_positions(stats.accepted_per_position, len(path) - 1, draft)
        if draft.confidence is not None:
            stats.steps.append(Step(tuple(draft.confidence), len(path) - 1))
    stats.total_s = clock(kv.device) - start
    stats.new_tokens = len(out)
    return Generation(out, stats)


def _count_positions(counts: list[int], accepted: int, draft: Draft) -> None:
    depth = draft.tokens.numel() if draft.parents is None else max(tree_depths(draft.parents))
    counts.extend([0] * (depth - len(counts)))
    for j in range(accepted):
        counts[j] += 1
