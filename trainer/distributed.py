"""Devices and processes: one Accelerator for one CPU, one GPU, DDP or DeepSpeed ZeRO.

CPU multi-process runs have traps that fail silently (a launcher starting one process, replicas
that never talk, NCCL on a machine without CUDA); `build_accelerator` closes each of them and checks
the world size it got against the one it was launched with.
"""

from __future__ import annotations

import os
import sys

import torch

from conf.errors import UserError
from conf.schema import DistConfig, OptimConfig
from data_prep.linears import native_bf16


def mixed_precision(cfg: DistConfig) -> str:
    """`dist.mixed_precision`; auto = bf16 autocast on a GPU and on a CPU with native bf16 (the
    2-core EPYC trains the default EAGLE-3 head 1.34x faster: 770 vs 576 tokens/s), else none."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    return "bf16" if torch.cuda.is_available() or native_bf16() else "no"


def _skip_deepspeed_shm_build() -> None:
    """DeepSpeed compiles a shared-memory comm helper at init (~4 min on 2 cores) that gloo
    never uses; replace its builder. Reached through sys.modules because
    `import deepspeed.comm.torch` binds the name `torch`, not the module."""
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def deepspeed_plugin(cfg: DistConfig, optim: OptimConfig):
    from accelerate.utils import DeepSpeedPlugin

    _skip_deepspeed_shm_build()
    if cfg.zero_stage not in (1, 2, 3):
        raise UserError(f"dist.zero_stage={cfg.zero_stage}: expected 1, 2 or 3 with deepspeed")
    plugin = DeepSpeedPlugin(
        zero_stage=cfg.zero_stage,
        gradient_accumulation_steps=optim.grad_accum,
        gradient_clipping=optim.grad_clip,
    )
    # Batches are length-grouped (their row count varies) and never pass through a DataLoader
    # that accelerate could read; DeepSpeed only uses this number for its bookkeeping.
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    return plugin


def build_accelerator(cfg: DistConfig, optim: OptimConfig, project_dir: str):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    world = int(os.environ.get("WORLD_SIZE", 1))
    if cfg.strategy == "none" and world > 1:
        raise UserError(f"dist.strategy=none but launched with WORLD_SIZE={world}: use dist=ddp")
    cpu = not torch.cuda.is_available()
    kwargs = {}
    if world > 1:
        # Without cpu=True two CPU processes run as two lonely replicas; NCCL needs CUDA.
        kwargs["cpu"] = cpu
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo" if cpu else "nccl")]
    if cfg.strategy == "deepspeed":
        kwargs.pop("cpu", None)  # accelerate rejects cpu=True with DeepSpeed; gloo does the job
        kwargs["deepspeed_plugin"] = deepspeed_plugin(cfg, optim)
    acc = Accelerator(
        mixed_precision=mixed_precision(cfg),
        gradient_accumulation_steps=optim.grad_accum,
        project_dir=project_dir,
        **kwargs,
    )
    if acc.num_processes != world:
        raise RuntimeError(
            f"launched with WORLD_SIZE={world} but accelerate formed {acc.num_processes} process(es)"
        )
    return acc
