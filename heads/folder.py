"""The project's own head folder: `draftsmith_head.json` + `model.safetensors`, written atomically.

Both head kinds save through here, so the target fingerprint that stops a head from loading
against the wrong target is recorded and checked in one place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conf.compose import compose_root
from conf.errors import UserError, first_line
from conf.files import atomic_dir, commit_dir, read_json
from conf.schema import RootConfig

CONFIG_NAME = "draftsmith_head.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class TargetSpec:
    """What a head depends on in its target: a head trained for one refuses any other."""

    name_or_path: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int

    @classmethod
    def from_model(cls, model, name_or_path: str) -> TargetSpec:
        cfg = model.config.get_text_config()
        return cls(name_or_path, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers)

    def check(self, actual: TargetSpec, where: str) -> None:
        """Raise naming every field that differs; the name alone may differ (a moved folder)."""
        diffs = [
            f"{field} {getattr(self, field)} != {getattr(actual, field)}"
            for field in ("vocab_size", "hidden_size", "num_hidden_layers")
            if getattr(self, field) != getattr(actual, field)
        ]
        if diffs:
            raise UserError(
                f"{where}: head was trained for target {self.name_or_path!r} but the given target "
                f"{actual.name_or_path!r} differs: {'; '.join(diffs)}"
            )


def save_head(
    out_dir: str | Path, kind: str, config: dict, target: TargetSpec, tensors: dict
) -> Path:
    out = Path(out_dir)
    tmp = atomic_dir(out)
    meta = {"kind": kind, "target": asdict(target), "config": config}
    (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True))
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / WEIGHTS_NAME)
    commit_dir(tmp, out)
    return out


def read_head_meta(path: str | Path) -> dict:
    """`draftsmith_head.json` of a head folder: {kind, target, config}, or one line naming the
    folder and what is wrong (missing, cut off, not UTF-8, fields missing)."""
    meta_file = Path(path) / CONFIG_NAME
    if not meta_file.exists():
        raise UserError(f"head={str(path)!r}: no {CONFIG_NAME} there (not a draftsmith head folder)")
    meta = read_json(meta_file, f"head={str(path)!r}")
    missing = [k for k in ("kind", "target", "config") if k not in meta]
    if missing:
        raise UserError(f"head={str(path)!r}: {meta_file} lacks {', '.join(missing)}")
    return meta


def load_head(path: str | Path, kind: str) -> tuple[dict, TargetSpec, dict[str, torch.Tensor]]:
    meta = read_head_meta(path)
    if meta["kind"] != kind:
        raise UserError(f"head={str(path)!r}: a {meta['kind']!r} head, expected {kind!r}")
    weights = Path(path) / WEIGHTS_NAME
    try:
        tensors = load_file(weights)
    except FileNotFoundError:
        raise UserError(f"head={str(path)!r}: {weights} is missing") from None
    except Exception as err:  # safetensors raises its own error type for a cut-off file
        raise UserError(f"head={str(path)!r}: {weights} is not a readable safetensors file "
                        f"({first_line(err)})") from None
    try:
        target = TargetSpec(**meta["target"])
    except TypeError:
        raise UserError(f"head={str(path)!r}: {CONFIG_NAME} has a malformed 'target' entry") from None
    return meta["config"], target, tensors


def head_kind(path: str | Path) -> str:
    return read_head_meta(path)["kind"]


def compose_for_head(head_path: str, overrides: list[str]) -> RootConfig:
    """The root config for an existing head: its kind, and its target unless overridden."""
    if not head_path:
        raise UserError("head=<path> is required (a folder written by trainer.train)")
    meta = read_head_meta(head_path)
    extra = [f"+head={meta['kind']}"]
    if not any(o.startswith("target.name_or_path=") for o in overrides):
        extra.append(f"target.name_or_path={meta['target']['name_or_path']}")
    return compose_root(extra + overrides)
