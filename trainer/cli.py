"""Command lines that act on a saved head: `head=<path> key=value ...`.

`head` is a Hydra config group (`+head=eagle3`), so Hydra would read `head=<path>` as a group
choice. These commands take the path themselves, read the head's kind and target from its folder,
and compose the same root config with `+head=<kind>`: one config tree for every entry point.
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.errors import HydraException

from heads.folder import CONFIG_NAME, head_kind
from trainer.config import RootConfig, validate
from trainer.errors import UserError


def split_args(argv: list[str], own_keys: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Pull `key=value` for `own_keys` out of argv; the rest are Hydra overrides."""
    own: dict[str, str] = {}
    rest: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in own_keys:
            own[key] = value
        else:
            rest.append(arg)
    return own, rest


def compose_root(overrides: list[str]) -> RootConfig:
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            return validate(compose(config_name="config", overrides=overrides))
    except HydraException as err:
        raise UserError(str(err).strip().splitlines()[0]) from None


def compose_for_head(head_path: str, overrides: list[str]) -> RootConfig:
    """The root config for an existing head: its kind, and its target unless overridden."""
    if not head_path:
        raise UserError("head=<path> is required (a folder written by trainer.train)")
    kind = head_kind(head_path)
    extra = [f"+head={kind}"]
    if not any(o.startswith("target.name_or_path=") for o in overrides):
        target = json.loads((Path(head_path) / CONFIG_NAME).read_text())["target"]["name_or_path"]
        extra.append(f"target.name_or_path={target}")
    return compose_root(extra + overrides)
