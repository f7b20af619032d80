"""The probes' rates kept for the next main job on the same machine, target and settings.

The probes take minutes of a 20-minute budget (regenerating, capturing and training a little,
decoding a few tokens), and a second run of the same command on the same machine would measure
what the first one measured. So `measure`'s result is kept in the data cache
(`<data cache>/plans/<key>.json`) and a later run whose key matches plans with it at once, and
buys more data with the minutes it saves.

The key is everything the rates depend on: the machine (CPU model, core and thread counts, the
torch build, GPU names), the target's identity (its weights' fingerprint included), and every
setting a probe reads: `target`, `head`, `data`, `optim`, `eval`, `dist`, `pipeline`, `export`
and `seed` (not `budget`, `run_dir`, `resume` or `logging`, which change no rate). What changes
between runs without changing a rate is read afresh: the conversations the regeneration cache
holds now. A machine busy with something else during the first run leaves slow rates behind;
the plan line names the file, and deleting it measures again.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from conf.files import atomic_write_text
from conf.schema import RootConfig
from data_prep.answers.regen_cost import StepCost
from data_prep.answers.regenerate import read_cache
from data_prep.conversations.rows import Spans, cached_spans
from data_prep.folders.keys import digest, regen_cache_file
from data_prep.target import Target, data_base
from trainer.plan.policy import Rates, RegenShape

SETTINGS = ("target", "head", "data", "optim", "eval", "dist", "pipeline", "export", "seed")
VERSION = 1  # of the file's layout


def machine() -> dict:
    """What makes one machine's rates another's: the CPU, its threads, the torch build, GPUs."""
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "gpus": gpus}


def rates_key(cfg: RootConfig, target: Target, world: int) -> dict:
    """Everything the probes' rates depend on (module docstring); `world`: the ranks that
    trained the probe together."""
    settings = {name: getattr(cfg, name) for name in SETTINGS}
    as_json = json.loads(json.dumps({k: asdict(v) if is_dataclass(v) else v for k, v in settings.items()},
                                    default=str))
    return {"version": VERSION, "machine": machine(), "target": target.identity, "settings": as_json,
            "world": world}


def rates_file(cfg: RootConfig, key: dict) -> Path:
    return data_base(cfg) / "plans" / f"{digest(key)}.json"


def keep(cfg: RootConfig, target: Target, world: int, rates: Rates, shape: RegenShape | None) -> Path:
    """Write what `measure` returned under the run's key."""
    key = rates_key(cfg, target, world)
    path = rates_file(cfg, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "rates": asdict(rates),
              "shape": None if shape is None else asdict(shape)}
    atomic_write_text(path, json.dumps(record))
    return path


def kept(cfg: RootConfig, target: Target, world: int) -> tuple[Rates, RegenShape | None, Path] | None:
    """The rates an earlier run kept under this run's key, its regeneration cache read now, or
    None (none kept, or a file this version cannot read: the probes then run and replace it)."""
    key = rates_key(cfg, target, world)
    path = rates_file(cfg, key)
    try:
        record = json.loads(path.read_text())
        if record["key"] != key:
            return None
        rates = Rates(**{**record["rates"], "cached_spans": held_now(cfg, target), "probe_s": 0.0})
        shape = record["shape"]
        if shape is not None:
            rounds = [[tuple(answer) for answer in r] for r in shape["rounds"]]
            shape = RegenShape(**{**shape, "cost": StepCost(**shape["cost"]), "rounds": rounds})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rates, shape, path


def held_now(cfg: RootConfig, target: Target) -> Spans:
    """The selected conversations the regeneration cache holds now (free for the run)."""
    if not cfg.data.regenerate.enabled:
        return ()
    tpl = target.chat_template
    return cached_spans(cfg, tpl, read_cache(regen_cache_file(cfg, target.identity, tpl)))
