"""The evaluator's prediction of each chain setting (`trainer.evaluate.settings`): what a shorter
chain or a higher p_min would have drafted and kept at recorded steps, what those steps cost, and
which setting it recommends (none where none beats greedy decoding). Pure arithmetic, worked by
hand; and on a real decode, the prediction at the decoded setting is the decode's own τ."""

from __future__ import annotations

import pytest
import torch

from tests.support.decode import chaotic_target, random_eagle3_head
from trainer.decoding import Chain, Eagle3Drafter, speculative_generate
from trainer.decoding.decoder import Step
from trainer.evaluate.settings import StepCost, predict, step_cost, sweep

STEPS = [Step((0.9, 0.6, 0.2), 2), Step((0.95, 0.4, 0.3), 0), Step((0.5, 0.5, 0.5), 3)]
# k -> a step's draft, verify (k + 1 tokens) and other milliseconds; a greedy token costs 2 ms.
COSTS = {1: StepCost(1.0, 3.0, 0.5, 9), 2: StepCost(2.0, 3.5, 0.5, 9), 3: StepCost(3.0, 4.0, 0.5, 9)}
GREEDY = 2.0


@pytest.mark.parametrize("k, p_min, tau, speedup", [
    (3, 0.0, 8 / 3, 2 * 8 / 22.5),  # as decoded: 3 + 1 + 4 tokens in 3 steps of 7.5 ms
    # cut at 2 and at the first below 0.5: 2, 1, 2 drafted; kept 2, 0, 2; a step cut at 1 of 2
    # still paid k=2's head forwards (2 ms) and verified 2 tokens (3 ms)
    (2, 0.5, 7 / 3, 2 * 7 / (6 + 5.5 + 6)),
    (1, 0.96, 1.0, 2 * 3 / 10.5),  # nothing drafted: the head's first forward + a greedy token each
])
def test_a_setting_is_predicted_from_the_recorded_steps_and_costs(k, p_min, tau, speedup):
    row = predict(STEPS, k, p_min, COSTS, GREEDY)
    assert row["mean_acceptance_length"] == pytest.approx(tau, abs=1e-4)
    assert row["speedup_vs_greedy"] == pytest.approx(speedup, abs=1e-4)


def test_the_sweep_recommends_nothing_slower_than_greedy():
    slow = sweep(STEPS, 3, 0.0, COSTS, GREEDY)
    assert slow["best"] is None and slow["fastest"]["speedup_vs_greedy"] < 1.0
    assert {(r["k"], r["p_min"]) for r in slow["rows"]} == {(k, p) for k in (1, 2, 3)
                                                           for p in (0.0, 0.3, 0.5, 0.75, 0.9)}
    assert slow["step_costs"]["3"]["break_even_acceptance_length"] == 3.75  # 7.5 ms / 2 ms
    fast = sweep(STEPS, 3, 0.0, COSTS, greedy=5.0)  # a slower target token: drafting pays
    assert fast["best"] == fast["fastest"] and fast["best"]["speedup_vs_greedy"] >= 1.0
    assert fast["best"]["speedup_vs_greedy"] == max(r["speedup_vs_greedy"] for r in fast["rows"])
    # Recorded at p_min 0.5, the steps tell nothing about a lower p_min.
    assert min(r["p_min"] for r in sweep(STEPS, 3, 0.5, COSTS, GREEDY)["rows"]) == 0.5


@pytest.mark.usefixtures("single_thread")
def test_at_the_decoded_setting_the_prediction_is_the_decodes_own():
    target = chaotic_target("llama")
    drafter = Eagle3Drafter(random_eagle3_head(target, draft_vocab=64))
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(1))
    stats = speculative_generate(target, drafter, ids, 20, Chain(3)).stats
    cost = step_cost(stats)
    row = predict(stats.steps, 3, 0.0, {1: cost, 2: cost, 3: cost}, GREEDY)
    assert row["mean_acceptance_length"] == pytest.approx(stats.mean_acceptance_length, abs=1e-4)
    spent = stats.draft_s + stats.verify_s + stats.other_s
    assert cost.total_ms == pytest.approx(1000 * spent / stats.drafts)
