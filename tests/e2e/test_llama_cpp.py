"""An EAGLE-3 head on the real SmolLM2 target, exported as `gguf` and served by llama.cpp's own
server beside SmolLM2's GGUF: greedy text identical with and without the draft on 10 prompts,
and llama.cpp's acceptance length within 10% of ours on the same prompts and weights.

The head has the layout llama.cpp's graph expresses (`head.norm_output=false`: the main job's
`export.formats=null` then writes `gguf` too) and is rigged to be accepted (`tests.support.rigged`).
Runs where scripts/setup_llama_cpp.sh built `.llama-cpp/bin/llama-server`; elsewhere it is
skipped with that reason (CI does not build it: 7 minutes of both cores past its time limit).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conf.kinds import Eagle3Config
from data_prep.target import load_target
from heads.eagle3.model import Eagle3Head
from heads.export.write import export_head, formats_for
from tests.support.rigged import check_lines, rigged_head
from trainer.kinds.eagle3 import Eagle3Trainee

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / ".llama-cpp" / "bin" / "llama-server"
SCRIPT = ROOT / "scripts" / "check_llama_cpp.py"
TARGET = "smollm2-135m-instruct"
PROMPTS, MAX_TOKENS, K = 10, 48, 3
# Rigged lightly: llama.cpp runs the Q4_1 weights with quantized activations, our side the same
# weights dequantized, so their greedy answers part here and there, and a head that memorised
# ours (200 steps: ours τ 3.81, llama.cpp's 1.79) is accepted less by llama.cpp. At 60 steps the
# two are 1.39 and 1.26, as a head trained on data is (the main job's: 1.31 and 1.34).
STEPS = 60

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not SERVER.exists(), reason=f"no llama-server at {SERVER} (scripts/setup_llama_cpp.sh)"
    ),
]


def test_llama_cpp_serves_the_gguf_export_losslessly_at_our_acceptance(tmp_path):
    model, tokenizer = load_target(TARGET, dtype="float32", device="cpu")
    cfg = Eagle3Config(norm_output=False)
    head = rigged_head(model, tokenizer, TARGET, tmp_path / "head", Eagle3Head, cfg,
                       lambda h, lm: Eagle3Trainee(h, lm, cfg.ttt_length, cfg.step_weight),
                       PROMPTS, MAX_TOKENS, steps=STEPS)
    assert "gguf" in formats_for(head, None)  # what the main job writes for such a head
    export, _ = export_head(head, "gguf", tmp_path / "gguf", model, dtype="float32")
    cmd = [sys.executable, str(SCRIPT), str(export), "--prompts", str(PROMPTS),
           "--max-tokens", str(MAX_TOKENS), "--k", str(K)]
    line = check_lines(cmd, 1, ROOT)[0]
    print(json.dumps(line))
    assert line["loaded"], line.get("error")
    assert line["ours_lossless"], line
    assert line["identical"] == [PROMPTS, PROMPTS], line  # with the draft as without it
    assert line["ours_tau"] > 1.2, line  # accepted, so later slots are compared too
    assert line["within_10pct"], line
