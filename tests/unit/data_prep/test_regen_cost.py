"""The regeneration's cost before it runs (`data_prep/answers/regen_cost.py`): the replayed schedule must be
the engine's own, step for step, and the fit must find a step cost the steps follow."""

from __future__ import annotations

import random

import pytest

from data_prep.answers.regen_cost import StepCost, engine_schedule, engine_seconds, generate_seconds
from data_prep.answers.regen_engine import EngineTimings, engine_shares, generate
from tests.support.decode import chaotic_target


def test_the_replayed_schedule_is_the_engines_own():
    """Answers that stop anywhere (random stop tokens) and prompts of many lengths: the replay's
    steps per engine, and the rows and context it counts, are what the engines really ran."""
    model = chaotic_target()  # its greedy text varies, so the stop tokens end answers anywhere
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randint(3, 40))] for _ in range(23)]
    eos = set(range(0, 256, 9))
    for workers, batch_size in ((1, 4), (2, 10)):
        timings = EngineTimings()
        answers = generate(model, prompts, max_new_tokens=12, batch_size=batch_size, eos_token_ids=eos,
                           workers=workers, timings=timings)
        pairs = [(len(p), len(a)) for p, a in zip(prompts, answers)]
        assert len({len(a) for a in answers}) >= 5  # slots free at many different steps
        shares, slots = engine_shares(len(prompts), batch_size, workers)
        assert len(shares) == workers
        engines = [[pairs[i] for i in share] for share in shares]
        schedules = [engine_schedule(e, min(slots, len(e))) for e in engines]  # prefill groups too
        assert len(timings.decode) == sum(steps for steps, _ in schedules)
        assert len(timings.prefill) == sum(prefills for _, prefills in schedules)
        # with one unit of cost per forward, per row, per context token or per prompt token, an
        # engine's seconds are what it counted
        for unit, measured in ((StepCost(1, 0, 0, 0), len(timings.decode) + len(timings.prefill)),
                               (StepCost(0, 1, 0, 0), sum(r for r, _, _ in timings.decode)),
                               (StepCost(0, 0, 1, 0), sum(c for _, c, _ in timings.decode)),
                               (StepCost(0, 0, 0, 1), sum(t for t, _ in timings.prefill))):
            assert sum(engine_seconds(unit, e, slots) for e in engines) == measured


def test_a_thinning_batch_costs_more_steps_than_a_full_one():
    """Two batches' worth of equal answers take two answers' steps and two prefills; one batch and
    a half of them as long too (the half-batch runs thin), so a rate measured on full batches
    would be short."""
    same = [(10, 50)] * 8
    assert engine_schedule(same, 4) == (2 * 49, 2)
    assert engine_schedule(same[:6], 4) == (2 * 49, 2)
    assert engine_schedule([(10, 50), (10, 20), (10, 30)], 2) == (49, 2)  # a refill at step 19
    assert engine_schedule([(10, 1), (10, 5), (100, 5)], 2) == (4, 3)  # 1 token: refilled at once
    cost = StepCost(per_step=1.0, per_row=0.1, per_context=0.0, per_prompt_token=0.0)
    per_token = [engine_seconds(cost, same[:n], 4) / (n * 49) for n in (4, 6, 8)]
    assert per_token[1] > per_token[0] and per_token[1] > per_token[2]
    # two engines side by side take as long as the slower one
    assert generate_seconds(cost, same, 8, 2) == engine_seconds(cost, same[:4], 4)


def test_the_fit_finds_the_cost_the_steps_follow_and_never_a_negative_one():
    rng = random.Random(1)
    truth = StepCost(per_step=0.05, per_row=0.002, per_context=1e-5, per_prompt_token=0.0)
    timings = EngineTimings()
    for _ in range(200):
        rows = rng.randint(1, 128)
        context = rows * rng.randint(20, 400)
        seconds = truth.per_step + truth.per_row * rows + truth.per_context * context
        timings.decode.append((rows, context, seconds * rng.uniform(0.98, 1.02)))
    timings.prefill = [(100, 0.55), (300, 1.55)]  # a step's fixed cost, then 5 ms a token
    fit = StepCost.fit(timings)
    assert fit.per_step == pytest.approx(truth.per_step, rel=0.1)
    assert fit.per_row == pytest.approx(truth.per_row, rel=0.1)
    assert fit.per_context == pytest.approx(truth.per_context, rel=0.1)
    assert fit.per_prompt_token == pytest.approx(0.005, rel=0.05)
    # steps that grow slower with more rows (longer contexts late in a run) fit no negative cost
    falling = EngineTimings(decode=[(128, 20_000, 0.2), (96, 25_000, 0.22), (64, 30_000, 0.25)])
    fit = StepCost.fit(falling)
    assert min(fit.per_step, fit.per_row, fit.per_context) >= 0
    assert StepCost.fit(EngineTimings()) is None
