"""What the settings a user leaves unset become on the device a run has, and the one line that
tells a GPU user the sizes are a CPU's.

The defaults in `conf/` are sized for a 2-core CPU, where a step takes about a second: validate
the whole validation split every 50 steps, checkpoint every 50. On a GPU a step takes 50-300 ms,
so the same cadences would validate and write checkpoints (gigabytes at an 8B target) more than
they train. The cadences left null therefore resolve here, per device (`Cadence.of`): on CUDA a
validation runs at most `GPU_VAL_BATCHES` batches per rank (the peers' scale: SpecForge evaluates
every 5,000 steps) and checkpoints go by wall time (`GPU_SAVE_EVERY_MIN`: SpecForge saves every
5,000 steps, speculators once per epoch); on a CPU they stay what every test and the README's
main job were measured with. The sizes (length, draft vocabulary, batch, TTT depth) are not
switched per device: they change what the head learns, so a GPU run on them keeps them and is
told once where the GPU preset is (`cpu_sized_line`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from conf.schema import OptimConfig, RootConfig

GPU_VAL_BATCHES = 200  # per rank and validation, on CUDA, unless optim.val_batches says otherwise
GPU_SAVE_EVERY_MIN = 30.0  # minutes between checkpoints on CUDA, unless optim.save_every_min says
PRESET = "+preset=gpu"  # conf/preset/gpu.yaml: an 8B-class target's sizes on GPUs
# The sizes fitted to the embedded default on a CPU; `head.ttt_length` only where a head has one.
CPU_SIZED = ("data.max_length", "data.draft_vocab_size", "optim.batch_tokens", "head.ttt_length")


@dataclass(frozen=True)
class Cadence:
    """How much a validation reads and when checkpoints are taken, resolved for one device."""

    val_batches: int | None  # the most validation batches per rank; None: the whole split
    save_every_s: float | None  # wall seconds between checkpoints; None: every optim.save_every steps

    @classmethod
    def of(cls, optim: OptimConfig, cuda: bool) -> Cadence:
        """`optim`'s cadences, those left null taking the device's default (`cuda`: whether the
        run trains on CUDA). 0 in either setting turns it off, as a user's choice on any device."""
        batches, minutes = optim.val_batches, optim.save_every_min
        if batches is None:
            batches = GPU_VAL_BATCHES if cuda else 0
        if minutes is None:
            minutes = GPU_SAVE_EVERY_MIN if cuda else 0
        return cls(val_batches=batches or None, save_every_s=60 * minutes or None)


def _setting(cfg: RootConfig, key: str) -> tuple[Any, Any] | None:
    """(value, schema default) of the dotted `key` in `cfg`; None where its group lacks the field
    (a head kind without it) or the default is null (nothing CPU-sized about it)."""
    group, _, name = key.partition(".")
    owner = getattr(cfg, group)  # the head is None in a config built without one
    fields = dataclasses.fields(owner) if owner is not None else ()
    field = next((f for f in fields if f.name == name), None)
    if field is None or field.default is None:
        return None
    return getattr(owner, name), field.default


def cpu_sized_line(cfg: RootConfig, cuda: bool) -> str | None:
    """One line for a run on CUDA whose sizes are all the CPU-sized defaults (none of `CPU_SIZED`
    set by the user, no preset), naming the GPU preset; None otherwise. A user who set any of them
    has chosen sizes, and is not second-guessed."""
    if not cuda:
        return None
    found = {key: pair for key in CPU_SIZED if (pair := _setting(cfg, key)) is not None}
    if any(value != default for value, default in found.values()):
        return None
    shown = ", ".join(f"{key}={value}" for key, (value, _) in found.items())
    return (f"GPU run on the CPU-sized defaults ({shown}): for an 8B-class target add {PRESET} "
            "(conf/preset/gpu.yaml)")
