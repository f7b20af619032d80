"""`python -m trainer.evaluate` as users run it: a report, progress in a log, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.heads import eagle_head
from tests.support.runs import QUICK


@pytest.fixture(scope="module")
def eagle_dir(tiny_model, tiny_llama_dir, tmp_path_factory) -> Path:
    model = tiny_model
    return eagle_head(model, str(tiny_llama_dir), tmp_path_factory.mktemp("h") / "eagle3")


@pytest.mark.slow  # a fresh process loads torch, transformers and the target
def test_command_line(tiny_llama_dir, eagle_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "trainer.evaluate", f"head={eagle_dir}", *QUICK,
           "eval.tasks=[gsm8k]", f"eval.out_dir={tmp_path / 'out'}", "target.num_threads=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lossless True" in proc.stdout
    assert "eval: 1/1 prompts, " in proc.stderr  # a log file shows progress too
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["tasks"].keys() == {"gsm8k"}
    proc = subprocess.run([*cmd[:3], f"head={tmp_path}"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 2 and proc.stderr.startswith("error: head=")
