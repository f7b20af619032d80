"""The GPU check's CPU rehearsal (`bash scripts/gpu_check.sh --cpu`): every check of
`scripts/gpu_check.py` runs, in order, on a tiny target, so the script that the next lent GPU
runs cannot rot; its figures here mean nothing, its verdicts (no error, the loss paths equal,
speculative output equal to greedy) do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["env", "sync", "loss", "attention", "train", "capture", "decode", "zero"]


def test_the_cpu_rehearsal_runs_every_check_and_leaves_what_the_device_brings_back(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "WHEELS": str(tmp_path / "none"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    log = (tmp_path / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]  # DeepSpeed logs there too
    assert (tmp_path / "gpu_check.jsonl").read_text().splitlines() == lines
    # The device tool brings back at most 8 files.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.jsonl", "gpu_check.log"]
    checks = {r["check"]: r for r in map(json.loads, lines)}
    assert list(checks) == ORDER and not [r for r in checks.values() if "error" in r or "skipped" in r]
    assert checks["sync"]["sync_free"] is True
    assert checks["loss"]["max_abs_diff"] < 1e-4, checks["loss"]
    assert all(checks["decode"][d]["lossless"] for d in ("bfloat16", "float32")), checks["decode"]
    for padding in ("padded", "packed"):
        assert checks["train"][padding]["useful_tokens_per_s"] > 0
    assert checks["capture"]["capture_tokens_per_s"] > 0 and set(checks["zero"]) >= {"zero2", "zero3"}
