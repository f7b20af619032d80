"""The trainee of a run's head kind, built for the training loop (`trainer.trainee.Trainee`).

Apart from the trainee modules themselves, so that the main job and the time budget's training
probe both reach it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

from conf.schema import RootConfig


def build_trainee(cfg: RootConfig, target, data_dir: Path):
    if cfg.head.name == "eagle3":
        from trainer.eagle3_trainee import build_eagle3_trainee

        return build_eagle3_trainee(cfg, target, data_dir)
    from trainer.medusa_trainee import build_medusa_trainee

    return build_medusa_trainee(cfg, target, data_dir)
