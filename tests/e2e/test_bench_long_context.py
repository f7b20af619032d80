"""scripts/bench_long_context.py: one JSON line, a fresh process per length; a bad length is one
line naming it. Three interpreters for one line (the script and one per length): the unit tier's
slowest script test, here since #62."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import cli_env

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_long_context.py"

pytestmark = pytest.mark.slow  # a fresh interpreter per run and per length


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=cli_env(), timeout=300)


def test_one_line_with_each_lengths_figures(tiny_llama_dir):
    done = bench(f"target.name_or_path={tiny_llama_dir}", "lengths=32,64", "steps=1")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == 1, done.stderr[-2000:]
    line = json.loads(lines[0])
    assert line["head"] == "eagle3" and line["lengths"] == [32, 64] and line["errors"] == {}
    assert all(m > 0 for m in line["peak_rss_mib"]) and all(t > 0 for t in line["tokens_per_s"])


def test_a_bad_length_is_one_line():
    done = bench("lengths=512,many")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: lengths=512,many: expected comma-separated token counts"
    ]
