"""`python -m heads.export` as users run it: one JSON line, one line naming a broken file of a
head (also from `trainer.evaluate`), and no half folder under its name after a kill -9."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from heads.export.write import export_head
from tests.support.cli import cli_env
from tests.support.heads import cut_in_half, make_eagle3_head, not_utf8, without_target


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_eagle3_head(tiny_llama_dir, tmp_path_factory.mktemp("heads") / "head")


def copy_head(head_dir: Path, to: Path) -> Path:
    to.mkdir(parents=True)
    for f in head_dir.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


CORRUPTIONS = {
    "cut-off-json": ("draftsmith_head.json", cut_in_half, "is not valid JSON"),
    "cut-off-weights": ("model.safetensors", cut_in_half, "is not a readable safetensors file"),
    "not-utf8-json": ("draftsmith_head.json", not_utf8, "is not UTF-8 text"),
    "json-lacks-target": ("draftsmith_head.json", without_target, "lacks target"),
}


# `python -m heads.export` that SIGKILLs itself at `argv[1]`: "writing" (the new folder written
# under its temporary name, not yet checked), "swapping" (the old export renamed aside, the new
# one not yet in place), "cleaning" (the new one in place, the old one half deleted).
KILLED_EXPORT = r"""
import os, shutil, signal, sys
from pathlib import Path
import heads.export.write as E
point = sys.argv[1]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
real_verify, real_replace, real_rmtree = E.verify_export, os.replace, shutil.rmtree
def verify(*args):
    if point == "writing":
        die()
    return real_verify(*args)
def replace(src, dst):
    real_replace(src, dst)
    if point == "swapping" and ".old-" in str(dst):
        die()
def rmtree(path, *args, **kwargs):
    if point == "cleaning" and ".old-" in str(path):
        next(p for p in Path(path).iterdir() if p.is_file()).unlink()
        die()
    real_rmtree(path, *args, **kwargs)
E.verify_export, os.replace, shutil.rmtree = verify, replace, rmtree
from heads.export.__main__ import main
main(sys.argv[2:])
"""


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cli_exports_and_reports_one_json_line(head_dir, tmp_path):
    cmd = [sys.executable, "-m", "heads.export", f"head={head_dir}", "format=speculators"]
    cmd.append(f"out={tmp_path / 'o'}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["format"] == "speculators" and report["outputs_identical"]
    assert (tmp_path / "o" / "config.json").exists()


@pytest.mark.parametrize("cli", ["heads.export", "trainer.evaluate"])
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_cli_names_the_broken_file_of_a_head(head_dir, tmp_path, cli, case):
    """What a user sees for a head folder cut off by a full disk or a killed copy: one line naming
    the file, exit 2, and (export) nothing written; both commands read the head before a target."""
    name, corrupt, what = CORRUPTIONS[case]
    head = copy_head(head_dir, tmp_path / "run" / "head")
    corrupt(head / name)
    out = tmp_path / "exported"
    # A target that does not exist: the head must be refused before any target is looked at.
    cmd = [sys.executable, "-m", cli, f"head={head}", f"target.name_or_path={tmp_path / 'none'}"]
    if cli == "heads.export":
        cmd.append(f"out={out}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert f"{head / name} {what}" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no out/, no .exported.tmp-*
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["head"]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["writing", "swapping", "cleaning"])
def test_export_killed_leaves_no_half_folder_under_its_name(head_dir, tiny_llama_dir, tmp_path, point):
    """A second head exported over a first one's export, killed at each step: under the export's
    name lies the old export whole, nothing, or the new one whole; the same command then
    exports, and nothing of the killed run is left beside it but its temporary folder (hidden:
    `.export.tmp-*`) when it was killed before that folder was moved into place."""
    out = tmp_path / "export"
    export_head(head_dir, "eagle3", out)
    old = folder_bytes(out)
    new_head = make_eagle3_head(tiny_llama_dir, tmp_path / "head-2", seed=1)
    cmd = [sys.executable, "-c", KILLED_EXPORT, point, f"head={new_head}", "format=eagle3", f"out={out}"]
    killed = subprocess.run(cmd, env=cli_env(), capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    after_kill = folder_bytes(out) if out.exists() else None

    export_head(new_head, "eagle3", out)
    new = folder_bytes(out)
    assert new != old
    assert after_kill == {"writing": old, "swapping": None, "cleaning": new}[point]
    left = {p.name.split("-")[0] for p in tmp_path.iterdir() if p.name.startswith(".export.")}
    assert left == (set() if point == "cleaning" else {".export.tmp"})
