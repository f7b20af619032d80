"""`python -m trainer.train +head=medusa` as users run it, in one process and on two DDP ranks
(Medusa-2 with LoRA)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from heads.medusa.model import TARGET_DIR, MedusaHead
from tests.support.cli import run_train_cli
from tests.support.runs import tiny_run_args


def medusa_args(target: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return tiny_run_args("medusa", target, data, run_dir, "head.num_heads=2", *extra)


LORA = ("head.joint=true", "head.lora_rank=4")


@pytest.mark.slow
@pytest.mark.parametrize("joint", [False, True], ids=["medusa1", "medusa2-lora"])
def test_the_main_job_trains_medusa(sharp_target, chat_file, tmp_path, joint):
    """`python -m trainer.train +head=medusa`: data_prep captures what the head needs (final
    hidden states, or tokens only for joint training), the shared loop trains, the head folder
    reloads against the target (and carries its LoRA adapter when joint)."""
    run_dir = tmp_path / "run"
    extra = ("optim.max_steps=8", *(LORA if joint else ()))
    proc = run_train_cli(medusa_args(sharp_target, chat_file, run_dir, *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((run_dir / "history.json").read_text())
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses[-1] < losses[0], losses
    head_dir = run_dir / "head"
    model = AutoModelForCausalLM.from_pretrained(sharp_target)
    head = MedusaHead.from_pretrained(head_dir, model, str(sharp_target))
    assert head.num_heads == 2
    assert (head_dir / TARGET_DIR / "adapter_config.json").exists() == joint


@pytest.mark.slow
def test_medusa2_lora_on_two_ddp_processes(sharp_target, chat_file, tmp_path):
    """The joint trainee (peft target, a frozen teacher outside the module tree, a step-count
    buffer) under DDP on 2 CPU processes: replicas stay identical."""
    run_dir = tmp_path / "run"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(29900 + random.randint(0, 90))]
    args = medusa_args(sharp_target, chat_file, run_dir, "dist=ddp", "optim.max_steps=6",
                       "head.head_warmup_steps=2", *LORA)
    proc = run_train_cli(args, launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    a, b = summary["replica_checksums"]
    assert summary["world_size"] == 2 and a == b and a != 0.0
