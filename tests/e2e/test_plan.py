"""The time budget from the command line: a two-minute budget is planned and kept (resumed, it keeps
its plan), under torchrun too, explicit sizes win over it, and a budget the evaluation alone
overruns stops in one line before the data stage."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.support.cli import free_port, run_train_cli
from tests.support.runs import tiny_run_args
from trainer.plan.policy import MIN_CONVERSATIONS


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
    # decoded validation, on by default: priced by the training probe, and run as the plan decided
    assert summary["budget"]["rates"]["val_decode_s"] > 0 and plan["val_decode_s"] > 0
    decoded = summary["between_steps"]["decoded_validations"]
    decodes = plan["decode_prompts"] > 0  # the prompts the plan fitted to its share (0: none)
    assert summary["select_by"] == ("decoded" if decodes else "simulated")
    assert (decoded > 0) is decodes
    assert ("decoded validation off" in proc.stdout) is not decodes
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
def test_two_ranks_are_planned_together_and_keep_the_plan(tiny_llama_dir, tmp_path):
    """torchrun with 2 ranks: rank 0 probes what one rank does alone and plans for both (one plan
    line), the ranks train the probe's steps and the run together, and the run keeps the budget
    (its deadline read on rank 0's clock for both: they stop at the same step)."""
    run_dir = tmp_path / "run"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    started = time.perf_counter()
    proc = run_train_cli(budget_args(tiny_llama_dir, run_dir, "budget=2m", "dist=ddp"), launcher=launcher)
    wall = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("plan: ") and "conversations x" in x]
    assert len(lines) == 1 and lines[0].endswith("of 2 min"), lines
    assert "not planned" not in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    a, b = summary["replica_checksums"]
    assert a == b != 0.0
    assert wall <= 120 * 1.15  # the budget, +15% (torchrun's own start and end)
    assert summary["data_samples"] >= 0.8 * summary["budget"]["plan"]["conversations"]


@pytest.mark.slow
def test_explicit_sizes_win_over_the_budget(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train_cli(budget_args(tiny_llama_dir, run_dir, "budget=2m", "data.max_samples=24",
                                     "optim.epochs=1", "pipeline.evaluate=false", "pipeline.export=false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan: " not in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "budget" not in summary and summary["data_samples"] <= 24


@pytest.mark.slow
def test_a_budget_the_evaluation_alone_exceeds_stops_before_the_data_stage(tiny_llama_dir, tmp_path):
    """Evaluating 40 prompts per task at 1,500 tokens each takes far more than 3 minutes, even on
    a tiny target: one line naming the evaluation and the settings that would fit, before any data
    folder is built, and a non-zero exit."""
    run_dir = tmp_path / "run"
    proc = run_train_cli(budget_args(tiny_llama_dir, run_dir, "budget=3m", "eval.max_prompts_per_task=40",
                                     "eval.max_new_tokens=1500"))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: budget=3m: even the smallest plan (48 conversations, 2 epochs) "), last
    assert "evaluate alone" in last and "eval.max_prompts_per_task (now 40)" in last
    assert "plan: " not in proc.stdout and "Traceback" not in proc.stderr
    cache = run_dir.parent / "data-cache"
    assert not list(cache.rglob("manifest.json"))  # no data folder: the probes' are removed
    left = {p.name for p in run_dir.iterdir()} if run_dir.exists() else set()
    assert not left & {"head", "checkpoints", "summary.json", "plan.json"}
