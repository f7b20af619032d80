"""The project's own head folder: `draftsmith_head.json` + `model.safetensors`, written atomically.

Both head kinds save through here, so the target fingerprint that stops a head from loading
against the wrong target is recorded and checked in one place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.errors import UserError

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


def atomic_dir(final: Path) -> Path:
    """A fresh temporary sibling of `final`; `commit_dir` renames it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` into place, readable by all: mkdtemp makes 0700 folders (and safetensors 0600
    files), but an engine in a container running as another user, or a teammate, must read them."""
    tmp.chmod(0o755)
    for f in tmp.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


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


def load_head(path: str | Path, kind: str) -> tuple[dict, TargetSpec, dict[str, torch.Tensor]]:
    folder = Path(path)
    meta_file = folder / CONFIG_NAME
    if not meta_file.exists():
        raise UserError(f"head={str(path)!r}: no {CONFIG_NAME} there (not a draftsmith head folder)")
    meta = json.loads(meta_file.read_text())
    if meta.get("kind") != kind:
        raise UserError(f"head={str(path)!r}: a {meta.get('kind')!r} head, expected {kind!r}")
    return meta["config"], TargetSpec(**meta["target"]), load_file(folder / WEIGHTS_NAME)


def head_kind(path: str | Path) -> str:
    meta_file = Path(path) / CONFIG_NAME
    if not meta_file.exists():
        raise UserError(f"head={str(path)!r}: no {CONFIG_NAME} there (not a draftsmith head folder)")
    return json.loads(meta_file.read_text())["kind"]
