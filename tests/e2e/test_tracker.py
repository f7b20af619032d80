"""A tracked run and its resumption: wandb (offline) and TensorBoard carry the whole checked
config as hyperparameters, the training metrics a person watches (gradient norm, tokens/s,
acceptance per draft position in training and in validation), the evaluation's τ per task and
the stage times; `resume=true` continues the same wandb run and the same event files. Two main
jobs, an evaluation and wandb's service process: in e2e since #62 (the trackers' other tests stay
in tests/unit/trainer/test_tracker.py)."""

from __future__ import annotations

import json

import pytest

from tests.support.runs import QUICK, summary, tiny_run_config
from tests.support.tracking import TRACKED, tb_hparams, tb_text, tensorboard, wandb_runs
from trainer.logger import WANDB_ID
from trainer.train import run

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = ("optim.max_steps=4", "optim.save_every=2", "optim.val_every=2")  # logged every 2 steps
TRAINING = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/sim_acceptance_length"}


def acceptance_keys(keys: set[str], prefix: str) -> set[str]:
    return {k for k in keys if k.startswith(f"{prefix}/acc_")}


def test_a_run_and_its_resumption_carry_config_metrics_evaluation_and_stage_times(
    sharp_target, chat_file, tmp_path
):
    run_dir = tmp_path / "run"
    first = run(tiny_run_config("eagle3", sharp_target, chat_file, run_dir, *STEPS, *TRACKED,
                                "pipeline.evaluate=true", *QUICK))
    run_id = (run_dir / WANDB_ID).read_text()
    (wb,) = wandb_runs(run_dir)
    assert wb.id == run_id and wb.name == "run-eagle3"

    # The whole checked config as hyperparameters (what config.json records), no plan without a budget.
    config = json.loads((run_dir / "config.json").read_text())
    assert {k: wb.config[k] for k in config} == config and "plan" not in wb.config
    assert wb.config["optim"]["lr"] == 1e-3 and wb.config["logging"]["wandb"] == "offline"

    # Training and validation: every logging step carries the gradient norm, the rate and the
    # acceptance of each draft position, the same positions in both.
    per_position = acceptance_keys(wb.keys(), "train")
    assert len(per_position) == 3  # eagle3's ttt_length
    assert {k.replace("train/", "val/") for k in per_position} == acceptance_keys(wb.keys(), "val")
    for step in (2, 4):
        assert TRAINING | per_position <= wb.history[step].keys(), step
        assert wb.history[step]["train/grad_norm"] > 0 and wb.history[step]["train/tokens_per_s"] > 0
        assert all(0 <= wb.history[step][k] <= 1 for k in per_position)

    # After evaluation, at the last step: τ per task and overall as eval.json has them, and the
    # stage times as summary.json has them.
    report = json.loads((run_dir / "eval" / "eval.json").read_text())
    taus = {f"eval/{task}/tau": r["mean_acceptance_length"] for task, r in report["tasks"].items()}
    taus["eval/overall/tau"] = report["overall"]["mean_acceptance_length"]
    assert set(taus) == {"eval/mtbench/tau", "eval/gsm8k/tau", "eval/overall/tau"}
    stages = {f"stages/{stage}_s": s for stage, s in summary(run_dir)["stages_s"].items()}
    assert {"stages/train_s", "stages/evaluate_s"} <= stages.keys()
    last = wb.history[first["steps"]]
    assert {k: last[k] for k in taus} == taus and {k: last[k] for k in stages} == stages
    assert last["eval/lossless"] == 1.0

    # TensorBoard: the same scalars, the config in HParams (to compare runs) and as text (to read).
    events = tensorboard(run_dir)
    assert wb.keys() <= set(events.Tags()["scalars"])
    assert events.Scalars("eval/overall/tau")[-1].value == pytest.approx(taus["eval/overall/tau"])
    hparams = tb_hparams(events)
    assert hparams["optim.lr"] == pytest.approx(1e-3) and hparams["run_name"] == "run-eagle3"
    assert hparams["head.name"] == "eagle3" and hparams["eval.tasks"] == '["mtbench", "gsm8k"]'
    assert json.loads(tb_text(events, "config")) == config

    # resume=true continues the same wandb run (a second offline folder of the same id) from the
    # checkpoint's step on; the event files go on in the same folder.
    run(tiny_run_config("eagle3", sharp_target, chat_file, run_dir, *STEPS, *TRACKED,
                        "optim.max_steps=6", "resume=true"))
    assert (run_dir / WANDB_ID).read_text() == run_id
    first_part, resumed = wandb_runs(run_dir)
    assert first_part.id == resumed.id == run_id and resumed.name == "run-eagle3"
    assert sorted(resumed.history) == [6]
    assert TRAINING | per_position | {"stages/train_s"} <= resumed.history[6].keys()
    assert [e.step for e in tensorboard(run_dir).Scalars("train/grad_norm")] == [2, 4, 6]
