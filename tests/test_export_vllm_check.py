"""scripts/check_vllm.py: its acceptance arithmetic and the main-venv side ("ours").

The vLLM side needs the separate vLLM venv and runs as the documented script (README); here the
part that runs in this venv is exercised for real on a tiny target and an exported head.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conf.schema import Eagle3Config
from data_prep.target import load_target
from heads.eagle3 import Eagle3Head
from heads.export import export_head

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_vllm.py"


@pytest.fixture(scope="module")
def check_vllm():
    spec = importlib.util.spec_from_file_location("check_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_acceptance_is_vllms_definition(check_vllm):
    # 10 verify steps with 3 drafts each; 12 drafts accepted: 6 at position 0, 4 at 1, 2 at 2.
    got = check_vllm.acceptance(drafts=10, accepted=12, per_pos=[6, 4, 2])
    assert got == {"mean_acceptance_length": 2.2, "per_position_acceptance": [0.6, 0.4, 0.2]}
    assert check_vllm.acceptance(0, 0, [0, 0])["mean_acceptance_length"] == 1.0
    assert check_vllm.relative_gap(2.0, 2.1) == pytest.approx(0.05)


def test_ours_side_decodes_the_exported_weights(check_vllm, tiny_llama_dir, tmp_path):
    model, _ = load_target(str(tiny_llama_dir))
    v = model.config.vocab_size
    head = Eagle3Head.from_target(
        model,
        str(tiny_llama_dir),
        Eagle3Config(),
        torch.zeros(v, dtype=torch.long),
        torch.ones(v, dtype=torch.bool),
    )
    out, _ = export_head(head.save_pretrained(tmp_path / "head"), "speculators", tmp_path / "x")
    ref = check_vllm.ours(str(out), str(tiny_llama_dir), n_prompts=2, max_tokens=8, k=3)
    assert ref["format"] == "speculators" and ref["method"] == "eagle3"
    assert ref["target_dir"] == str(tiny_llama_dir) and len(ref["prompt_token_ids"]) == 2
    assert ref["lossless"] and 1.0 <= ref["mean_acceptance_length"] <= 4.0
    assert len(ref["per_position_acceptance"]) == 3
