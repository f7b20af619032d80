"""`scripts/bench_train.py preset=specforge` at toy sizes (tiny=true): the code path of the GPU
figure that is set beside SpecForge's (`scripts/gpu_check.py`'s train check runs its step)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package), registered as dataclasses need."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_train = script("bench_train")
DOCS, MODES = ("equal", "spread", "lognormal"), ("padded", "packed")


@pytest.fixture(scope="module")
def tiny_lines() -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "scripts/bench_train.py", "preset=specforge", "tiny=true"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_one_sane_json_line_per_profile_and_padding(tiny_lines):
    records = [json.loads(line) for line in tiny_lines.splitlines()]
    assert [(r["docs"], r["padding"]) for r in records] == [(d, m) for d in DOCS for m in MODES]
    row_len = 128  # the tiny preset's rows: SpecForge's shapes, scaled down
    for r in records:
        assert r["preset"] == "specforge" and r["tiny"] and r["device"] == "cpu"
        assert r["draft"]["ttt_length"] == 7 and r["labelled"] == 0.75
        assert r["draft"]["head_dim"] * r["draft"]["num_attention_heads"] == r["draft"]["hidden_size"]
        assert r["step_ms"] > 0 and r["step_ms_p50"] > 0 and r["peak_mem_mib"] > 0
        assert 0 <= r["padding_share"] < 1
        # Useful tokens/s is the mean useful (non-pad) tokens of a step over the mean step.
        expected = r["useful_tokens_per_step"] / (r["step_ms"] / 1000)
        assert r["useful_tokens_per_s"] == pytest.approx(expected, rel=0.01)
    by = {(r["docs"], r["padding"]): r for r in records}
    for docs in DOCS:  # both modes train on the same documents
        padded, packed = by[docs, "padded"], by[docs, "packed"]
        assert padded["useful_tokens_per_step"] == packed["useful_tokens_per_step"]
    # equal: 4 full rows, nothing to pack; spread: SpecForge's 46.88% padding, which packing cuts.
    assert by["equal", "padded"]["useful_tokens_per_step"] == 4 * row_len
    assert by["equal", "padded"]["padding_share"] == by["equal", "packed"]["padding_share"] == 0
    assert by["spread", "padded"]["padding_share"] == pytest.approx(0.4688, abs=1e-4)
    assert by["spread", "padded"]["batch_shapes"] == [[4, 2 * row_len]]
    for docs in ("spread", "lognormal"):
        assert by[docs, "packed"]["padding_share"] < by[docs, "padded"]["padding_share"]


def test_unknown_choices_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as err:
        bench_train.main(["preset=specforge", "tiny=true", "docs=equal,sharegpt"])
    assert err.value.code == 2
    assert "docs=equal,sharegpt: sharegpt unknown" in capsys.readouterr().err
