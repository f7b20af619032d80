"""The tracker carries the run: wandb (offline: nothing leaves the machine) and TensorBoard get
the whole checked config and the plan as hyperparameters, a run name, the training metrics a
person watches (gradient norm, tokens/s, acceptance per draft position in training and in
validation), the evaluation's τ per task and the stage times; `resume=true` continues the same
wandb run. Read back from the files each writes: the offline run's transaction log
(run-<id>.wandb, the only file wandb 0.31 writes offline with the run's data) and the event files.
"""

from __future__ import annotations

import json
import math
import struct
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
from wandb.proto import wandb_internal_pb2

from tests.support.runs import QUICK, summary, tiny_run_config
from trainer.logger import WANDB_ID, RunLogger
from trainer.train import run

pytestmark = pytest.mark.usefixtures("single_thread")

TRACKED = ("logging.wandb=offline", "logging.tensorboard=true")
STEPS = ("optim.max_steps=4", "optim.save_every=2", "optim.val_every=2")  # logged every 2 steps
TRAINING = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/sim_acceptance_length"}


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch):
    """wandb never goes online in tests, whatever a config says, and keeps quiet."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # pytest's capture is left alone


# ---- reading back what the trackers wrote ----------------------------------------------------

BLOCK = 32 * 1024  # the .wandb file is LevelDB's log format: 32 KiB blocks of framed chunks
FULL, LAST = 1, 4


def wandb_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The records of an offline run's transaction log: after a 7-byte header (":W&B", a key, a
    version), chunks framed as checksum (4), length (2), type (1: whole, 2-4: first, middle,
    last piece); a block's tail shorter than a frame is padding. (wandb 0.31 ships no reader.)"""
    raw = path.read_bytes()
    assert raw[:4] == b":W&B", path
    pos, pieces = 7, b""
    while pos + 7 <= len(raw):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pieces += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


class WandbRun:
    """One offline-run-* folder, read back: its id, name, config and history by step."""

    def __init__(self, folder: Path):
        (log,) = folder.glob("run-*.wandb")
        self.config: dict = {}
        self.history: dict[int, dict[str, float]] = defaultdict(dict)
        kinds = []
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            kinds.append(kind)
            if kind == "run":
                self.id, self.name = record.run.run_id, record.run.display_name
                self.config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
            elif kind == "history":
                items = record.history.item
                named = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}
                row = {k: v for k, v in named.items() if not k.startswith("_")}  # wandb's own: _step...
                self.history[record.history.step.num].update(row)
        assert kinds[-1:] == ["exit"], f"{log}: {kinds}"  # the whole run, finished

    def keys(self) -> set[str]:
        return {k for row in self.history.values() for k in row}


def wandb_runs(run_dir: Path) -> list[WandbRun]:
    """The offline runs under run_dir, oldest first. wandb's service writes a run's log after
    `finish()` returns (seen: a 7-byte file, header only); shutting the service down flushes it."""
    wandb.teardown()
    return [WandbRun(folder) for folder in sorted((run_dir / "wandb").glob("offline-run-*"))]


def tensorboard(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def tb_hparams(events: EventAccumulator) -> dict[str, object]:
    """The hyperparameters of the run's (last) HParams session start."""
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = HParamsPluginData.FromString(content).session_start_info
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}


def tb_text(events: EventAccumulator, tag: str) -> str:
    (event,) = events.Tensors(f"{tag}/text_summary")[-1:]
    return event.tensor_proto.string_val[0].decode()


def acceptance_keys(keys: set[str], prefix: str) -> set[str]:
    return {k for k in keys if k.startswith(f"{prefix}/acc_")}


# ---- the tests -------------------------------------------------------------------------------


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
