"""Training checkpoints for exact resume: accelerate's state (model, optimizer, scheduler, RNG)
plus where the data order stood, and what the run hands in to keep with it (the loop's history,
so that a resumed run's curve is the one of the step it restores, whenever it was killed). A
checkpoint appears under its final name only when complete, its files all written first;
one that fails (a full disk: one line, `RESUME_THEN`) leaves nothing beside the whole ones.
accelerate writes the optimizer and RNG states with torch.save but reads them back with
weights_only=True, so resuming never unpickles arbitrary objects (tests/unit/trainer/test_checkpoint.py)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from conf.files import disk_full_is_one_line

STATE_FILE = "trainer_state.json"
KEEP = 2
# What a run that found its disk full while saving says to do.
RESUME_THEN = "free space and run again with resume=true (from the last whole checkpoint)"


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this rank already consumed in `epoch`
    best_score: float = float("-inf")  # by optim.select_by, of the head in run_dir/head
    best_step: int = 0  # the step that head was kept at
    skipped: int = 0  # optimizer steps skipped for a non-finite gradient norm (optim.skip_nonfinite)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_step(path: Path) -> int:
    """The training step a checkpoint folder (`step-0000123`) was saved at."""
    return int(path.name.split("-")[1])


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [p for p in checkpoint_root(run_dir).glob("step-*") if (p / STATE_FILE).exists()]
    return max(done, key=checkpoint_step, default=None)


def save_checkpoint(accelerator, run_dir: Path, state: TrainState,
                    files: dict[str, str] | None = None) -> Path:
    """Collective: every rank calls it (DeepSpeed saves shards from each rank). `files`: name ->
    text, written into the checkpoint by the main process before it takes its final name."""
    root = checkpoint_root(run_dir)
    final = root / f"step-{state.step:07d}"
    tmp = root / f".tmp-step-{state.step:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        with disk_full_is_one_line(root, RESUME_THEN):
            accelerator.save_state(str(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state)))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted(root.glob("step-*"))
        for old in done[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> TrainState:
    accelerator.load_state(str(path))
    return TrainState(**json.loads((path / STATE_FILE).read_text()))
