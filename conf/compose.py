"""Composing the root config from command-line overrides, for every entry point.

`trainer.train` and `data_prep.prepare` are Hydra apps; `hydra_main` composes their command line
once more before Hydra runs, so that every mistake (an unknown group, key, type or value) is one
line of ours, exit code 2, and nothing loaded. Commands that act on a saved head
(`head=<path> key=value ...`) compose through `compose_root` (see `heads.folder.compose_for_head`).
`--help` on any of them prints the keys it reads, their defaults and meanings (`conf.usage`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from conf.errors import UserError, exit_on_user_error, first_line, no_such_key
from conf.kinds import HEAD_CONFIGS
from conf.schema import RootConfig, schema_keys, to_root_config
from conf.usage import help_lines, usage_text, wants_help

CONF = Path(__file__).parent
_NOT_OVERRIDDEN = re.compile(r"Could not override '([^']+)'")


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


def _override_key(arg: str) -> str:
    return arg.lstrip("+~").partition("=")[0]


def _head_name(overrides: list[str]) -> str | None:
    """The head kind `overrides` choose, composed from their group choices alone (`+head=eagle3.1`
    names a file, not a kind), so that a typo's closest keys are that head's; None when that
    fails too: the suggestion then draws on every kind's keys."""
    choices = [o for o in overrides if "." not in _override_key(o)]
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            return compose(config_name="config", overrides=choices).head.name
    except Exception:  # only a better suggestion is lost; the error being reported stands
        return None


def _hydra_error(err: HydraException, overrides: list[str]) -> UserError:
    """Hydra's error as one line. Hydra says only "Could not override 'optim.lrr'" for a key the
    config lacks: ours names the closest keys (`conf.errors.no_such_key`)."""
    m = _NOT_OVERRIDDEN.match(str(err))
    if m is None:
        return UserError(first_line(err))
    key, cause = m[1], err.__cause__
    if not isinstance(cause, (ConfigKeyError, ConfigAttributeError)):  # `head=eagle3`, no `+`
        arg = next((o for o in overrides if _override_key(o) == key), key)
        if (CONF / key).is_dir():
            return UserError(f"{arg}: no {key} is in the defaults; add one with +{arg}")
        return UserError(first_line(err))
    if getattr(cause, "full_key", None) == "head":  # `head.fc_norm=true` with no +head=
        kinds = ", ".join(HEAD_CONFIGS)
        return UserError(f"{key}: no head chosen; add +head=<name> before it, one of {kinds}")
    return no_such_key(key, schema_keys(_head_name(overrides)))


@contextmanager
def _one_line_errors(overrides: list[str]) -> Iterator[None]:
    """Hydra's composition errors as one-line `UserError`s."""
    try:
        yield
    except MissingConfigException as err:  # an unknown choice of a config group
        group, _, choice = (err.missing_cfg_file or "").rpartition("/")
        if group and err.options:
            raise UserError(
                f"{group}={choice}: no such choice (conf/{group}/ has {', '.join(err.options)})"
            ) from None
        raise UserError(first_line(err)) from None
    except HydraException as err:
        raise _hydra_error(err, overrides) from None


def _compose(overrides: list[str]) -> DictConfig:
    """Hydra's composed config for `overrides`, its own `hydra` node taken out but kept as the
    `HydraConfig` `@hydra.main` sets, so `${hydra:...}` reads alike in every command (`run_dir`
    names the head's config choice: `+head=eagle3.1` runs in outputs/eagle3.1)."""
    with _one_line_errors(overrides), initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def compose_root(overrides: list[str]) -> RootConfig:
    """The checked root config for `overrides`, or a one-line `UserError`."""
    return to_root_config(_compose(overrides))


def compose_with_choices(overrides: list[str]) -> tuple[DictConfig, dict[str, str]]:
    """Hydra's composed config for `overrides` (checked as `compose_root` checks it) and the
    option each config group took (`{"head": "eagle3.1", "target": "smollm2", ...}`): what
    `--help` shows, with the comments of the files those options name."""
    cfg = _compose(overrides)
    choices = {g: c for g, c in HydraConfig.get().runtime.choices.items() if c and not g.startswith("hydra")}
    to_root_config(cfg)
    return cfg, choices


def print_help(
    usage: str,
    about: str,
    overrides: Sequence[str] = (),
    shows: tuple[str, ...] | None = None,
    own: Sequence[tuple[str, str, str]] = (),
) -> None:
    """Print a command's `--help`: `usage`, `about`, its own arguments (`own`: key, default,
    meaning) and the config keys under the prefixes `shows` (None: all; (): none) with the
    defaults `overrides` compose to (`+head=eagle3` where they choose no head)."""
    config: list[str] = []
    if shows != ():
        args = [a for a in overrides if a not in ("-h", "--help") and not a.startswith("hydra.")]
        if not any(_override_key(a) == "head" for a in args):
            args = ["+head=eagle3", *args]
        config = help_lines(*compose_with_choices(args), shows)
    print(usage_text(usage, about, own, config))


def _main_module() -> str:
    """The module `python -m` runs (`trainer.train`)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem


@exit_on_user_error
def check_command_line(
    argv: list[str], *checks: Callable[[RootConfig], None], shows: tuple[str, ...] | None = None
) -> RootConfig | None:
    """Compose the overrides in `argv` as Hydra will, exiting 2 with one line on any mistake.

    Hydra's own error path ends with its `HYDRA_FULL_ERROR` hint; composing first means the last
    line a user sees is ours. `checks` are the app's checks that need a layer above conf (the head
    kind's export formats: `heads.kinds.check_export_formats`). `--help` prints ours (the keys
    under `shows`, see `print_help`) and exits 0: Hydra's lists the composed YAML without a word
    on what a key means. Hydra's other flags (`--hydra-help`, `--multirun`, `--cfg`, ...) and
    `hydra.*` overrides are left to Hydra."""
    if wants_help(argv):
        module = _main_module()
        about = (sys.modules["__main__"].__doc__ or "").strip().split("\n\n")[0]
        print_help(f"python -m {module} +head=<name> [group=option ...] [key=value ...]", about, argv, shows)
        sys.exit(0)
    if any(arg.startswith("-") for arg in argv):
        return None
    cfg = compose_root([arg for arg in argv if not arg.startswith("hydra.")])
    for check in checks:
        check(cfg)
    return cfg


def hydra_main(
    app: Callable[[], None], *checks: Callable[[RootConfig], None], shows: tuple[str, ...] | None = None
) -> None:
    """Run a `@hydra.main` app after `check_command_line` accepted the command line; its
    `--help` lists the keys under `shows` (None: every key, as the main job reads them all)."""
    check_command_line(sys.argv[1:], *checks, shows=shows)
    app()
