"""Composing the root config from command-line overrides, for every entry point.

`trainer.train` and `data_prep.prepare` are Hydra apps; `hydra_main` composes their command line
once more before Hydra runs, so that every mistake (an unknown group, key, type or value) is one
line of ours, exit code 2, and nothing loaded. Commands that act on a saved head
(`head=<path> key=value ...`) compose through `compose_root` (see `heads.folder.compose_for_head`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from hydra import compose, initialize_config_module
from hydra.errors import HydraException, MissingConfigException

from conf.errors import UserError, exit_on_user_error, first_line
from conf.schema import RootConfig, to_root_config


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
    """The checked root config for `overrides`, or a one-line `UserError`."""
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            return to_root_config(compose(config_name="config", overrides=overrides))
    except MissingConfigException as err:  # an unknown choice of a config group
        group, _, choice = (err.missing_cfg_file or "").rpartition("/")
        if group and err.options:
            raise UserError(
                f"{group}={choice}: no such choice (conf/{group}/ has {', '.join(err.options)})"
            ) from None
        raise UserError(first_line(err)) from None
    except HydraException as err:
        raise UserError(first_line(err)) from None


@exit_on_user_error
def check_command_line(argv: list[str], *checks: Callable[[RootConfig], None]) -> RootConfig | None:
    """Compose the overrides in `argv` as Hydra will, exiting 2 with one line on any mistake.

    Hydra's own error path ends with its `HYDRA_FULL_ERROR` hint; composing first means the last
    line a user sees is ours. `checks` are the app's checks that need a layer above conf (the head
    kind's export formats: `heads.kinds.check_export_formats`). Hydra's flags (`--multirun`,
    `--cfg`, ...) and `hydra.*` overrides are left to Hydra."""
    if any(arg.startswith("-") for arg in argv):
        return None
    cfg = compose_root([arg for arg in argv if not arg.startswith("hydra.")])
    for check in checks:
        check(cfg)
    return cfg


def hydra_main(app: Callable[[], None], *checks: Callable[[RootConfig], None]) -> None:
    """Run a `@hydra.main` app after `check_command_line` accepted the command line."""
    check_command_line(sys.argv[1:], *checks)
    app()
