"""The README's commands, run as a person types them, on what the first one wrote.

The main-job line runs as written with nothing added but `budget=` (about the smallest the planner
accepts on CI's 2-core machine) and a fresh `data.cache_dir`, under a pseudo-terminal so every
progress bar draws as it does on a screen, in a fresh working directory, so its run_dir is the
README's own `outputs/eagle3`. Then the README's export, `data_prep.show`, `check_vllm.py` and
evaluate lines run there on what it wrote. The real SmolLM2 and the packaged data throughout.

The main job once died at the first regenerated answer, on the progress bar's path, while every
test passed `logging.progress=false`; tests/conftest.py states the rule that came of it.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_in_terminal

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# About the smallest budget the planner accepts here: on a quiet 2-core machine it planned 9m at
# 8.5 minutes (probes 3, evaluation 4); 12m leaves room for a slower CPU. Beside another test
# process the probes took 8 minutes (capture at a quarter of its speed) and 15m was refused in
# one line, so CI runs this module alone, after the two lanes (.ci/run).
BUDGET = "budget=12m"
RUN = Path("outputs/eagle3")

pytestmark = pytest.mark.slow


def readme_line(start: str) -> str:
    """The first line of a fenced block of the README that starts with `start`, its comment and
    `[optional]` parts dropped."""
    fenced = False
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith(start):
            return re.sub(r"\s*\[[^\]]*\]", "", line.split("  #")[0]).strip()
    raise AssertionError(f"the README has no command starting {start!r}")


def as_typed(line: str) -> list[str]:
    """A README line's argv; `python` is this venv's, as after the README's install line."""
    argv = shlex.split(line)
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> tuple[Path, int, str]:
    """A user's working directory after the README's main job: (it, exit code, the screen)."""
    home = tmp_path_factory.mktemp("user")
    (home / "scripts").symlink_to(ROOT / "scripts")
    if VLLM_PYTHON.exists():
        (home / ".venv-vllm").symlink_to(ROOT / ".venv-vllm")
    added = [BUDGET, f"data.cache_dir={home / 'cache'}"]
    argv = as_typed(readme_line("python -m trainer.train +head=eagle3")) + added
    assert argv[3:] == ["+head=eagle3", *added]  # nothing else added
    code, screen = run_in_terminal(argv, home, timeout=40 * 60)
    return home, code, screen


def test_the_main_job_runs_as_typed_and_ends_speaking_to_a_person(user):
    home, code, screen = user
    assert code == 0 and "Traceback" not in screen and "[INFO]" not in screen, screen[-4000:]
    assert re.search(r"^plan: \d+ conversations", screen, re.M), screen[-4000:]
    # The bars drew (the regeneration bar's path is where the README's command once died; a
    # small budget's plan reuses the regeneration probe's answers, so the probe draws it).
    for bar in ("regenerate: 100%", "train", "evaluate"):
        assert bar in screen, bar
    lines = [line for line in screen.replace("\r\n", "\n").replace("\r", "\n").splitlines() if line.strip()]
    done = next(i for i, line in enumerate(lines) if line.startswith("done in "))
    end = lines[done:done + 6]
    assert " min: τ 1." in end[0] and "mtbench" in end[0] and "prompts per task" in end[0]
    # the train-versus-serve gap: the kept head's simulated τ against the decoded and evaluated
    gap = end.pop(1)
    assert gap.startswith("τ gap: the kept head (step ") and "τ overstates the evaluated one" in gap
    eval_md = (home / RUN / "eval" / "eval.md").read_text()
    assert "Validation in training against decoding: the kept head" in eval_md
    run = (home / RUN).resolve()
    assert end[1].startswith("lossless: yes") and end[1].endswith(str(RUN / "eval" / "eval.md"))
    exports = f"{RUN / 'export' / 'eagle3'}, {RUN / 'export' / 'speculators'}"
    assert end[2] == f"head: {RUN / 'head'}; exports: {exports}"
    assert end[3] == f"serve: vllm serve {run / 'export' / 'speculators'}"
    assert end[4] == f"details: {RUN / 'summary.json'}, {RUN / 'training.png'}"
    assert (run / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert "![Per-position acceptance](acceptance.png)" in (run / "eval" / "eval.md").read_text()
    for fmt in ("eagle3", "speculators"):
        export = run / "export" / fmt
        assert (export / "acceptance.png").read_bytes() == (run / "eval" / "acceptance.png").read_bytes()
        assert "![Per-position acceptance](acceptance.png)" in (export / "README.md").read_text()
    assert json.loads((run / "summary.json").read_text())["mean_acceptance_length"] > 1


def typed(user: tuple[Path, int, str], start: str, timeout: float = 900) -> str:
    """What the README's line starting `start` showed, run as typed where the main job ran; it
    must have exited 0 (as must the main job before it)."""
    home, code, _ = user
    assert code == 0, "the main job failed"
    code, screen = run_in_terminal(as_typed(readme_line(start)), home, timeout)
    assert code == 0, screen[-3000:]
    return screen


def test_the_readme_export_and_show_lines_run_on_what_it_wrote(user):
    typed(user, "python -m heads.export ")
    out = user[0] / shlex.split(readme_line("python -m heads.export "))[-1].removeprefix("out=")
    wrote = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "acceptance.png"} <= wrote
    assert "\nsample 0 (" in "\n" + typed(user, "python -m data_prep.show ")


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}")
def test_the_readme_check_vllm_line_serves_both_exports(user):
    screen = typed(user, ".venv-vllm/bin/python scripts/check_vllm.py")
    reports = [json.loads(line) for line in screen.splitlines() if line.startswith('{"')]
    assert [Path(r["export"]).name for r in reports] == ["eagle3", "speculators"]
    assert all(r["loaded"] and r["greedy_text_match"] for r in reports), reports


def test_the_readme_evaluate_line_evaluates_the_head(user):
    screen = typed(user, "python -m trainer.evaluate head=")
    assert "lossless True" in screen and str(RUN / "eval" / "eval.md") in screen
