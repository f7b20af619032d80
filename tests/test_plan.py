"""The time budget (`trainer/plan.py`): the plan's arithmetic, and the main job on a tiny target
finishing within a 2-minute budget with the plan it printed, while explicit sizes win."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import run_train_cli, tiny_run_args
from trainer.plan import MARGIN, MAX_EPOCHS, MIN_CONVERSATIONS, Rates, fit_steps, make_plan


def rates(**kw) -> Rates:
    base = dict(regenerate_tokens_per_s=100.0, capture_tokens_per_s=1000.0, train_tokens_per_s=500.0,
                answer_tokens=200.0, row_tokens=300.0, evaluate_s=60.0, export_s=10.0,
                cached_conversations=0, probe_s=30.0)
    return Rates(**{**base, **kw})


def test_the_plan_fills_the_budget_less_the_margin():
    plan = make_plan(1200, 60, rates(), epochs=2, answers=1, train_share=1.0)
    # per conversation: 2 s regenerate + 0.3 s capture + 2 x 0.6 s training = 3.5 s
    assert plan.conversations == int((1200 * (1 - MARGIN) - 60 - 60 - 10) / 3.5)
    assert plan.total_s == pytest.approx(1200 * (1 - MARGIN), abs=3.5)
    assert plan.regenerate_s == pytest.approx(2 * plan.conversations)
    assert "conversations x 1 answer, 2 epochs" in plan.line() and plan.line().endswith("of 20 min")


def test_cached_answers_are_free():
    cold = make_plan(1200, 60, rates(), 2, 1, 1.0)
    warm = make_plan(1200, 60, rates(cached_conversations=200), 2, 1, 1.0)
    # the 200 cached conversations save 2 s each, spent on more conversations at 3.5 s
    assert warm.conversations == pytest.approx(cold.conversations + 200 * 2 / 3.5, abs=1)
    assert warm.regenerate_s == pytest.approx(2 * (warm.conversations - 200))
    everything = make_plan(1200, 60, rates(cached_conversations=10**6), 2, 1, 1.0)
    assert everything.regenerate_s == 0 and everything.conversations == int((1200 * (1 - MARGIN) - 130) / 1.5)


def test_slower_rates_buy_fewer_conversations_and_a_tiny_budget_keeps_a_minimum():
    fast = make_plan(1200, 60, rates(), 2, 1, 1.0)
    slow = make_plan(1200, 60, rates(regenerate_tokens_per_s=50.0, train_tokens_per_s=250.0), 2, 1, 1.0)
    assert slow.conversations < fast.conversations * 0.6
    assert make_plan(60, 50, rates(), 2, 1, 1.0).conversations == MIN_CONVERSATIONS


def test_the_recheck_trims_steps_and_grows_epochs_only_when_data_ran_short():
    # 10,000 training tokens at 500 tokens/s: 20 s an epoch of 10 steps
    assert fit_steps(100, 10_000, 500, 10, 2, short_of_data=False) == (2, 20)
    assert fit_steps(30, 10_000, 500, 10, 2, short_of_data=False) == (2, 15)  # trimmed
    assert fit_steps(0, 10_000, 500, 10, 2, short_of_data=False) == (2, 1)  # at least one step
    assert fit_steps(100, 10_000, 500, 10, 2, short_of_data=True) == (MAX_EPOCHS, 10 * MAX_EPOCHS)
    assert fit_steps(70, 10_000, 500, 10, 2, short_of_data=True) == (3, 30)


def budget_args(target, run_dir, *extra: str) -> list[str]:
    """A regenerating, evaluating, exporting main job on a tiny target over ShareGPT, its data
    size and epochs left to the budget."""
    args = [a for a in tiny_run_args("eagle3", target, run_dir, run_dir) if not a.startswith(
        ("data.source=", "data.max_samples=", "data.regenerate.enabled=", "pipeline."))]
    return [*args, "data.regenerate.max_new_tokens=32", "data.max_length=160", "data.draft_vocab_size=512",
            "eval.max_prompts_per_task=1", "eval.max_new_tokens=16", "eval.tasks=[mtbench,gsm8k]", *extra]


@pytest.mark.slow
def test_a_two_minute_budget_is_planned_and_kept(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    started = time.perf_counter()
    proc = run_train_cli(budget_args(tiny_llama_dir, run_dir, "budget=2m"))
    wall = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("plan: ") and "conversations x" in x]
    assert line.endswith("of 2 min")
    summary = json.loads((run_dir / "summary.json").read_text())
    plan, stages = summary["budget"]["plan"], summary["stages_s"]
    assert wall <= 120 * 1.1 and summary["wall_time_s"] <= 120 * 1.1  # the budget, +10%
    assert summary["budget"]["rates"]["train_tokens_per_s"] > 0
    assert stages.keys() >= {"probes", "data", "train", "evaluate", "export"}
    # the data the plan asked for was built (ShareGPT holds more than 2 minutes' worth)
    samples = summary["data_samples"]
    assert plan["conversations"] > MIN_CONVERSATIONS and samples >= 0.8 * plan["conversations"]
    # the re-check's steps, unless training ran slower than probed and its deadline cut it short
    planned_steps = summary["budget"]["recheck"]["steps"]
    if "the time the budget left for training is spent" in proc.stderr + proc.stdout:
        assert summary["steps"] < planned_steps
    else:
        assert summary["steps"] == planned_steps
    # Resumed, the run keeps its plan (data folder, steps and so the schedule) and probes nothing.
    again = run_train_cli(budget_args(tiny_llama_dir, run_dir, "budget=2m", "resume=true"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "as planned before the interruption" in again.stdout
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert (resumed["data_dir"], resumed["steps"]) == (summary["data_dir"], summary["steps"])


@pytest.mark.slow
def test_explicit_sizes_win_over_the_budget(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train_cli(budget_args(tiny_llama_dir, run_dir, "budget=2m", "data.max_samples=24",
                                     "optim.epochs=1", "pipeline.evaluate=false", "pipeline.export=false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan: " not in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "budget" not in summary and summary["data_samples"] <= 24
