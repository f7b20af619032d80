"""scripts/memory_plan.py: a real `--help`, and the Llama-3.1-8B-shaped table's rows, whose target
bytes are the hand-computed ones (bf16, untied embeddings: 2 x 128256 x 4096 x 2 bytes and the
final norm offline; every weight of the 8B target before and online), and the frozen tables'
bytes halved after (bf16, not float32). The script runs as a user runs it, one interpreter per
call: here since the unit tier's diet (#62), as scripts/bench_long_context.py's test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import cli_env

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "memory_plan.py"
PARTS = (2 * 128256 * 4096 + 4096) * 2
# embeddings, lm_head and final norm; per layer 4 attention projections (q, o: 4096^2; k, v:
# 4096 x 1024), 3 MLP matrices (4096 x 14336), 2 norms; in bf16, plus the rotary tables
# (inv_freq and its original: 64 float32 each).
WHOLE = PARTS + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) * 2 + 2 * 64 * 4

# Bytes the trainee's frozen tables shed stored in bf16: the embedding and the teacher's rows,
# 2 bytes of each value.
FROZEN_SAVED = (128256 + 32000) * 4096 * (4 - 2)

pytestmark = pytest.mark.slow  # a fresh interpreter per run


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=cli_env(), timeout=300)


def test_help_names_its_options_and_defaults():
    done = run("--help")
    assert done.returncode == 0 and "--world" in done.stdout and "optim.batch_tokens=16384" in done.stdout


def test_rows_offline_and_online_before_and_after():
    done = run("--world", "8")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by = {(r["mode"], r["when"]): r for r in rows}
    assert set(by) == {(m, w) for m in ("offline", "online") for w in ("before", "after")}
    assert by["offline", "after"]["target"] == PARTS
    assert by["offline", "before"]["target"] == by["online", "after"]["target"] == WHOLE
    # the frozen tables (embedding, 32000 teacher rows) went from float32 to bf16
    assert by["offline", "before"]["frozen"] - by["offline", "after"]["frozen"] == FROZEN_SAVED
    before, after = by["offline", "before"]["training_rank"], by["offline", "after"]["training_rank"]
    assert after == before - WHOLE + PARTS - FROZEN_SAVED
    assert "fits 80 GB" in done.stdout
