"""The trainer's half of a head kind: the trainee and drafter builders its record names.

A kind's record (`heads.kinds.HeadKind`) lives in heads, a layer below the trainer, so it names
its builders as "module:function" strings; this module is the one place that imports them, so a
new kind's trainer code is found through its record, not through a branch here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from conf.schema import RootConfig
from heads.formats import init_trainee_head
from heads.kinds import HeadKind, head_kind
from trainer.decoding.drafters import Shape


def named_function(path: str) -> Callable:
    """"package.module:function" -> the function."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def build_trainee(cfg: RootConfig, target, data_dir: Path | None) -> nn.Module:
    """A fresh trainee of the configured kind for `target`, over the data folder `data_dir`
    (None: no folder; a kind with a draft vocabulary then takes its lowest ids, for benchmarks).
    With `head.init_from`, its head starts from that folder's weights (`heads.formats`): every
    caller (the run, the planner's probes, the benchmarks) trains what the run will."""
    trainee = named_function(head_kind(cfg.head.name).trainee)(cfg, target, data_dir)
    if cfg.head.init_from:
        init_trainee_head(cfg, trainee.head, target)
    return trainee


def build_drafter(kind: HeadKind, head: nn.Module, target, shapes: Sequence[Shape] = ()):
    """The decoding drafter of a loaded `head` of `kind` on `target`, refusing `shapes` it cannot
    draft before anything is decoded."""
    return named_function(kind.drafter)(head, target, shapes)
