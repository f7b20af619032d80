"""Devices and processes: one Accelerator for one CPU, one GPU, DDP or DeepSpeed ZeRO.

CPU multi-process runs have traps that fail silently (a launcher starting one process, replicas
that never talk, NCCL on a machine without CUDA); `build_accelerator` closes each of them and checks
the world size it got against the one it was launched with.

Several nodes run the same command (`dist=ddp`, or `dist=zero2` for DeepSpeed). Rank 0 prepares
the data first, and the first rank of each other node then reuses it (a shared file system) or
builds the same bytes on its own disk (`trainer.train.prepare_data`). Put `run_dir` on a shared
file system (checkpoints hold every rank's RNG state) and, to regenerate once, `data.cache_dir`
too (or run `python -m data_prep.prepare` there first). With node-local caches each node decides
`data.hidden_states=auto` by its own disk: name the mode where the nodes' disks differ.
tests/e2e/test_online.py runs two "nodes" on one machine (two `torchrun --nnodes 2 --node_rank {0,1}`
launchers, a c10d rendezvous on 127.0.0.1, gloo) online, and checks that their replicas agree and
their losses equal those of a 2-process offline DDP run. The README has the torchrun line; with
accelerate, the same job on 2 nodes of 8 GPUs (`machine_rank: 1` in the second node's copy):

    cat > multinode.yaml <<'YAML'
    distributed_type: MULTI_GPU
    num_machines: 2
    num_processes: 16            # all nodes together
    machine_rank: 0
    main_process_ip: node0.example
    main_process_port: 29500
    rdzv_backend: c10d
    same_network: true
    YAML
    accelerate launch --config_file multinode.yaml -m trainer.train +head=eagle3 dist=ddp \
      data.hidden_states=online run_dir=/shared/runs/eagle3 data.cache_dir=/shared/draftsmith/data

and under Slurm:

    #!/bin/bash
    #SBATCH --job-name=draftsmith-eagle3
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1            # one torchrun per node; it starts the 8 ranks
    #SBATCH --gpus-per-node=8
    #SBATCH --cpus-per-task=32
    head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node 8 --rdzv_id "$SLURM_JOB_ID" \
      --rdzv_backend c10d --rdzv_endpoint "$head_node:29500" -m trainer.train +head=eagle3 dist=ddp \
      data.hidden_states=online run_dir=/shared/runs/eagle3-$SLURM_JOB_ID \
      data.cache_dir=/shared/draftsmith/data
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from datetime import timedelta

import torch

from conf.errors import UserError
from conf.schema import DistConfig, OptimConfig
from data_prep.linears import native_bf16


def mixed_precision(cfg: DistConfig) -> str:
    """`dist.mixed_precision`; auto = bf16 autocast on a GPU and on a CPU with native bf16 (faster
    there: `bench_train.py dist.mixed_precision=bf16`), else none."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    return "bf16" if torch.cuda.is_available() or native_bf16() else "no"


def autocast_dtype(cfg: DistConfig) -> torch.dtype | None:
    """The 16-bit dtype training computes in under `mixed_precision` (autocast, or DeepSpeed's
    16-bit weights); None when it runs in float32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision(cfg))


def own_autocast(cfg: DistConfig) -> torch.dtype | None:
    """The autocast dtype draftsmith enters itself around the trainee's forward (`prepare`): the
    step's 16-bit dtype under DeepSpeed, None elsewhere.

    accelerate enters autocast around a DDP or single-device forward, but turns its autocast off
    under DeepSpeed, whose bf16/fp16 casts the parameters alone: the float32 buffers and the
    explicit `.float()` matmuls (branch attention, rotary) then ran as float32 GEMMs, without
    tensor cores. Under this autocast a DeepSpeed step computes in the dtypes a DDP step does."""
    return autocast_dtype(cfg) if cfg.strategy == "deepspeed" else None


def _under_autocast(forward: Callable, device_type: str, dtype: torch.dtype) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        # inside DeepSpeed's engine, which turns an outer autocast off around the module it wraps
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    return run


def prepare(acc, cfg: DistConfig, trainee: torch.nn.Module, opt: torch.optim.Optimizer):
    """`acc.prepare(trainee, opt)`, the trainee's forward under `own_autocast`. Under DeepSpeed,
    rotary frequencies must come back float32: older DeepSpeed releases cast every buffer with
    `module.bfloat16()`, which rounds `inv_freq` and corrupts positions far into a sequence
    (huggingface/transformers#29496); that is refused in one line."""
    dtype = own_autocast(cfg)
    if dtype is not None:
        trainee.forward = _under_autocast(trainee.forward, acc.device.type, dtype)
    trainee, opt = acc.prepare(trainee, opt)
    if cfg.strategy == "deepspeed":
        for name, buffer in acc.unwrap_model(trainee).named_buffers():
            if name.endswith("inv_freq") and buffer.dtype != torch.float32:
                raise RuntimeError(f"DeepSpeed cast {name} to {buffer.dtype}: use a DeepSpeed that keeps "
                                   "float32 buffers (0.19 does)")
    return trainee, opt


def fast_float32_matmuls(device_type: str, capability: tuple[int, int] | None = None) -> None:
    """Let float32 matmuls on a CUDA device of compute capability 8.0 or newer (Ampere on) use
    TF32 tensor cores, as PyTorch's default of full float32 does not.

    Under mixed precision autocast turns most matmuls to 16 bits; what stays float32 (a step
    with `dist.mixed_precision=no`, the float32 heads of a few kinds) ran about 8x slower than
    TF32, whose 10-bit mantissa is still finer than the bf16 the rest of the step computes in.
    Only the CUDA flag is set: a CPU's matmuls (oneDNN's own setting) keep their results.
    `capability`: the device's (default: asked of the current CUDA device)."""
    if device_type != "cuda":
        return
    if capability is None:
        capability = torch.cuda.get_device_capability()
    if capability >= (8, 0):
        torch.backends.cuda.matmul.allow_tf32 = True


def _skip_deepspeed_shm_build() -> None:
    """DeepSpeed compiles a shared-memory comm helper at init (~4 minutes on 2 cores) that gloo
    never uses; replace its builder.
    Reached through sys.modules because `import deepspeed.comm.torch` binds the name `torch`,
    not the module."""
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
        # ZeRO-3 partitions the head when accelerate prepares it; nothing is built inside
        # `zero.Init` (`frozen_target_outside_zero3`), and the kept head is gathered to 16 bits
        # when saved (`selection.save_best`: accelerate refuses `get_state_dict` otherwise).
        zero3_init_flag=False,
        zero3_save_16bit_model=cfg.zero_stage == 3,
    )
    # Batches are length-grouped (their row count varies) and never pass through a DataLoader
    # that accelerate could read; DeepSpeed only uses this number for its bookkeeping.
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    return plugin


def frozen_target_outside_zero3() -> None:
    """Forget the DeepSpeed config that selecting the plugin handed transformers.

    accelerate gives transformers its config whatever `zero3_init_flag` says, and at stage 3
    transformers then builds every later model inside `deepspeed.zero.Init`: the frozen target
    (`data_prep.target.Target.load_model`, `load_parts`) came back as partitioned placeholders
    that no DeepSpeed engine gathers, so its first forward failed ("Padding_idx must be within
    num_embeddings"), and `generate` turned to ZeRO-3's synced loop. Only the head is DeepSpeed's
    to shard (as SpecForge and speculators shard only the draft); accelerate reads its own copy
    of the config when it prepares the head, never transformers'."""
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def build_accelerator(cfg: DistConfig, optim: OptimConfig, project_dir: str):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    world = int(os.environ.get("WORLD_SIZE", 1))
    if cfg.strategy == "none" and world > 1:
        raise UserError(f"dist.strategy=none but launched with WORLD_SIZE={world}: use dist=ddp")
    cpu = not torch.cuda.is_available()
    kwargs, handlers = {}, []
    if world > 1:
        # Without cpu=True two CPU processes run as two lonely replicas; NCCL needs CUDA.
        kwargs["cpu"] = cpu
        handlers.append(InitProcessGroupKwargs(backend="gloo" if cpu else "nccl",
                                               timeout=timedelta(minutes=cfg.timeout_min)))
    if cfg.strategy == "ddp":
        # DDP broadcast every buffer from rank 0 at every forward (a 0.5 GB float32 teacher table
        # at Llama-3-8B). A trainee's buffers are constants every rank builds identically from the
        # same target and data (teacher rows, vocabulary maps, rotary frequencies), or counters
        # every rank steps alike (Medusa-2's batches seen): nothing to send.
        handlers.append(DistributedDataParallelKwargs(broadcast_buffers=False))
    if handlers:
        kwargs["kwargs_handlers"] = handlers
    if cfg.strategy == "deepspeed":
        kwargs.pop("cpu", None)  # accelerate rejects cpu=True with DeepSpeed; gloo does the job
        kwargs["deepspeed_plugin"] = deepspeed_plugin(cfg, optim)
    acc = Accelerator(
        mixed_precision=mixed_precision(cfg),
        gradient_accumulation_steps=optim.grad_accum,
        project_dir=project_dir,
        **kwargs,
    )
    if cfg.strategy == "deepspeed":
        frozen_target_outside_zero3()
    if acc.num_processes != world:
        raise RuntimeError(
            f"launched with WORLD_SIZE={world} but accelerate formed {acc.num_processes} process(es)"
        )
    return acc
