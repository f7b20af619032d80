"""Choosing the head by decoded validation from the command line, in one process and on two DDP
ranks that agree; and the main job's default, which decodes and keeps the head by it, and says the
gap between the simulated and the decoded τ."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_train_cli
from tests.support.runs import tiny_run_args
from trainer.collapse import SIM
from trainer.loop import DECODED

# Each kind's own settings for a short run: a small draft vocabulary, EAGLE-3's unroll of 3.
KIND_ARGS = {
    "eagle3": ("data.draft_vocab_size=400", "head.ttt_length=3"),
    "peagle": ("data.draft_vocab_size=400",),
    "dflash": (),
}


def decoded_run_args(target: Path, data: Path, run_dir: Path, *extra: str, kind: str = "eagle3") -> list[str]:
    return tiny_run_args(
        kind,
        target,
        data,
        run_dir,
        *KIND_ARGS[kind],
        "optim.max_steps=8",
        "optim.val_every=4",
        "optim.val_decode_prompts=2",
        "optim.select_by=decoded",
        *extra,
    )


def decoded_history(run_dir: Path) -> list[float]:
    history = json.loads((run_dir / "history.json").read_text())
    return [h["val"][DECODED] for h in history if "val" in h]


@pytest.mark.parametrize("kind", list(KIND_ARGS))
def test_the_main_job_selects_by_decoding(sharp_target, chat_file, tmp_path, kind):
    """Every chain kind's own drafter decodes in validation (P-EAGLE's and DFlash's in one
    forward per step) and the summary keeps the best decoded head."""
    run_dir = tmp_path / "run"
    proc = run_train_cli(decoded_run_args(sharp_target, chat_file, run_dir, kind=kind))
    assert proc.returncode == 0, proc.stderr[-3000:]
    decoded = decoded_history(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(decoded) == 2 and all(v >= 1.0 for v in decoded)
    assert summary["select_by"] == "decoded" and summary["best_score"] == max(decoded)
    assert DECODED in proc.stdout  # each validation line shows it


def test_the_main_job_decodes_in_validation_by_default(sharp_target, chat_file, tmp_path):
    """No decoding override: each validation decodes 8 prompts beside the simulated τ (the
    printed line, history.json, training.png), the head is kept by the decoded τ, and
    summary.json and the closing lines name the kept head's gap."""
    run_dir = tmp_path / "run"
    args = tiny_run_args("eagle3", sharp_target, chat_file, run_dir, *KIND_ARGS["eagle3"],
                         "optim.max_steps=8", "optim.val_every=4")
    proc = run_train_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    decoded = decoded_history(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(decoded) == 2 and summary["select_by"] == "decoded" and summary["best_score"] == max(decoded)
    assert summary["between_steps"]["decoded_validations"] == 2
    kept = summary["kept_validation"]
    history = json.loads((run_dir / "history.json").read_text())
    at_best = next(h["val"] for h in history if "val" in h and h["step"] == summary["best_step"])
    assert kept == {"step": summary["best_step"], "simulated": at_best[SIM], "decoded": max(decoded)}
    assert f"{DECODED}=" in proc.stdout and "decoded validation off" not in proc.stdout
    assert "τ gap: the kept head (step " in proc.stdout and (run_dir / "training.png").exists()
    config = json.loads((run_dir / "config.json").read_text())["optim"]
    assert (config["val_decode_prompts"], config["select_by"]) == (8, "decoded")


@pytest.mark.slow
def test_two_ddp_ranks_agree_on_the_decoded_choice(sharp_target, chat_file, tmp_path):
    """Rank 0 decodes, rank 1 waits for its value: no deadlock, one choice, equal replicas."""
    run_dir = tmp_path / "run"
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(29500 + random.randint(0, 400)),
    ]
    proc = run_train_cli(decoded_run_args(sharp_target, chat_file, run_dir, "dist=ddp"), launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    a, b = summary["replica_checksums"]
    assert summary["world_size"] == 2 and a == b
    assert summary["best_score"] == max(decoded_history(run_dir))
