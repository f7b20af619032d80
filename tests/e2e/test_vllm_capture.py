"""Hidden states through vLLM (`data.capture.backend=vllm`) equal transformers' for the embedded
SmolLM2 and every tiny family vLLM 0.32 gives aux hidden states for.

One run of scripts/check_capture.py in the vLLM venv captures 3 seeded random prompts per target
through `VllmCapturer` (vLLM's `extract_hidden_states`, draftsmith's CPU-safe connector, the
files read back and deleted, the final norm applied) and through `HfCapturer` (float32), and
reports the largest relative difference per field, whether the files held the ids sent, the
top-1 agreement and what the final field would differ by without the norm (the trap the norm
is there for: tests/unit/data_prep/test_capture_engine.py fails without it on a tiny model).
Tolerance: 1e-4 of each field's largest magnitude (float32 kernels reducing in another order;
SmolLM2 measured 4e-7 aux and 3e-6 final, 2026-12-04). The engines reserve 1 GiB of KV cache
(VLLM_CPU_KVCACHE_SPACE): the 8 engine starts take 4 minutes where the default 40% of RAM took 9.

And one copy of the target per process (`data_prep.resident`): the main job with
`data.regenerate.backend=vllm` loads the transformers target for its probes and capture, and vLLM,
which reserves most of a device up front, must not start beside it: with the real engine, the
transformers model is dropped before the engine starts, and loading the model again stops it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.targets import TINY_FAMILIES, vllm_family_target

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCRIPT = ROOT / "scripts" / "check_capture.py"
TOLERANCE = 1e-4

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON} (scripts/setup_vllm_venv.sh)"
    ),
]

# vLLM 0.32's Gemma3ForCausalLM has no aux hidden states (not SupportsEagle3): its engine fails
# to start (test_vllm_families checks the refusal), so it is not started here.
UNSERVED = {"gemma3_text"}
SERVED = [family for family in TINY_FAMILIES if family not in UNSERVED]


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> dict[str, dict]:
    """check_capture's line per target: "smollm2" and each family, from one vLLM process."""
    root = tmp_path_factory.mktemp("capture")
    targets = {"smollm2": "smollm2-135m-instruct"}
    for family in SERVED:
        targets[family] = str(vllm_family_target(family, root / family)[1])
    cmd = [str(VLLM_PYTHON), str(SCRIPT), *targets.values()]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1500,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"})
    got = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(got) == len(targets), f"rc={done.returncode}\n{done.stderr[-4000:]}"
    return dict(zip(targets, got))


@pytest.mark.parametrize("name", ["smollm2", *SERVED])
def test_vllm_states_equal_transformers(lines, name):
    line = lines[name]
    assert line["loaded"], line["error"]
    assert line["ids_equal"]
    assert all(d <= TOLERANCE for d in line["max_rel_diff"].values()), line
    agree, tokens = line["top1_agree"]
    assert agree == tokens, line
    assert line["unnormed_rel_diff"] > 100 * TOLERANCE, line  # the norm is what makes them equal


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
