"""Which chain length k and p_min make the head pay: each setting's τ and speedup, predicted from
the costs of a step measured in our decoder and the drafts the evaluation actually made.

Why a prediction and not a decode per setting: every (k, p_min) would decode every prompt again
(k x p_min grid times the evaluation), while a chain's greedy acceptance at a step depends only on
the verified text before it and the draft's own tokens. A step recorded at k = K, p_min = p0
(`Step`: the draft's top probability at each position, how many were kept) therefore tells what
any k <= K and p_min >= p0 would have drafted there (the leading positions at or above p_min,
at most k) and kept (as many as were kept, at most that). What it does not tell is where the next
step would have started: the prediction weighs the recorded steps as a sample of steps, so its τ
is an estimate. The costs are measured, not modelled: the first prompt is decoded once per k at
p_min = 0 (`trainer.evaluate.run`), giving the draft, verify and other time of a step that drafts
n tokens, and a step that drafts none costs one greedy token. The best setting is then decoded for
real on that prompt, and eval.md shows its measured figures beside the prediction for the same
prompt; a best whose real decode is slower than greedy is not recommended.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.decoding.decoder import DecodeStats, Step
from trainer.decoding.drafters import confident_prefix

# The p_min values the evaluator tries besides the configured one (llama.cpp's default is 0.75).
P_MIN_GRID = (0.0, 0.3, 0.5, 0.75, 0.9)
# Fewer steps than this behind a k's costs: its figures are too thin to choose by.
MIN_STEPS = 4


@dataclass(frozen=True)
class StepCost:
    """Milliseconds of one speculative step at a chain of k drafts, from a decode at p_min = 0."""

    draft_ms: float
    verify_ms: float  # the target's forward over k + 1 tokens
    other_ms: float
    steps: int

    @property
    def total_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.other_ms


def step_cost(stats: DecodeStats) -> StepCost:
    """The mean step of a speculative decode's `stats`."""
    ms = 1000 / max(stats.drafts, 1)
    return StepCost(ms * stats.draft_s, ms * stats.verify_s, ms * stats.other_s, stats.drafts)


def greedy_ms(stats: DecodeStats) -> float:
    """Milliseconds per token of a greedy decode after its prefill (one target forward each)."""
    return 1000 * stats.verify_s / max(stats.target_forwards - 1, 1)


def cost_of(n: int, k: int, costs: dict[int, StepCost], greedy: float) -> float:
    """Milliseconds of a step that drafts n of at most k tokens. Drafting stopped at n < k paid
    for the head's forwards up to the position that fell below p_min (n + 1 of a sequential
    drafter's, the one forward of the others: `costs[n + 1]`'s draft time either way); the
    target verifies n + 1 tokens (`costs[n]`'s verify, one greedy token when n = 0)."""
    draft = costs[k if n == k else n + 1].draft_ms
    if n == 0:
        return draft + greedy + costs[1].other_ms
    return draft + costs[n].verify_ms + costs[n].other_ms


def predict(steps: list[Step], k: int, p_min: float, costs: dict[int, StepCost], greedy: float) -> dict:
    """τ (tokens per target forward) and speedup over greedy of chains of at most `k` cut at
    `p_min`, from `steps` recorded at a longer or equal k and a lower or equal p_min."""
    tokens = drafted = 0
    ms = 0.0
    for s in steps:
        n = confident_prefix(list(s.confidence[:k]), p_min)
        tokens += min(s.accepted, n) + 1
        drafted += n
        ms += cost_of(n, k, costs, greedy)
    if not steps or not ms:
        return {"k": k, "p_min": p_min, "drafted_per_step": None, "mean_acceptance_length": None,
                "speedup_vs_greedy": None}
    return {
        "k": k,
        "p_min": p_min,
        "drafted_per_step": round(drafted / len(steps), 3),
        "mean_acceptance_length": round(tokens / len(steps), 4),
        "speedup_vs_greedy": round(greedy * tokens / ms, 4),
    }


def grid(k_max: int, p0: float) -> list[tuple[int, float]]:
    """Every (k, p_min) the recorded steps can tell: k up to the decoded one, p_min from the
    decoded one up."""
    ps = sorted({p for p in P_MIN_GRID if p >= p0} | {p0})
    return [(k, p) for k in range(1, k_max + 1) for p in ps]


def sweep(steps: list[Step], k_max: int, p0: float, costs: dict[int, StepCost], greedy: float) -> dict:
    """The eval.json `draft_settings` object: the costs behind it, a row per (k, p_min), the
    fastest and `best`: the fastest when it beats greedy decoding, else None (no setting pays on
    this machine)."""
    rows = [predict(steps, k, p, costs, greedy) for k, p in grid(k_max, p0)]
    scored = [r for r in rows if r["speedup_vs_greedy"] is not None]
    fastest = max(scored, key=lambda r: r["speedup_vs_greedy"], default=None)
    return {
        "method": "predicted from measured step costs and the recorded drafts "
                  "(trainer/evaluate/settings.py)",
        "greedy_ms_per_token": round(greedy, 3),
        "step_costs": {str(k): {"draft_ms": round(c.draft_ms, 3), "verify_ms": round(c.verify_ms, 3),
                                "other_ms": round(c.other_ms, 3), "steps": c.steps,
                                "break_even_acceptance_length": round(c.total_ms / greedy, 3)}
                       for k, c in sorted(costs.items())},
        "rows": rows,
        "fastest": fastest,
        "best": fastest if fastest and fastest["speedup_vs_greedy"] >= 1.0 else None,
    }


def measured(stats: DecodeStats, greedy: float) -> dict:
    """A real decode's τ and decode speedup over greedy (prefill left out on both sides, as the
    prediction leaves it out)."""
    decode_ms = 1000 * (stats.total_s - stats.prefill_s)
    made = stats.new_tokens - 1  # the first token comes from the prefill
    return {
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "speedup_vs_greedy": round(greedy * made / decode_ms, 4) if decode_ms > 0 and made > 0 else None,
    }
