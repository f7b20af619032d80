"""scripts/bench_train.py's per-part breakdown of a step (`StepBreakdown`) on tiny EAGLE-3 and
Medusa trainees: each part the step runs is charged, the parts add up to the step's wall time,
and the trainee is left as it was (no hooks, no wrapped teacher)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch

from conf.schema import OptimConfig
from tests.support.syncs import eagle3, medusa1, samples
from trainer.batching import collate
from trainer.loop import device_batch

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_train.py"
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def bench_train():
    """The script as a module, registered as its dataclasses need."""
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    module = sys.modules["bench_train"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "build, charged, unrolls",
    [
        (eagle3, ("fc", "attention", "mlp", "lm_head", "teacher"), True),
        (medusa1, ("mlp", "lm_head"), False),  # Medusa's residual blocks are its MLPs
    ],
    ids=["eagle3", "medusa1"],
)
def test_parts_are_charged_and_add_up_to_the_step(bench_train, tiny_model, build, charged, unrolls):
    torch.manual_seed(0)
    trainee, fields = build(tiny_model)
    batch = device_batch(collate(samples(tiny_model, fields), trainee.batch_index), CPU)
    step, _ = bench_train.make_step(trainee, OptimConfig(), CPU, bf16=False)
    step(batch)  # warm-up
    started = time.perf_counter()
    record = bench_train.step_breakdown(trainee, step, batch, CPU, steps=2)
    wall = (time.perf_counter() - started) / 2
    assert set(record) == {*bench_train.FORWARD_PARTS, "forward_other", "backward", "optimizer", "ttt_unroll"}
    assert all(record[k] > 0 for k in (*charged, "forward_other", "backward", "optimizer")), record
    assert all(record[k] == 0 for k in bench_train.FORWARD_PARTS if k not in charged), record
    total = sum(v for k, v in record.items() if k != "ttt_unroll")
    assert total == pytest.approx(wall, rel=0.1, abs=2e-3)
    forward = total - record["backward"] - record["optimizer"]
    assert (0 < record["ttt_unroll"] < forward) if unrolls else record["ttt_unroll"] == 0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in trainee.modules())
    assert "teacher" not in trainee.__dict__
