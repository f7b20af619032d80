"""Console, tensorboard and wandb logging from rank 0; wandb never goes online unless told to."""

from __future__ import annotations

from pathlib import Path

from conf.schema import LoggingConfig


class RunLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, enabled: bool, config: dict):
        self.cfg, self.enabled = cfg, enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.wandb != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb_project, mode=cfg.wandb, dir=str(run_dir), config=config
            )

    def log(self, step: int, metrics: dict[str, float], prefix: str) -> None:
        if not self.enabled:
            return
        named = {f"{prefix}/{k}": v for k, v in metrics.items()}
        if self.tb is not None:
            for k, v in named.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(named, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
