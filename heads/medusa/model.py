"""Medusa heads: ResBlocks + a per-head lm_head on the target's final hidden state (post-norm).

Parameter names are the ones vLLM's Medusa loader reads (`blocks.{h}.layers.{l}.weight/.bias`,
`lm_heads.{h}.weight`), so export is a copy; that loader silently drops unknown names, which is
why the names are fixed here and nowhere else. The ResBlock bias is on (`fc_bias`): it is the
original Medusa and TGI layout, and vLLM reads it with `medusa_fc_bias: true`.

A head trained jointly with its target (Medusa-2) is only right for the target it was trained
with, so its folder also carries that target's update in `target/`: a peft LoRA adapter
(`adapter_config.json` + `adapter_model.safetensors`, `target_update="lora"`) or a full
Hugging Face model folder (`target_update="full"`). `load_joint_target` rebuilds that target.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from conf.errors import UserError
from conf.files import check_sha256, read_json, sha256_file
from conf.kinds import MedusaConfig
from heads.folder import TargetSpec, load_head, read_head_meta, retrain_hint, save_head

TARGET_DIR = "target"
TARGET_SUMS = "checksums.json"  # in TARGET_DIR: {weights file: sha256}, checked before it loads
TARGET_UPDATES = (None, "lora", "full")


def head_config(target_config, cfg: MedusaConfig) -> dict:
    """The JSON-able description a head folder records: shapes plus how the target was changed."""
    t = target_config.get_text_config()
    return {
        "num_heads": cfg.num_heads,
        "num_layers": cfg.num_layers,
        "hidden_size": t.hidden_size,
        "vocab_size": t.vocab_size,
        "fc_bias": cfg.fc_bias,
        "target_update": ("lora" if cfg.lora_rank > 0 else "full") if cfg.joint else None,
    }


def captured_layers(cfg: MedusaConfig, num_hidden_layers: int) -> tuple[tuple[int, ...], int | None]:
    """(aux layer ids, final layer id) the heads train on: the final hidden state; none for
    Medusa-2, which runs the target itself during training."""
    return (), None if cfg.joint else num_hidden_layers


class MedusaBlock(nn.Module):
    """`num_layers` residual steps x + SiLU(W x + b); W and b start at zero, so the identity."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers)
        )
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHead(nn.Module):
    """`num_heads` blocks, each followed by its own full-vocabulary lm_head."""

    kind = "medusa"

    def __init__(self, config: dict, target: TargetSpec):
        super().__init__()
        if config.get("target_update") not in TARGET_UPDATES:
            raise UserError(
                f"medusa head config target_update={config.get('target_update')!r}: expected "
                "null, 'lora' or 'full'"
            )
        self.config, self.target = dict(config), target
        self.num_heads, self.num_layers = config["num_heads"], config["num_layers"]
        h, v = config["hidden_size"], config["vocab_size"]
        self.blocks = nn.ModuleList(
            MedusaBlock(h, self.num_layers, config["fc_bias"]) for _ in range(self.num_heads)
        )
        self.lm_heads = nn.ModuleList(
            nn.Linear(h, v, bias=False) for _ in range(self.num_heads)
        )

    @classmethod
    def from_target(cls, target_model, target_name: str, cfg: MedusaConfig) -> MedusaHead:
        """A fresh head: identity blocks, every lm_head a copy of the target's."""
        spec = TargetSpec.from_model(target_model, target_name)
        head = cls(head_config(target_model.config, cfg), spec)
        target_lm = target_model.get_output_embeddings().weight.detach().float()
        for lm in head.lm_heads:
            lm.weight.data.copy_(target_lm)
        return head

    def forward(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """[B,T,H] post-norm target hidden -> [num_heads,B,T,V] logits; head k at position t
        predicts the token at t+2+k (the target's own lm_head gives t+1)."""
        x = final_hidden.to(self.lm_heads[0].weight.dtype)
        return torch.stack([lm(block(x)) for block, lm in zip(self.blocks, self.lm_heads)])

    def save_pretrained(self, out_dir: str | Path, state: dict | None = None) -> Path:
        """`state` replaces the live weights (ZeRO-3 gathers them elsewhere)."""
        return save_head(out_dir, self.kind, self.config, self.target, state or self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path, target_model, target_name: str) -> MedusaHead:
        """Load saved heads against `target_model`; refuse heads trained for another target."""
        config, spec, tensors = load_head(path, cls.kind)
        spec.check(TargetSpec.from_model(target_model, target_name), f"head={str(path)!r}")
        head = cls(config, spec)
        missing, unexpected = head.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise UserError(f"head={str(path)!r}: missing {missing}, unexpected {unexpected}")
        return head


def write_target_checksums(folder: Path) -> None:
    """Record the sha256 of each weights file of a jointly trained target (`TARGET_SUMS`): the
    head's own weights carry one, and a damaged target copy would otherwise verify with other
    weights than it was trained with, silently."""
    sums = {f.name: sha256_file(f) for f in sorted(folder.glob("*.safetensors"))}
    (folder / TARGET_SUMS).write_text(json.dumps(sums, indent=2))


def check_target_checksums(path: Path, folder: Path) -> None:
    """Refuse a jointly trained target whose weights differ from what `write_target_checksums`
    recorded (folders saved before it load unchecked)."""
    record = folder / TARGET_SUMS
    if not record.exists():
        return
    where = f"head={str(path)!r}"
    for name, digest in read_json(record, where).items():
        check_sha256(folder / name, digest, where, record, retrain_hint(path))


def load_joint_target(path: str | Path, target_model):
    """The target a Medusa head folder was trained with, ready for decoding.

    Medusa-1 heads: `target_model` itself. Medusa-2 heads: a new model (the given one is left
    untouched, it stays the baseline): the LoRA adapter of `<path>/target` merged into a copy of
    `target_model`, or the fully fine-tuned model saved there, on the same device and dtype.
    """
    update = read_head_meta(path)["config"].get("target_update")
    if update is None:
        return target_model
    folder = Path(path) / TARGET_DIR
    marker = "adapter_config.json" if update == "lora" else "config.json"
    if not (folder / marker).exists():
        raise UserError(
            f"head={str(path)!r}: trained jointly with its target ({update}) but "
            f"{TARGET_DIR}/{marker} is missing"
        )
    check_target_checksums(Path(path), folder)
    if update == "lora":
        from peft import PeftModel

        adapted = PeftModel.from_pretrained(copy.deepcopy(target_model), str(folder))
        model = adapted.merge_and_unload()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=target_model.dtype)
    return model.to(target_model.device).eval().requires_grad_(False)


def load_for_decoding(path: str | Path, target_model, target_name: str) -> tuple[MedusaHead, object]:
    """(heads, the model that verifies their drafts) for decoding: a jointly trained Medusa-2
    head verifies with its own target."""
    head = MedusaHead.from_pretrained(path, target_model, target_name)
    return head, load_joint_target(path, target_model)
