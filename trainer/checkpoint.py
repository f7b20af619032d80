"""Training checkpoints for exact resume: accelerate's state (model, optimizer, scheduler, RNG)
plus where the data order stood, and what the run hands in to keep with it (the loop's history,
so that a resumed run's curve is the one of the step it restores, whenever it was killed). A
checkpoint appears under its final name only when complete, its files all written first;
one that fails (a full disk: one line, `RESUME_THEN`) leaves nothing beside the whole ones.

A checkpoint holds what trains, nothing frozen: the trainee's trainable parameters and its
persistent buffers (torch's mark of a buffer that is state: Medusa's `batches_seen`, EAGLE-3's
vocabulary maps), not its frozen parameters (the target's embedding and lm_head copies: 113 MB
of a SmolLM2 EAGLE-3 head's 153 MB, 2.1 GB at Llama-3-8B). Every run builds its trainee from the
target afresh, so a resumed one has them already; a load refuses any other missing key. It also
records the processes and ZeRO stage that trained it, which a resume must match.
accelerate writes the optimizer and RNG states with torch.save but reads them back with
weights_only=True, so resuming never unpickles arbitrary objects (tests/unit/trainer/test_checkpoint.py)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate.utils import DistributedType
from safetensors.torch import load_model
from torch import nn

from conf.errors import UserError
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
    # by optim.select_by, the best any validation scored: the bar a later head must come within
    # noise of to be kept (`selection.keeps`), not always the kept head's own score
    best_score: float = float("-inf")
    best_step: int = 0  # the step that head was kept at
    skipped: int = 0  # optimizer steps skipped for a non-finite gradient norm (optim.skip_nonfinite)
    # The processes and ZeRO stage (0: none) that trained it (`launch_layout`); None in a
    # checkpoint saved before they were recorded.
    world: int | None = None
    zero_stage: int | None = None
    # The step count from which steps train on-policy (`trainer.on_policy`), fixed when the run
    # first starts: None where it trains none (or was saved before this was recorded).
    on_policy_from: int | None = None


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
    state.world, state.zero_stage = launch_layout(accelerator)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        with disk_full_is_one_line(root, RESUME_THEN):
            save_trained(accelerator, str(tmp))
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
    check_layout(path, *launch_layout(accelerator))
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.load_state(str(path), custom_load_fn=load_module)
    else:
        with accelerator.register_load_state_pre_hook(load_trained):
            accelerator.load_state(str(path))
    return TrainState(**json.loads((path / STATE_FILE).read_text()))


def launch_layout(accelerator) -> tuple[int, int]:
    """(processes, ZeRO stage or 0) of this run."""
    plugin = accelerator.state.deepspeed_plugin
    return accelerator.num_processes, plugin.zero_stage if plugin else 0


def check_layout(path: Path, world: int, zero_stage: int) -> None:
    """Refuse to resume the checkpoint at `path` on other processes or another ZeRO stage than
    trained it: each rank's share of the data (`rank_batches`) is dealt by the process count, so
    the run would go on at batches it never reached or saw twice, and DeepSpeed partitions its
    optimizer state by both (it would fail to load them after the target and data were ready)."""
    saved = json.loads((path / STATE_FILE).read_text())
    was = saved.get("world"), saved.get("zero_stage")
    if was[0] is not None and was != (world, zero_stage):
        raise UserError(
            f"resume=true: {path} was saved by {layout_words(*was)}, this run has "
            f"{layout_words(world, zero_stage)}: resume it on the same"
        )


def layout_words(world: int, zero_stage: int) -> str:
    processes = f"{world} process" + ("es" if world > 1 else "")
    return f"{processes} under dist=zero{zero_stage}" if zero_stage else processes


def frozen_names(model: nn.Module) -> set[str]:
    """The state-dict names of `model`'s frozen parameters, tied aliases included."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def save_trained(accelerator, out: str) -> None:
    """accelerate's `save_state` without the frozen parameters. DeepSpeed writes its own model
    states (and under ZeRO-2/3 would write the frozen ones a second time, as fragments)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.save_state(out, exclude_frozen_parameters=True)
    else:
        with accelerator.register_save_state_pre_hook(drop_frozen):
            accelerator.save_state(out)


def drop_frozen(models: list[nn.Module], weights: list[dict], output_dir: str) -> None:
    """accelerate's save pre-hook: each state dict loses its model's frozen parameters, in
    place (an OrderedDict still, which accelerate de-duplicates tied names of before writing)."""
    for model, state in zip(models, weights):
        for name in frozen_names(model):
            state.pop(name, None)


def load_trained(models: list[nn.Module], input_dir: str) -> None:
    """accelerate's load pre-hook: loads each model's file itself, taking the frozen parameters
    it lacks from the model as built, and empties `models` so that accelerate's strict load
    does not run. Tensors go through the CPU, as accelerate's own load does on one process."""
    for i, model in enumerate(models):
        name = "model.safetensors" if i == 0 else f"model_{i}.safetensors"
        check_loaded(model, *load_model(model, Path(input_dir) / name, strict=False))
    models.clear()


def load_module(src: dict, dst: nn.Module) -> None:
    """DeepSpeed's `custom_load_fn`: its module state dict into the module, as `load_trained`."""
    check_loaded(dst, *dst.load_state_dict(src, strict=False))


def check_loaded(model: nn.Module, missing, unexpected) -> None:
    """A checkpoint missing more than the frozen parameters, or holding keys the model lacks, is
    another model's: refused as a strict load would."""
    lacking = sorted(set(missing) - frozen_names(model))
    if lacking or unexpected:
        raise RuntimeError(
            f"checkpoint does not fit the trainee: missing {lacking}, unexpected {sorted(unexpected)}"
        )
