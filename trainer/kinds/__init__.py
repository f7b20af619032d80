"""The trainer's half of every head kind, listed once: `CATALOG` maps a kind's name to its
trainee and drafter builders, each in its own module of this folder (`trainer/kinds/<kind>.py`).

A kind's record (`heads.kinds.HeadKind`) lives in heads, a layer below the trainer, so it cannot
name trainer code; this catalog is the trainer's list, kept equal to the records' by
`tests/unit/trainer/test_kinds_catalog.py`, and nothing else in the trainer imports a kind's
module to build it. A new kind adds its module here and one line to `CATALOG`; a derived kind
(P-EAGLE of EAGLE-3) imports its parent's module and subclasses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conf.errors import UserError
from conf.schema import RootConfig
from heads.formats import check_fits, init_trainee_head, read_init_head
from heads.kinds import HeadKind
from trainer.decoding.drafters import Shape, Tree
from trainer.distributed import autocast_dtype
from trainer.kinds import dflash, dspark, eagle3, medusa, mtp, peagle
from trainer.trainee import RowSizes, store_frozen_tables


@dataclass(frozen=True)
class TrainerKind:
    """How the trainer builds one kind's parts."""

    # (cfg, target model, data folder or None) -> the trainee the loop trains
    trainee: Callable[[RootConfig, Any, Path | None], nn.Module]
    # (loaded head, target model, shapes to draft) -> the decoder's drafter
    drafter: Callable[[Any, Any, Sequence[Shape]], Any]
    # (cfg, a row's sizes) -> bytes autograd keeps per trained token, an estimate (`trainer.plan.memory`)
    activations: Callable[[RootConfig, RowSizes], int]
    # whether its trainee trains on-policy (`trainer.on_policy`: `on_policy_rows`, `on_policy_batch`)
    on_policy: bool = False


CATALOG: dict[str, TrainerKind] = {
    "eagle3": TrainerKind(eagle3.build_eagle3_trainee, eagle3.eagle3_drafter, eagle3.eagle3_activations,
                          on_policy=True),
    "medusa": TrainerKind(medusa.build_medusa_trainee, medusa.medusa_drafter, medusa.medusa_activations),
    "peagle": TrainerKind(peagle.build_peagle_trainee, peagle.peagle_drafter, eagle3.eagle3_activations),
    "dflash": TrainerKind(dflash.build_dflash_trainee, dflash.dflash_drafter, dflash.dflash_activations),
    "dspark": TrainerKind(dspark.build_dspark_trainee, dspark.dspark_drafter, dflash.dflash_activations),
    "mtp": TrainerKind(mtp.build_mtp_trainee, mtp.mtp_drafter, mtp.mtp_activations),
}


def build_trainee(cfg: RootConfig, target, data_dir: Path | None) -> nn.Module:
    """A fresh trainee of the configured kind for `target`, over the data folder `data_dir`
    (None: no folder; a kind with a draft vocabulary then takes its lowest ids, for benchmarks).
    With `head.init_from`, its head starts from that folder's weights (`heads.formats`): every
    caller (the run, the planner's probes, the benchmarks) trains what the run will. Its frozen
    tables are stored in the 16-bit dtype a mixed-precision run computes in (`store_frozen_tables`)."""
    trainee = CATALOG[cfg.head.name].trainee(cfg, target, data_dir)
    if cfg.head.init_from:
        init_trainee_head(cfg, trainee.head, target)
    store_frozen_tables(trainee, autocast_dtype(cfg.dist))
    return trainee


def check_init_from(cfg: RootConfig, target_config) -> None:
    """Refuse a `head.init_from` this run cannot start from, before any data stage: its kind,
    target and aux layers (`read_init_head`), then every field and tensor shape of the head this
    run builds (`check_fits`), that head built on the meta device over a skeleton of the target
    (no weights, no data: the draft vocabulary is the folder's own), so a mismatch found only
    when training starts (`init_trainee_head`, the same check) is found here first."""
    if cfg.head is None or not cfg.head.init_from:
        return
    from transformers import AutoModelForCausalLM

    read = read_init_head(cfg, target_config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(target_config)
        head = CATALOG[cfg.head.name].trainee(cfg, skeleton, None).head
    check_fits(read, cfg, head)


def check_on_policy(cfg: RootConfig) -> None:
    """Refuse `optim.on_policy` where this run cannot train on-policy, in one line, from its
    config alone: a kind whose trainee does not (`TrainerKind.on_policy`), a time budget (its
    planner does not price the stage's steps yet: each drafts and runs the target once more),
    the target served elsewhere (the stage runs it here), packed rows (the stage cuts padded
    rows) and ZeRO-3 (the head drafts outside the wrapped forward, which gathers its shards)."""
    share = cfg.optim.on_policy
    if share == 0:
        return
    what = f"optim.on_policy={share}"
    if not CATALOG[cfg.head.name].on_policy:
        able = ", ".join(name for name, kind in CATALOG.items() if kind.on_policy)
        raise UserError(f"{what}: a {cfg.head.name} head does not train on-policy ({able} does); "
                        "set optim.on_policy=0")
    if cfg.budget_s is not None:
        raise UserError(f"{what}: the time budget's planner does not price on-policy steps yet; set "
                        "budget=null, or size the run with data.max_samples and optim.epochs")
    if cfg.data.hidden_states == "online" and cfg.data.capture.backend == "server":
        raise UserError(f"{what}: the on-policy stage runs the whole target here, and "
                        "data.capture.backend=server keeps it on the servers; set data.capture.backend=hf")
    if cfg.optim.packing:
        raise UserError(f"{what}: the on-policy stage cuts padded rows; set optim.packing=false")
    if cfg.dist.zero_stage == 3:
        raise UserError(f"{what}: the head drafts outside ZeRO-3's gathered forward; use dist=zero2 or ddp")


def build_drafter(kind: HeadKind, head: nn.Module, target, shapes: Sequence[Shape] = ()):
    """The decoding drafter of a loaded `head` of `kind` on `target`, refusing `shapes` it cannot
    draft before anything is decoded: a tree for a kind that drafts chains only."""
    if kind.chains_only and any(isinstance(shape, Tree) for shape in shapes):
        raise UserError(f"eval.mode=tree: a {kind.name} head drafts one chain per forward; use "
                        "eval.mode=chain or auto")
    return CATALOG[kind.name].drafter(head, target, shapes)
