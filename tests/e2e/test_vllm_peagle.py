"""A P-EAGLE head on the real SmolLM2 target, exported in both formats and served by vLLM with
parallel drafting: greedy text identical with and without the draft, and vLLM's acceptance
length within 10% of ours on the same prompts and weights.

The head is rigged to be accepted: trained in process on the target's own greedy answers to the
very prompts scripts/check_vllm.py then decodes (the evaluator's first MT-Bench, HumanEval and
GSM8K prompts, as that script encodes them), so its drafts are often right and every slot's
acceptance is compared, not only the first. scripts/check_vllm.py passes the kind's
`speculative_keys` (method "eagle3", `"parallel_drafting": true`), without which vLLM would run
the folders as sequential EAGLE-3. Runs only where `.venv-vllm/bin/python` exists (CI has none).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conf.kinds import PEagleConfig
from data_prep.target import load_target
from heads.export.write import export_head
from heads.kinds import head_kind
from heads.peagle.model import PEagleHead
from tests.support.rigged import check_lines, rigged_head
from trainer.kinds.peagle import PEagleTrainee

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCRIPT = ROOT / "scripts" / "check_vllm.py"
TARGET = "smollm2-135m-instruct"
PROMPTS, MAX_TOKENS, K = 6, 48, 3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON} (scripts/setup_vllm_venv.sh)"
    ),
]


def test_vllm_serves_a_peagle_head_in_parallel_losslessly_with_our_acceptance(tmp_path):
    model, tokenizer = load_target(TARGET, dtype="float32", device="cpu")
    cfg = PEagleConfig(parallel_tokens=K)
    head = rigged_head(model, tokenizer, TARGET, tmp_path / "head", PEagleHead, cfg,
                       lambda h, lm: PEagleTrainee(h, lm, K, cfg.step_weight), PROMPTS, MAX_TOKENS)
    formats = list(head_kind("peagle").formats)
    exports = [export_head(head, fmt, tmp_path / fmt, model)[0] for fmt in formats]
    cmd = [str(VLLM_PYTHON), str(SCRIPT), *map(str, exports), "--prompts", str(PROMPTS),
           "--max-tokens", str(MAX_TOKENS), "--k", str(K), "--main-python", sys.executable]
    lines = check_lines(cmd, len(exports), ROOT, OMP_NUM_THREADS="2")
    for line in lines:
        print(json.dumps({k: line.get(k) for k in (
            "format", "ours_mean_acceptance_length", "vllm_mean_acceptance_length",
            "ours_per_position_acceptance", "vllm_per_position_acceptance", "greedy_text_match",
            "prompts_matching_ours", "spec_run_s")}))
        assert line["speculative_keys"] == {"method": "eagle3", "parallel_drafting": True}
        assert line["loaded"], line["error"]
        assert line["ours_lossless"] and line["greedy_text_match"], line
        assert line["num_speculative_tokens"] == K and line["vllm_drafts"] > 0
        assert line["ours_mean_acceptance_length"] > 1.5, line  # rigged: accepted often
        # A mask slot's draft is accepted (slot 2: the parallel path is live, not only slot 1), and
        # vLLM accepts the same share at every position as our decoder.
        assert line["ours_per_position_acceptance"][1] > 0, line
        assert line["within_10pct"], line
        ours, theirs = line["ours_per_position_acceptance"], line["vllm_per_position_acceptance"]
        assert all(abs(a - b) <= 0.1 * max(a, 1e-9) for a, b in zip(ours, theirs)), line
