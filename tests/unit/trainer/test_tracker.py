"""The tracker carries the run: wandb (offline: nothing leaves the machine) and TensorBoard get
the whole checked config and the plan as hyperparameters and a run name; a fresh run takes a new
wandb id; other ranks and a disabled tracker write nothing. Read back from the files each writes
(tests/support/tracking.py). A whole run with evaluation and its resumption, every metric a
person watches on both trackers, is tests/e2e/test_tracker.py's (two main jobs, wandb's service).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.support.runs import tiny_run_config
from tests.support.tracking import TRACKED, tb_hparams, tb_text, tensorboard, wandb_runs
from trainer.logger import WANDB_ID, RunLogger

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_fresh_run_takes_a_new_wandb_id(sharp_target, chat_file, tmp_path):
    """A run_dir left by a run that died before its first checkpoint holds a wandb id; a fresh
    run into it (resume=false, allowed there) must not append to that wandb run."""
    run_dir = tmp_path / "run"
    cfg = tiny_run_config("eagle3", sharp_target, chat_file, run_dir, *TRACKED)
    ids = []
    for _ in range(2):
        RunLogger(cfg, run_dir, enabled=True).close()
        ids.append((run_dir / WANDB_ID).read_text())
    assert ids[0] != ids[1]
    assert sorted(wb.id for wb in wandb_runs(run_dir)) == sorted(ids)


PLAN = {
    "plan": {"budget_s": 1200.0, "conversations": 800, "epochs": 2},
    "rates": {"train_tokens_per_s": 5100.0, "capture_tokens_per_s": math.inf},  # inf: online
}


def test_the_plan_and_a_given_run_name_go_in_as_hyperparameters(sharp_target, chat_file, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_run_config("eagle3", sharp_target, chat_file, run_dir, *TRACKED, "logging.run_name=lr-sweep-3")
    tracker = RunLogger(cfg, run_dir, enabled=True, plan=PLAN)
    tracker.log(1, {"loss": 2.5}, "train")
    tracker.finish(1, {"load": 1.0, "train": 2.0}, None)  # not evaluated: no eval/ keys

    (wb,) = wandb_runs(run_dir)
    assert wb.name == "lr-sweep-3" and wb.config["plan"] == PLAN
    assert wb.history[1] == {"train/loss": 2.5, "stages/load_s": 1.0, "stages/train_s": 2.0}
    events = tensorboard(run_dir)
    hparams = tb_hparams(events)
    assert hparams["plan.plan.budget_s"] == 1200.0 and hparams["run_name"] == "lr-sweep-3"
    assert json.loads(tb_text(events, "plan")) == PLAN
    assert tb_text(events, "run") == "lr-sweep-3"


def test_other_ranks_and_a_disabled_tracker_write_nothing(sharp_target, chat_file, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_run_config("eagle3", sharp_target, chat_file, run_dir, *TRACKED)
    tracker = RunLogger(cfg, run_dir, enabled=False, plan=PLAN)
    tracker.log(1, {"loss": 2.5}, "train")
    tracker.finish(1, {"load": 1.0}, None)
    assert not run_dir.exists()
