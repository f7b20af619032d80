"""Every entry point answers `--help`, run as users type it (`python -m ...`), with its keys, their
defaults and a one-line meaning read from the comments in conf/ (`conf.usage`); check_vllm.py's
answers without vllm; every script answers with its usage and runs nothing; an unknown key on the
command line is one line naming the closest.

The runs are started side by side: they load no model, so they cost an interpreter's imports
each (13-22 s of both cores in all, the unit tier's largest fixture once: moved here from
tests/unit/conf/test_cli_help.py, which keeps the in-process tests of the same help and keys)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conf.schema import schema_keys
from conf.usage import CONF, yaml_comments
from tests.support.cli import CONFIG_LINE, cli_env, error_lines, finish, start_cli

ROOT = Path(__file__).resolve().parents[2]
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

pytestmark = pytest.mark.slow  # 7 interpreters and one per script, side by side


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
