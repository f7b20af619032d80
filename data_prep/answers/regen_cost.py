"""What a regeneration will take before it runs: the engine's step cost, fitted from the steps of
a small regeneration, and the engine's schedule replayed for the prompts to come.

A decode step of `regen_engine` costs about `a + b * rows + c * context`: a fixed part (per-op
overhead, reading the weights), a part per row (the GEMMs' rows, the lm_head, the draw) and a
part per cached token the rows attend to (the decode kernel streams each row's cache). A prefill
forward costs `a + d * prompt tokens`. So the engine's tokens per second depend on the run's
shape, not only on the machine: a batch thins at the end of every regeneration and pays `a` for
few rows, a long run refills freed slots a few prompts at a time, and long answers pay `c` on
ever longer contexts. The planner's probe answers one batch, the run one and a half or forty:
at the probe's rate, the plan's regeneration was 24% short on a 2-core EPYC (542 tokens/s
probed, 412 in the run).

The tokens and the context a set of prompts decodes are sums over its prompts, the same in any
schedule; only the number of decode steps and of prefill forwards depends on the schedule, and
`engine_schedule` replays it: prompts longest first, each into the first slot to free.
`StepCost.fit` takes a, b and c by least squares over the probe's timed steps (no coefficient
below zero), d from its prefills.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from dataclasses import dataclass

import torch

from data_prep.answers.regen_engine import PREFILL_TOKENS, EngineTimings, engine_shares, prefill_group


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine's decode step (`per_step + per_row * rows + per_context * context`)
    and of its prefills (`per_prompt_token` per prompt token)."""

    per_step: float
    per_row: float
    per_context: float
    per_prompt_token: float

    @staticmethod
    def fit(timings: EngineTimings) -> StepCost | None:
        """The least-squares cost of the timed steps with no negative coefficient (the best of
        the fits on each subset of the three terms); None without decode steps."""
        if not timings.decode:
            return None
        steps = torch.tensor(timings.decode, dtype=torch.float64)
        terms = torch.stack([torch.ones(len(steps), dtype=torch.float64), steps[:, 0], steps[:, 1]], 1)
        seconds = steps[:, 2:]
        best, best_error = [0.0, 0.0, 0.0], float(seconds.square().sum())
        for k in (1, 2, 3):
            for kept in itertools.combinations(range(3), k):
                x = terms[:, list(kept)]
                coef = torch.linalg.lstsq(x, seconds).solution
                if coef.min() < 0:
                    continue
                error = float((x @ coef - seconds).square().sum())
                if error < best_error:
                    best, best_error = [0.0, 0.0, 0.0], error
                    for i, c in zip(kept, coef[:, 0].tolist()):
                        best[i] = c
        # a prefill forward pays the fixed cost of a step too, then its tokens
        prompt_tokens = sum(t for t, _ in timings.prefill)
        marginal = sum(s for _, s in timings.prefill) - best[0] * len(timings.prefill)
        return StepCost(*best, max(0.0, marginal) / prompt_tokens if prompt_tokens else 0.0)


def engine_schedule(answers: list[tuple[int, int]], slots: int,
                    prefill_tokens: int = PREFILL_TOKENS) -> tuple[int, int]:
    """(decode steps, prefill forwards) an engine of `slots` takes for (prompt tokens, answer
    tokens) pairs, replaying `regen_engine._Engine`: before each step the queue (longest
    prompts first) fills the free slots in `prefill_group`s; an answer's first token comes from
    its prefill, so an answer of n tokens holds its slot for n - 1 steps (one of 1 token frees it
    at once, for the next group)."""
    queue = collections.deque(sorted(answers, key=lambda a: -a[0]))
    ends: list[int] = []  # the step at which each busy slot frees
    free, step, last, prefills = slots, 0, 0, 0
    while queue:
        while queue and free:
            group = prefill_group([prompt for prompt, _ in itertools.islice(queue, free)], prefill_tokens)
            prefills += 1
            for _ in range(group):
                _, made = queue.popleft()
                if made > 1:
                    free -= 1
                    heapq.heappush(ends, step + made - 1)
                    last = max(last, step + made - 1)
        if queue:
            step = heapq.heappop(ends)
            free += 1
            while ends and ends[0] == step:
                heapq.heappop(ends)
                free += 1
    return last, prefills


def engine_seconds(cost: StepCost, answers: list[tuple[int, int]], slots: int) -> float:
    """Seconds one engine of `slots` takes for (prompt tokens, answer tokens) pairs. A run of many
    batches refills its slots a few at a time, so it pays hundreds of small prefill forwards
    (each a step's fixed cost) where a probe of one batch pays one: priced without them, the
    default main job's regeneration came out 10-15% short."""
    steps, prefills = engine_schedule(answers, slots)
    rows = sum(made - 1 for _, made in answers)
    # a row at its j-th decode step attends to its prompt, the j tokens before and itself
    context = sum((made - 1) * (prompt + 1) + (made - 1) * (made - 2) // 2 for prompt, made in answers)
    prompts = sum(prompt for prompt, _ in answers)
    return (cost.per_step * (steps + prefills) + cost.per_row * rows + cost.per_context * context
            + cost.per_prompt_token * prompts)


def generate_seconds(cost: StepCost, answers: list[tuple[int, int]], batch_size: int, workers: int) -> float:
    """Seconds `regen_engine.generate` takes for (prompt tokens, answer tokens) pairs in the order
    it is given them, split as it splits them over `workers` engines side by side."""
    if not answers:
        return 0.0
    shares, slots = engine_shares(len(answers), batch_size, workers)
    return max(engine_seconds(cost, [answers[i] for i in share], min(slots, len(share))) for share in shares)
