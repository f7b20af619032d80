"""The memory plan: what one rank of the main job will hold, from the config alone, before any
weights load, and the one line that refuses a run its device cannot hold.

Everything is built on the meta device (shapes and dtypes, no storage): the target's skeleton
(`AutoModelForCausalLM.from_config`) and the trainee the run would build on it
(`trainer.kinds.build_trainee`), so the bytes are those of the modules the code really makes,
not of a formula that could drift from them. What a rank holds:

- the target: offline (the states come from the data folder) and online from servers, the parts
  the trainee reads (`data_prep.folders.online_engine.held_modules`: embeddings, lm_head, final norm where
  needed); online with the hf capture, the whole target, which computes each batch's states.
  Rank 0 holds the whole target besides wherever something decodes with it (decoded
  validation, the evaluation): counted in place of its parts, as an upper bound;
- the trainee's parameters (trainable, and frozen with its buffers). Under DDP they stay as built
  (autocast casts the trainable ones on the fly; the frozen tables are built in the 16-bit
  training dtype, `trainer.trainee.store_frozen_tables`); DeepSpeed casts the parameters, not the
  buffers, to 16 bits when it runs in bf16/fp16;
- gradients and AdamW's state, by strategy (the ZeRO paper's accounting, Rajbhandari et al.
  2020, for DeepSpeed): DDP keeps a gradient per trainable parameter plus its bucket copy
  (accelerate leaves `gradient_as_bucket_view` off) and two float32 moments; ZeRO keeps 16-bit
  gradients, two float32 moments and a float32 master copy of 16-bit parameters; stage 1
  shards the optimizer's state over the world, stage 2 the gradients too, stage 3 the
  parameters too;
- activations: an estimate per token (`activation_bytes_per_token`) times `optim.batch_tokens`.

The pieces are pure functions of the config and the target's `PretrainedConfig`
(tests/unit/trainer/test_memory_plan.py holds them to hand-computed bytes); `check_memory_plan`
is what the main job calls on its device.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from conf.errors import UserError
from conf.schema import RootConfig, derive
from data_prep.folders.online_engine import held_modules, holds_whole
from data_prep.prepare import capture_spec
from data_prep.target import Target, resolve_dtype
from heads.kinds import head_kind
from trainer.distributed import mixed_precision
from trainer.kinds import CATALOG, build_trainee
from trainer.trainee import FP32, RowSizes

GB = 1e9


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one rank holds during training. `target` is what every training rank holds of the
    target (parts or whole), `target_whole` the whole target's bytes; rank 0 holds the whole
    target instead of its parts when `rank0_whole`."""

    mode: str  # offline | online (the hidden states' source the plan assumed)
    strategy: str  # ddp, zero1..zero3 or none
    world: int
    tokens: int  # optim.batch_tokens: tokens of one micro-batch
    target: int
    target_whole: int
    trainable: int  # the trainee's trained parameters
    frozen: int  # the trainee's frozen parameters and its buffers
    gradients: int
    optimizer: int
    activations: int  # an estimate (`activation_bytes_per_token`)
    rank0_whole: bool

    @property
    def training_rank(self) -> int:
        return self.target + self.trainable + self.frozen + self.gradients + self.optimizer + self.activations

    @property
    def rank0(self) -> int:
        return self.training_rank + (self.target_whole - self.target if self.rank0_whole else 0)

    def as_dict(self) -> dict:
        return {**asdict(self), "training_rank": self.training_rank, "rank0": self.rank0}


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors`, each counted once however often it is listed (tied weights)."""
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def module_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters and buffers of `modules`, shared ones once."""
    return tensor_bytes(t for m in modules for t in (*m.parameters(), *m.buffers()))


def strategy_name(cfg: RootConfig) -> str:
    return f"zero{cfg.dist.zero_stage}" if cfg.dist.strategy == "deepspeed" else cfg.dist.strategy


def planned_mode(cfg: RootConfig) -> str:
    """The hidden states' source: `data.hidden_states`, and online for `auto`, which data prep
    decides by the disk: the mode that holds the most."""
    return "offline" if cfg.data.hidden_states == "offline" else "online"


def build_on_meta(cfg: RootConfig, target_config: PretrainedConfig,
                  dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """(the target's skeleton in `dtype`, the trainee the run builds on it), on the meta device.
    No data folder: a draft vocabulary of `data.draft_vocab_size` lowest ids, the size the data's
    takes; `head.init_from` is left out (its head has this run's architecture, which is checked)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(target_config, dtype=dtype)
        trainee = build_trainee(derive(cfg, {"head.init_from": None}), skeleton, None)
    return skeleton, trainee


def trainee_bytes(trainee: nn.Module, skeleton: nn.Module, half: bool) -> tuple[int, int, int]:
    """(trainable parameters, their bytes, frozen parameters' and buffers' bytes) of the trainee,
    leaving out tensors of the target's `skeleton` (Medusa-2 trains the target itself: those are
    the target's bytes). `half`: DeepSpeed stores floating parameters in 16 bits."""
    target = {id(t) for t in (*skeleton.parameters(), *skeleton.buffers())}
    params = [p for p in trainee.parameters() if id(p) not in target]

    def size(p: torch.Tensor) -> int:
        return 2 if half and p.is_floating_point() else p.element_size()

    trained = [p for p in params if p.requires_grad]
    frozen = sum(p.numel() * size(p) for p in params if not p.requires_grad)
    buffers = tensor_bytes(b for b in trainee.buffers() if id(b) not in target)
    return sum(p.numel() for p in trained), sum(p.numel() * size(p) for p in trained), frozen + buffers


def trained_target(trainee: nn.Module, skeleton: nn.Module) -> int:
    """Parameters of the target that the trainee trains (Medusa-2): they need gradients and
    optimizer state too."""
    ours = {id(p) for p in trainee.parameters()}
    return sum(p.numel() for p in skeleton.parameters() if p.requires_grad and id(p) in ours)


def optimizer_bytes(strategy: str, world: int, trained: int, param_size: int) -> tuple[int, int]:
    """(gradients, AdamW state) for `trained` parameters stored at `param_size` bytes each."""
    if not strategy.startswith("zero"):
        buckets = 2 if strategy == "ddp" and world > 1 else 1  # the grads and DDP's bucket copy
        return buckets * trained * param_size, 2 * FP32 * trained
    stage = int(strategy[-1])
    master = FP32 * trained if param_size < FP32 else 0
    grads = trained * param_size // (world if stage >= 2 else 1)
    return grads, (2 * FP32 * trained + master) // world


def activation_bytes_per_token(cfg: RootConfig, target_config: PretrainedConfig, half: bool) -> int:
    """An estimate of what autograd keeps per trained token, the kind's own
    (`TrainerKind.activations`): activations in 2 bytes under bf16/fp16, else 4, a decoder layer
    about 10 hidden-sized and 4 MLP-sized values per row, plus what its loss keeps. Estimates:
    transient peaks (a chunk's bf16 logits, a backward's scratch) are left out, and a real
    batch's padding or short samples change the counts."""
    t = target_config.get_text_config()
    inter = getattr(cfg.head, "intermediate_size", None) or t.intermediate_size
    heads = getattr(cfg.head, "num_attention_heads", None) or t.num_attention_heads
    act = 2 if half else 4
    rows = RowSizes(t.hidden_size, t.vocab_size, heads, act, (10 * t.hidden_size + 4 * inter) * act)
    return CATALOG[cfg.head.name].activations(cfg, rows)


def plan_memory(cfg: RootConfig, target_config: PretrainedConfig, device: torch.device, world: int,
                mode: str | None = None) -> MemoryPlan:
    """The plan of one rank of `world` for `cfg` on a target of `target_config`, on a device of
    `device`'s type (which resolves `target.dtype=auto`); `mode` overrides `planned_mode`."""
    mode = mode or planned_mode(cfg)
    dtype = resolve_dtype(cfg.target.dtype, device)
    strategy = strategy_name(cfg)
    half = mixed_precision(cfg.dist) != "no"
    skeleton, trainee = build_on_meta(cfg, target_config, dtype)
    target = Target(name=cfg.target.name_or_path, path=cfg.target.name_or_path, revision=None,
                    trust_remote_code=False, config=target_config, dtype=dtype)
    kind = head_kind(cfg.head.name)
    spec = capture_spec(cfg, kind, target_config.num_hidden_layers)
    whole = module_bytes([skeleton])
    parts_only = not holds_whole(cfg, spec, mode, main=False)
    held = module_bytes(held_modules(target, spec, skeleton)) if parts_only else whole
    deepspeed_half = strategy.startswith("zero") and half
    trained, trainable, frozen = trainee_bytes(trainee, skeleton, deepspeed_half)
    trained += trained_target(trainee, skeleton)
    param_size = 2 if deepspeed_half else FP32
    grads, optimizer = optimizer_bytes(strategy, world, trained, param_size)
    if strategy == "zero3":
        trainable, frozen = trainable // world, frozen // world
    tokens = cfg.optim.batch_tokens
    return MemoryPlan(
        mode=mode, strategy=strategy, world=world, tokens=tokens, target=held, target_whole=whole,
        trainable=trainable, frozen=frozen, gradients=grads, optimizer=optimizer,
        activations=activation_bytes_per_token(cfg, target_config, half) * tokens,
        rank0_whole=parts_only and holds_whole(cfg, spec, mode, main=True),
    )


def refusal(plan: MemoryPlan, capacity: int) -> str | None:
    """The one line that refuses a plan whose rank 0 or training ranks exceed `capacity` bytes,
    naming the settings that shrink it; None when it fits."""
    worst = max(plan.training_rank, plan.rank0)
    if worst <= capacity:
        return None
    ways = [f"lower optim.batch_tokens={plan.tokens} (activations ~{plan.activations / GB:.1f} GB, "
            "an estimate)"]
    if plan.strategy in ("none", "ddp"):
        ways.append("shard the optimizer with dist=zero2 over several ranks")
    if plan.target < plan.target_whole:
        if plan.rank0 > capacity >= plan.training_rank:
            ways.append("set pipeline.evaluate=false and optim.val_decode_prompts=0 (rank 0 then holds "
                        "the target's parts only)")
    elif plan.mode == "online":
        ways.append("set data.hidden_states=offline (a rank then holds the target's parts only)")
    who = "rank 0" if plan.rank0 > plan.training_rank else "a training rank"
    return (f"memory plan: {who} holds ~{worst / GB:.1f} GB (target {plan.target / GB:.1f}, trainee "
            f"{(plan.trainable + plan.frozen) / GB:.1f}, gradients and optimizer "
            f"{(plan.gradients + plan.optimizer) / GB:.1f}, activations {plan.activations / GB:.1f}) "
            f"of the device's {capacity / GB:.1f} GB; {'; or '.join(ways)}")


def check_memory_plan(cfg: RootConfig, target_config: PretrainedConfig, device: torch.device) -> MemoryPlan:
    """The plan of this process's rank (world from WORLD_SIZE), refused in one line when it does
    not fit a CUDA `device`'s total memory. Another device is not checked: a CPU's memory is the
    machine's, shared by the ranks and the OS and backed by swap, so no bound is the rank's own."""
    plan = plan_memory(cfg, target_config, device, int(os.environ.get("WORLD_SIZE", 1)))
    if device.type == "cuda":
        line = refusal(plan, torch.cuda.mem_get_info(device)[1])
        if line is not None:
            raise UserError(line)
    return plan
