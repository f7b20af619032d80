"""What `--help` prints: each key a command reads as `key=default  meaning`, grouped by section.

The keys are the schema's own (`conf.schema.leaf_fields`), so help can neither list a key the
config lacks nor miss one it has; the defaults are the values Hydra composed for the command line
given (`+head=medusa --help` shows Medusa's, `target=qwen2.5-coder-0.5b --help` that target's
budget). A meaning is the comment beside the key where a user meets it: in the YAML group that
sets it (`lr: 1.0e-3  # ...`), else beside its field in the class that declares it
(`conf/schema.py`; a head's in `conf/kinds.py`, its YAML keys bearing no comments), else the first
sentence of the comment above that field. Comments are read where they are written, not copied,
so help and conf/ cannot drift apart; `tests/unit/conf/test_cli_help.py` holds every key to a
meaning.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import re
import tokenize
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from conf.kinds import HEAD_CONFIGS
from conf.schema import RootConfig, leaf_fields

CONF = Path(__file__).parent
HELP_FLAGS = ("-h", "--help")
# key=value column width: most keys and defaults fit, a longer one pushes its meaning along
WIDTH = 44
MAX_MEANING = 110
_KEY_LINE = re.compile(r"^(\s*)([A-Za-z_]\w*):(.*)$")
_FIELD_LINE = re.compile(r"^    ([A-Za-z_]\w*): ")
_ABSENT = object()


def wants_help(argv: Sequence[str]) -> bool:
    """`-h` or `--help` anywhere on the command line (Hydra's own stays `--hydra-help`)."""
    return any(arg in HELP_FLAGS for arg in argv)


def answer_help(doc: str | None, argv: Sequence[str]) -> None:
    """A script's `--help` (`-h`): its docstring, which holds its usage line and what it does,
    printed, then exit 0 before anything runs (a benchmark's `--help` must not start one). For
    scripts that take `key=value` overrides, not argparse's options."""
    if wants_help(argv):
        print((doc or "").strip())
        raise SystemExit(0)


def yaml_comments(path: Path, prefix: str = "") -> dict[str, str]:
    """The comment beside each key of a YAML group file, by dotted key under `prefix` (a
    `# @package _global_` file's keys from the root). A comment on its own line above a key is
    not read: in conf/ those explain a choice (why this default) rather than what the key means."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if any(line.strip() == "# @package _global_" for line in lines):
        prefix = ""
    out: dict[str, str] = {}
    parents: list[tuple[int, str]] = []
    for line in lines:
        m = _KEY_LINE.match(line)
        if m is None:
            continue
        indent, key, rest = len(m[1]), m[2], m[3]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        value, _, comment = rest.partition(" #")
        if not value.strip():  # a mapping opens
            parents.append((indent, key))
            continue
        dotted = prefix + ".".join([p for _, p in parents] + [key])
        if comment.strip():
            out[dotted] = comment.strip()
    return out


def _first_sentence(text: str) -> str:
    """One line of a comment block: a leading heading word ("Architecture.") dropped, then up to
    the first full stop, cut at MAX_MEANING characters."""
    text = re.sub(r"^[A-Z]\w*\.\s+", "", " ".join(text.split()))
    text = re.split(r"(?<=\.)\s+(?=[A-Z`(\"'])", text, maxsplit=1)[0]
    return text if len(text) <= MAX_MEANING else text[: MAX_MEANING - 3].rstrip() + "..."


@functools.cache
def _class_comments(cls: type) -> dict[str, str]:
    """The comment of each field `cls` itself declares: beside it, else the block just above."""
    source = inspect.getsource(cls)
    beside = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    own = {f.name for f in dataclasses.fields(cls)} & set(vars(cls).get("__annotations__", {}))
    lines = source.splitlines()
    out: dict[str, str] = {}
    for i, line in enumerate(lines):
        m = _FIELD_LINE.match(line)
        if m is None or m[1] not in own or m[1] in out:
            continue
        if i + 1 in beside:
            out[m[1]] = beside[i + 1]
            continue
        above, j = [], i - 1
        while j >= 0 and lines[j].lstrip().startswith("#"):
            above.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        if above:
            out[m[1]] = _first_sentence(" ".join(above))
    return out


def schema_comment(cls: type, name: str) -> str:
    """The comment of field `name` of `cls`, from the class in its MRO that declares it."""
    for owner in cls.__mro__:
        if dataclasses.is_dataclass(owner) and name in vars(owner).get("__annotations__", {}):
            return _class_comments(owner).get(name, "")
    return ""


def _group_files(group: str, choice: str) -> list[Path]:
    """conf/<group>/<choice>.yaml, then the files its defaults list draws from the same group
    (`head/eagle3.1.yaml` is `eagle3` and two keys): a key the choice does not set is theirs. An
    absolute entry (`/kinds/eagle3@_here_`, every field of a head kind) is no file of the group."""
    path = CONF / group / f"{choice}.yaml"
    if not path.is_file():
        return []
    parents = OmegaConf.load(path).get("defaults") or []
    found = [path]
    for parent in parents:
        if isinstance(parent, str) and parent != "_self_" and not parent.startswith("/"):
            found += _group_files(group, parent)
    return found


def yaml_meanings(choices: dict[str, str]) -> dict[str, str]:
    """Each key's comment in the YAML that set it (the chosen group files, then config.yaml),
    else beside the same key in another option of its group (`target=qwen2.5-coder-0.5b` sets
    `target.revision` without a word; `target/smollm2.yaml` says what it means)."""
    out = yaml_comments(CONF / "config.yaml")
    for group in choices:
        for path in sorted((CONF / group).glob("*.yaml"), reverse=True):
            out = yaml_comments(path, f"{group}.") | out
    for group, choice in choices.items():
        for path in reversed(_group_files(group, choice)):
            out |= yaml_comments(path, f"{group}.")
    return out


def options(group: str) -> list[str]:
    """The choices of a config group: its YAML files' names."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def shown(value: object) -> str:
    """A value as it is typed on the command line (`null`, `true`, `[a, b]`)."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return str(value) if value != "" else "''"


def _default(cls: type, name: str) -> object:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def entry(key: str, value: str, meaning: str) -> str:
    """One help line: `  key=value  meaning` (`  key  meaning` for an argument with no default:
    a path), the meanings aligned where the keys allow."""
    left = f"  {key}={value}" if value else f"  {key}"
    return f"{left.ljust(WIDTH)}  {meaning}".rstrip() if meaning else left


def config_keys(cfg: DictConfig, shows: tuple[str, ...] | None = None) -> dict[str, tuple[object, type, str]]:
    """key -> (composed value, owning class, field) for the keys under the prefixes `shows`
    (None: all), the head's being those of the kind `cfg` chose."""
    fields = {k: v for k, v in leaf_fields(RootConfig).items() if k != "head"}
    fields |= leaf_fields(HEAD_CONFIGS[cfg.head.name], "head.")
    out = {}
    for key, (cls, name) in fields.items():
        if shows is not None and not any(key == s or key.startswith(f"{s}.") for s in shows):
            continue
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        out[key] = (_default(cls, name) if value is _ABSENT else value, cls, name)
    return out


def meanings(cfg: DictConfig, choices: dict[str, str], keys: Sequence[str]) -> dict[str, str]:
    """The one-line meaning of each of `keys` (see the module docstring for where it comes from)."""
    from_yaml = yaml_meanings(choices)
    found = config_keys(cfg)
    return {k: from_yaml.get(k) or schema_comment(found[k][1], found[k][2]) for k in keys}


def _section_title(section: str, choices: dict[str, str]) -> str:
    if not section:
        return "run"
    if section == "head":
        others = [o for o in options("head") if o != choices.get("head")]
        return f"head  (+head={choices.get('head')}; or {', '.join(others)})"
    if section in choices and len(options(section)) > 1:
        others = [o for o in options(section) if o != choices[section]]
        return f"{section}  ({section}={choices[section]}; or {', '.join(others)})"
    return section


def _yaml_order(node: DictConfig, prefix: str = "") -> list[str]:
    """The dotted keys of a composed config in the order its YAML files list them."""
    out: list[str] = []
    for key in node.keys():
        child = node._get_node(key)
        out += _yaml_order(child, f"{prefix}{key}.") if isinstance(child, DictConfig) else [f"{prefix}{key}"]
    return out


def _head_file_keys(choices: dict[str, str]) -> list[str]:
    """The `head.*` keys the chosen head's files list, in their order (the knobs a user tunes:
    the composed config holds every field of the kind, `conf/kinds.py`'s order)."""
    keys: list[str] = []
    for path in reversed(_group_files("head", choices.get("head", ""))):
        keys += [f"head.{k}" for k in OmegaConf.load(path) if k != "defaults"]
    return keys


def help_lines(cfg: DictConfig, choices: dict[str, str], shows: tuple[str, ...] | None = None) -> list[str]:
    """The config part of `--help`: sections (the run's top-level keys, the head, then each
    group in the schema's order), each key on one line with its composed default and meaning,
    in its YAML file's order (the schema's after them; a head's file-listed knobs first).
    `head.name` is left out: `+head=` chooses it, as the head's section title says."""
    keys = {k: v for k, v in config_keys(cfg, shows).items() if k != "head.name"}
    meaning = meanings(cfg, choices, list(keys))
    order = {k: i for i, k in enumerate(dict.fromkeys(_head_file_keys(choices) + _yaml_order(cfg)))}
    sections: dict[str, list[str]] = {"": [], "head": []}
    for key in sorted(keys, key=lambda k: order.get(k, len(order))):
        value = keys[key][0]
        sections.setdefault(key.rpartition(".")[0], []).append(entry(key, shown(value), meaning[key]))
    out: list[str] = []
    for section, lines in sections.items():
        if lines:
            out += ["", _section_title(section, choices), *lines]
    return out


def usage_text(
    usage: str,
    about: str,
    own: Sequence[tuple[str, str, str]] = (),
    config: Sequence[str] = (),
) -> str:
    """The whole `--help`: usage, what the command does, its own arguments (`own`: key, default,
    meaning), then the config's lines (`help_lines`)."""
    out = [f"usage: {usage}", "", about.strip()]
    if own:
        out += ["", "arguments", *(entry(k, v, m) for k, v, m in own)]
    if config:
        out += ["", "config overrides (key=value; a group's option with group=option)", *config]
    return "\n".join(out)
