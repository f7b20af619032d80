"""Every entry point answers `--help` with its keys, their defaults and a one-line meaning read from
the comments in conf/ (`conf.usage`), and an unknown key is one line naming the closest keys.

The `--help` and unknown-key runs are the commands as users type them (`python -m ...`), started
side by side: they load no model, so they cost an interpreter's imports each."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conf.compose import compose_root, compose_with_choices
from conf.errors import UserError
from conf.kinds import HEAD_CONFIGS
from conf.schema import DistConfig, TargetConfig, leaf_fields, schema_keys
from conf.usage import CONF, config_keys, help_lines, meanings, options, schema_comment, yaml_comments
from tests.support.cli import cli_env, error_lines, finish, start_cli

ROOT = Path(__file__).resolve().parents[3]
# A config line of --help: `  key=default  meaning`.
CONFIG_LINE = re.compile(r"^  (\S+?)=(.*?)\s{2,}(\S.*)$")
# entry point -> (arguments, lines its help holds, keys it must not list)
HELP = {
    "trainer.train": ([], ["optim.lr=0.001", "head.fc_norm=false", "budget=20m", "resume=false"], []),
    "data_prep.prepare": (["+head=medusa"], ["head.num_heads=4", "data.max_length=512"], ["optim.lr"]),
    "trainer.evaluate": ([], ["head=<path>", "eval.max_new_tokens=96", "target.device=auto"], ["optim.lr"]),
    "heads.export": ([], ["format=", "push_to_hub=", "export.dtype=bfloat16"], ["optim.lr", "data.source"]),
    "data_prep.show": ([], ["<data folder or run_dir>", "index=0", "format=text"], ["optim.lr"]),
}
UNKNOWN = ["+head=eagle3", "optim.lrr=1e-3"]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))


@pytest.fixture(scope="module")
def cwd(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


def script_dir(cwd: Path, script: str) -> Path:
    """Where a script's `--help` runs: a folder of its own, which must stay empty."""
    return cwd / script.removesuffix(".py")


@pytest.fixture(scope="module")
def runs(cwd) -> dict[str, tuple[int, str, str]]:
    """Each entry point's `--help`, check_vllm.py's with vllm and torch unimportable (its --help
    must answer from the main venv, which has no vllm), a main job with a misspelt key, and
    every script's `--help`."""
    started = {m: start_cli(m, [*args, "--help"], cwd) for m, (args, _, _) in HELP.items()}
    script = ROOT / "scripts" / "check_vllm.py"
    blocked = (
        "import runpy, sys; sys.modules.update(vllm=None, torch=None); "
        f"sys.argv = ['check_vllm.py', '--help']; runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    started["check_vllm"] = subprocess.Popen(
        [sys.executable, "-c", blocked], cwd=cwd, env=cli_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    started["unknown"] = start_cli("trainer.train", UNKNOWN, cwd)
    for name in SCRIPTS:
        script_dir(cwd, name).mkdir()
        started[name] = subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / name), "--help"], cwd=script_dir(cwd, name),
            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    return {name: finish(proc, timeout=300) for name, proc in started.items()}


@pytest.mark.parametrize("module", list(HELP))
def test_every_entry_point_answers_help(runs, module):
    code, out, err = runs[module]
    assert code == 0, err[-2000:]
    assert out.startswith(f"usage: python -m {module} ")
    _, holds, lacks = HELP[module]
    for text in holds:
        assert any(line.lstrip().startswith(text) for line in out.splitlines()), (text, out)
    listed = [m[1] for m in map(CONFIG_LINE.match, out.splitlines()) if m]
    assert listed and not [key for key in listed if key in lacks]
    # every line under "config overrides" is `key=default  meaning`
    config = out.partition("config overrides")[2].splitlines()[1:]
    keys = [line for line in config if line.startswith("  ")]
    assert [line for line in keys if not CONFIG_LINE.match(line)] == []


def test_main_job_help_lists_every_key_with_the_comment_beside_it_in_conf(runs):
    """The main job reads every key: its help lists the schema's keys for the composed head (the
    README's +head=eagle3 where none is given), each meaning the comment in conf/ itself."""
    out = runs["trainer.train"][1]
    shown = {m[1]: (m[2], m[3]) for m in map(CONFIG_LINE.match, out.splitlines()) if m}
    assert set(shown) == set(schema_keys("eagle3")) - {"head.name"}
    lr_comment = yaml_comments(CONF / "optim" / "adamw.yaml", "optim.")["optim.lr"]
    assert shown["optim.lr"] == ("0.001", lr_comment)
    assert "+head=eagle3; or " in out and "eagle3.1" in out  # the head choices


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_with_its_usage_and_runs_nothing(runs, script, cwd):
    """`python scripts/<script> --help` prints the docstring's summary and its usage (the command
    line it documents), exits 0 and runs nothing: no JSON line, nothing written where it ran."""
    code, out, err = runs[script]
    assert code == 0, err[-2000:]
    doc = ast.get_docstring(ast.parse((ROOT / "scripts" / script).read_text()))
    words = " ".join(out.split())  # argparse wraps the docstring's lines
    assert " ".join(doc.splitlines()[0].split()) in words
    usage = next(line.strip() for line in doc.splitlines() if f"scripts/{script}" in line)
    assert " ".join(usage.split()) in words or out.startswith("usage:"), (usage, out)  # argparse's own
    assert not any(line.startswith("{") for line in out.splitlines())
    assert list(script_dir(cwd, script).iterdir()) == []


def test_check_vllm_help_needs_no_vllm(runs):
    code, out, err = runs["check_vllm"]
    assert code == 0, err[-2000:]
    assert out.startswith("usage: check_vllm.py")
    for option, default in [("--prompts", "6"), ("--max-tokens", "64"), ("--k", "3"), ("--role", "vllm")]:
        assert re.search(rf"{option} .*?\S.*?\(default: {default}\)", out, re.S), option


def test_an_unknown_key_is_one_line_naming_the_closest(runs):
    code, out, err = runs["unknown"]
    assert (code, out) == (2, "")
    assert error_lines(err) == ["error: optim.lrr: no such key; closest: optim.lr"]


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["+head=eagle3", "head.fc_nrom=true"], "head.fc_nrom: no such key; closest: head.fc_norm"),
        # appended with `+`: Hydra takes it, the schema refuses it
        (["+head=eagle3", "+optim.lrr=1"], "optim.lrr: no such key; closest: optim.lr"),
        (["+head=eagle3", "+head.fc_nrom=true"], "head.fc_nrom: no such key; closest: head.fc_norm"),
        (["+head=eagle3", "lr=1e-3"], "lr: no such key; closest: optim.lr"),  # the group left out
        (["+head=eagle3.1", "head.norm_befor_fc=true"],
         "head.norm_befor_fc: no such key; closest: head.norm_before_fc"),
        (["+head=medusa", "head.num_head=2"], "head.num_head: no such key; closest: head.num_heads"),
        (["head.fc_norm=true"], "head.fc_norm: no head chosen; add +head=<name> before it, one of "
                                + ", ".join(HEAD_CONFIGS)),
        (["head=eagle3"], "head=eagle3: no head is in the defaults; add one with +head=eagle3"),
    ],
)
def test_unknown_keys_name_the_closest_valid_ones(overrides, line):
    with pytest.raises(UserError) as err:
        compose_root(overrides)
    assert str(err.value) == line


def test_no_close_key_points_to_help():
    with pytest.raises(UserError, match=r"^zzz: no such key; --help lists the keys$"):
        compose_root(["+head=eagle3", "zzz=1"])


def test_every_key_of_every_group_option_has_a_meaning():
    """A key added to the schema with no comment beside it in conf/ (nor in the schema) fails here,
    for every head group and every option of every other group."""
    setups = [[f"+head={h}"] for h in options("head")]
    setups += [["+head=eagle3", f"{g}={o}"] for g in ("target", "dist") for o in options(g)]
    for overrides in setups:
        cfg, choices = compose_with_choices(overrides)
        keys = [k for k in config_keys(cfg) if k != "head.name"]
        missing = [k for k, text in meanings(cfg, choices, keys).items() if not text]
        assert missing == [], overrides
        assert len(help_lines(cfg, choices)) > len(keys)


def test_help_shows_the_composed_defaults():
    cfg, choices = compose_with_choices(["+head=eagle3.1", "target=qwen2.5-coder-0.5b", "optim.lr=1e-4"])
    lines = {m[1]: m[2] for m in map(CONFIG_LINE.match, help_lines(cfg, choices)) if m}
    assert (lines["head.fc_norm"], lines["head.norm_before_fc"]) == ("true", "false")
    assert (lines["budget"], lines["optim.lr"]) == ("30m", "0.0001")
    assert lines["eval.tasks"] == "[mtbench, humaneval, gsm8k]"


def test_yaml_comments_follow_nesting_and_global_packages(tmp_path):
    group = tmp_path / "g.yaml"
    group.write_text(
        "# a block comment above is not a meaning\n"
        "a: 1          # the a\nb:\n  c: [x, y]   # the c\n  d: 2\ne: null  # the e\n"
    )
    assert yaml_comments(group, "g.") == {"g.a": "the a", "g.b.c": "the c", "g.e": "the e"}
    group.write_text("# @package _global_\nt:\n  k: 1  # the k\n")
    assert yaml_comments(group, "g.") == {"t.k": "the k"}


def test_schema_comments_beside_a_field_else_the_first_sentence_above():
    assert schema_comment(DistConfig, "zero_stage").startswith("DeepSpeed's ZeRO stage")
    assert schema_comment(TargetConfig, "device") == '"auto": cuda if available, else cpu.'
    # inherited fields are found in the class that declares them
    peagle, medusa = HEAD_CONFIGS["peagle"], HEAD_CONFIGS["medusa"]
    assert schema_comment(peagle, "loss") == schema_comment(medusa, "loss")
    assert schema_comment(medusa, "loss").startswith("The per-row loss: ce")
    # the first sentence of a long block, cut to one line
    assert schema_comment(peagle, "prompt_loss_weight").startswith("Rows that train, as the shared")
    assert len(schema_comment(medusa, "prompt_loss_weight")) <= 110
    # a head's keys mean what `conf/kinds.py` says: their YAML carries no comment
    assert schema_comment(HEAD_CONFIGS["dspark"], "num_layers").startswith("Qwen3-style draft layers")


def test_leaf_fields_are_the_schema_keys():
    keys = set(leaf_fields(HEAD_CONFIGS["dflash"], "head."))
    assert {"head.block_size", "head.loss"} <= keys
    assert {f"head.{f.name}" for f in dataclasses.fields(HEAD_CONFIGS["dflash"])} == keys
    assert "data.regenerate.top_p" in schema_keys() and "data.regenerate" not in schema_keys()
