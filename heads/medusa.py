"""Medusa heads: ResBlocks + a per-position lm_head on the target's final hidden state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MedusaConfig:
    """Hydra group `head/medusa`."""

    name: str = "medusa"
    num_heads: int = 4
    num_layers: int = 1
    head_weight: float = 0.8  # lambda_k = head_weight**k
    joint: bool = False  # Medusa-2: train the target too
    lora_rank: int = 0  # > 0: LoRA on the target instead of full fine-tuning (joint only)
    head_lr_scale: float = 4.0
    joint_head_loss_scale: float = 0.2
    self_distill: bool = True
