"""The root config schema: one dataclass per component, mirrored by a YAML group under `conf/`.

Hydra composes the YAML; `validate` merges it into these dataclasses so that a wrong type or an
unknown key fails before any model is loaded, as one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data_prep.config import DataConfig
from heads.eagle3 import Eagle3Config
from heads.medusa import MedusaConfig
from trainer.errors import UserError
from trainer.eval_config import EvalConfig
from trainer.target import TargetConfig

HEAD_CONFIGS: dict[str, type] = {"eagle3": Eagle3Config, "medusa": MedusaConfig}


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.05
    grad_clip: float = 0.5
    grad_accum: int = 1
    batch_tokens: int = 1024
    max_batch_size: int = 16
    epochs: int = 3
    max_steps: int = 0
    val_every: int = 50
    save_every: int = 50
    loader_workers: int = 0


@dataclass
class DistConfig:
    strategy: str = "none"  # none | ddp | deepspeed
    zero_stage: int = 0
    mixed_precision: str = "auto"  # auto | no | bf16 | fp16


@dataclass
class LoggingConfig:
    wandb: str = "disabled"  # disabled | offline | online
    wandb_project: str = "draftsmith"
    tensorboard: bool = True
    log_every: int = 10
    progress: bool = True


@dataclass
class ExportConfig:
    # None: every format that holds the head's kind (EAGLE-3: eagle3, speculators; Medusa:
    # medusa-vllm, medusa-tgi).
    formats: list[str] | None = None
    out_dir: str | None = None
    push_to_hub: str | None = None
    dtype: str = "bfloat16"  # storage dtype of the exported weights (engines cast on load)
    license: str = "apache-2.0"  # the model card's license: the target's, the head derives from it


@dataclass
class PipelineConfig:
    evaluate: bool = True
    export: bool = True


@dataclass
class RootConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    head: Any = None  # Eagle3Config | MedusaConfig, checked against HEAD_CONFIGS
    seed: int = 0
    run_dir: str = "outputs"
    resume: bool = False


def _one_line(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    msg = str(err).strip().splitlines()[0]
    return f"{key}: {msg}" if key else msg


def validate(cfg: DictConfig) -> RootConfig:
    """Hydra's composed config -> typed `RootConfig`, or a one-line `UserError`."""
    head = cfg.get("head")
    if head is None:
        raise UserError("no head chosen: add +head=eagle3 or +head=medusa")
    name = head.get("name")
    if name not in HEAD_CONFIGS:
        raise UserError(f"head.name={name!r}: expected one of {', '.join(HEAD_CONFIGS)}")
    try:
        root = OmegaConf.merge(OmegaConf.structured(RootConfig), cfg)
        root.head = OmegaConf.merge(OmegaConf.structured(HEAD_CONFIGS[name]), head)
        return OmegaConf.to_object(root)
    except OmegaConfBaseException as err:
        raise UserError(_one_line(err)) from None
