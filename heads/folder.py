"""The project's own head folder: `draftsmith_head.json` + `model.safetensors`, written atomically.

Both head kinds save through here, so the target fingerprint that stops a head from loading
against the wrong target is recorded and checked in one place; so are the weights' checksum
(`weights_sha256`: a damaged copy is refused, not served) and their finiteness (a head from a
diverged run is never evaluated, exported or pushed: every consumer loads through `load_head`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from conf.compose import compose_root
from conf.errors import UserError, first_line
from conf.files import check_sha256, read_json, sha256_file, staged_dir
from conf.kinds import HEAD_CONFIGS
from conf.schema import TEMPLATE_FIELDS, RootConfig, derive

CONFIG_NAME = "draftsmith_head.json"
WEIGHTS_NAME = "model.safetensors"
CHECKSUM = "weights_sha256"  # optional in CONFIG_NAME: heads saved before it load unchecked


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
    with staged_dir(out) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / WEIGHTS_NAME)
        meta = {"kind": kind, "target": asdict(target), "config": config}
        meta[CHECKSUM] = sha256_file(tmp / WEIGHTS_NAME)
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out


@contextmanager
def _weights_file(path: Path, what: str) -> Iterator[None]:
    """Turn a missing, cut-off or foreign safetensors file into one line naming it (safetensors
    raises its own error type, with a message that does not say which file)."""
    try:
        yield
    except FileNotFoundError:
        raise UserError(f"{what}: {path} does not exist") from None
    except (SafetensorError, OSError) as err:
        raise UserError(
            f"{what}: {path} is not a readable safetensors file ({first_line(err)})"
        ) from None


def read_weights(path: Path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (a head's or an export's), or one line naming it."""
    with _weights_file(path, what):
        return load_file(path)


def read_head_meta(path: str | Path) -> dict:
    """`draftsmith_head.json` of a head folder: {kind, target, config}, or one line naming the
    file and what is wrong (missing, cut off, not UTF-8, fields missing or malformed), so that no
    caller trips over a half-written or hand-edited file later."""
    where = f"head={str(path)!r}"
    meta_file = Path(path) / CONFIG_NAME
    if not meta_file.exists():
        raise UserError(f"{where}: no {CONFIG_NAME} there (not a draftsmith head folder)")
    meta = read_json(meta_file, where)
    missing = [k for k in ("kind", "target", "config") if k not in meta]
    if missing:
        raise UserError(f"{where}: {meta_file} lacks {', '.join(missing)}")
    if not isinstance(meta["kind"], str) or meta["kind"] not in HEAD_CONFIGS:
        raise UserError(
            f"{where}: {meta_file} has kind {meta['kind']!r}, expected one of {', '.join(HEAD_CONFIGS)}"
        )
    spec_fields = sorted(f.name for f in fields(TargetSpec))
    if not isinstance(meta["target"], dict) or sorted(meta["target"]) != spec_fields:
        raise UserError(f"{where}: {meta_file}: 'target' must hold exactly {', '.join(spec_fields)}")
    if not isinstance(meta["config"], dict):
        raise UserError(f"{where}: {meta_file}: 'config' must be an object")
    digest = meta.get(CHECKSUM)
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64):
        raise UserError(f"{where}: {meta_file}: {CHECKSUM!r} must be a sha256 hex digest")
    return meta


def nonfinite_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating tensors holding a NaN or an infinity, in name order."""
    return sorted(k for k, v in tensors if v.is_floating_point() and not torch.isfinite(v).all())


def retrain_hint(path: Path) -> str:
    """What to do about a damaged head folder at `path` (the run's config.json is beside it)."""
    return (
        f"restore the folder from a good copy or train it again (python -m trainer.train "
        f"with the overrides in {path.parent / 'config.json'})"
    )


def check_head_weights(path: Path, meta: dict, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse weights that differ from the checksum saved with them, or that are not finite (a
    diverged run's: they would decode garbage, and engines serve them without a word).
    `tensors`: (name, tensor) pairs, loaded or read one at a time."""
    where, weights = f"head={str(path)!r}", path / WEIGHTS_NAME
    if CHECKSUM in meta:
        check_sha256(weights, meta[CHECKSUM], where, path / CONFIG_NAME, retrain_hint(path))
    bad = nonfinite_tensors(tensors)
    if bad:
        raise UserError(
            f"{where}: {weights} holds non-finite weights ({len(bad)} tensor(s), first {bad[0]}): "
            "the run that wrote it diverged; it is not evaluated, exported or pushed (train again "
            "with a lower optim.lr)"
        )


def load_head(path: str | Path, kind: str) -> tuple[dict, TargetSpec, dict[str, torch.Tensor]]:
    """(config, target fingerprint, tensors) of a saved head of `kind`, or one line naming the
    file that is missing, cut off, of another kind, damaged (checksum) or not finite."""
    meta = read_head_meta(path)
    if meta["kind"] != kind:
        raise UserError(f"head={str(path)!r}: a {meta['kind']!r} head, expected {kind!r}")
    tensors = read_weights(Path(path) / WEIGHTS_NAME, f"head={str(path)!r}")
    check_head_weights(Path(path), meta, tensors.items())
    return meta["config"], TargetSpec(**meta["target"]), tensors


def head_kind(path: str | Path) -> str:
    """The kind of a saved head ("eagle3", "medusa"), from its checked metadata."""
    return read_head_meta(path)["kind"]


def run_config(head_path: Path) -> dict:
    """The config the head was trained with, from the run folder around it ({} if none)."""
    run_dir = head_path.resolve().parent
    if (run_dir / "config.json").exists():
        return read_json(run_dir / "config.json", "run config")
    hydra_cfg = run_dir / "hydra" / "config.yaml"
    if hydra_cfg.exists():
        from omegaconf import OmegaConf

        return OmegaConf.to_container(OmegaConf.load(hydra_cfg))
    return {}


def compose_for_head(head_path: str, overrides: list[str]) -> RootConfig:
    """The root config for an existing head: its kind, its target, the chat template settings of
    the run that trained it (prompts render as they were trained on) and that run's folder (where
    the head sits in one), unless overridden.

    The head folder is checked first (metadata, the weights' header, checksum and finiteness, a
    tensor at a time: a Medusa head of a large target holds several vocabulary-sized matrices), so
    a broken head is one line before any command built on this loads a target."""
    if not head_path:
        raise UserError("head=<path> is required (a folder written by trainer.train)")
    meta = read_head_meta(head_path)
    weights = Path(head_path) / WEIGHTS_NAME
    with _weights_file(weights, f"head={head_path!r}"), safe_open(weights, "pt") as f:
        check_head_weights(Path(head_path), meta, ((k, f.get_tensor(k)) for k in f.keys()))
    extra = [f"+head={meta['kind']}"]
    if not any(o.startswith("target.name_or_path=") for o in overrides):
        extra.append(f"target.name_or_path={meta['target']['name_or_path']}")
    cfg = compose_root(extra + overrides)
    run = run_config(Path(head_path))
    data = run.get("data") or {}
    # A head evaluates on prompts rendered as it was trained, unless the overrides say otherwise.
    trained = {
        f"data.{key}": data[key]
        for key in TEMPLATE_FIELDS
        if data.get(key) is not None and not any(o.startswith(f"data.{key}=") for o in overrides)
    }
    # ... and in its own run folder (its `eval/`), not the kind's default one: `+head=eagle3.1`
    # trains in outputs/eagle3.1, whose head composes as `+head=eagle3` above.
    if run and not any(o.startswith("run_dir=") for o in overrides):
        trained["run_dir"] = str(Path(head_path).parent)
    return derive(cfg, trained)
