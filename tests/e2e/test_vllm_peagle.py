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
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conf.kinds import PEagleConfig
from conf.schema import EvalConfig
from data_prep.capture import TOP, greedy_ids
from data_prep.target import eos_token_ids, load_target
from data_prep.vocab import build_draft_vocab
from heads.export.write import export_head
from heads.kinds import head_kind
from heads.peagle.model import PEagleHead
from trainer.batching import collate
from trainer.decoding import greedy_generate
from trainer.evaluate.tasks import encode, load_prompts
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


def check_prompts(tokenizer) -> list[torch.Tensor]:
    """The token ids scripts/check_vllm.py decodes with `--prompts PROMPTS`."""
    cfg = EvalConfig(max_prompts_per_task=-(-PROMPTS // 3), max_new_tokens=MAX_TOKENS)
    prompts = [p for ps in load_prompts(cfg).values() for p in ps][:PROMPTS]
    return [encode(tokenizer, p) for p in prompts]


def rigged_head(model, tokenizer, out: Path) -> Path:
    """A P-EAGLE head (K=3, 2,048 draft ids) trained on the target's greedy answers to the check's
    prompts, saved in the project's folder format."""
    eos = eos_token_ids(model, tokenizer)
    prompts = check_prompts(tokenizer)
    texts = [torch.cat([x, torch.tensor(greedy_generate(model, x, MAX_TOKENS, eos).tokens)]) for x in prompts]
    v = model.config.vocab_size
    d2t, t2d = build_draft_vocab(torch.bincount(torch.cat(texts), minlength=v), 2048)
    cfg = PEagleConfig(parallel_tokens=K)
    torch.manual_seed(0)
    head = PEagleHead.from_target(model, TARGET, cfg, d2t, t2d)
    trainee = PEagleTrainee(head, model.get_output_embeddings().weight, K, cfg.step_weight)
    samples = []
    with torch.no_grad():
        for x, ids in zip(prompts, texts):
            hs = model(ids[None], output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i][0] for i in head.aux_layer_ids], -1)
            answer = torch.arange(ids.numel()) >= x.numel()  # the teacher's rows: answers only
            samples.append(
                {"input_ids": ids, "loss_mask": answer, "aux_hidden": aux, "final_hidden": hs[-1][0],
                 TOP: greedy_ids(model.get_output_embeddings(), hs[-1][0])}
            )
    batch = collate(samples, trainee.batch_index)
    opt = torch.optim.AdamW(trainee.head.parameters(), lr=2e-3)
    for _ in range(60):
        loss = trainee(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().save_pretrained(out)


def test_vllm_serves_a_peagle_head_in_parallel_losslessly_with_our_acceptance(tmp_path):
    model, tokenizer = load_target(TARGET, dtype="float32", device="cpu")
    head = rigged_head(model, tokenizer, tmp_path / "head")
    formats = list(head_kind("peagle").formats)
    exports = [export_head(head, fmt, tmp_path / fmt, model)[0] for fmt in formats]
    cmd = [str(VLLM_PYTHON), str(SCRIPT), *map(str, exports), "--prompts", str(PROMPTS),
           "--max-tokens", str(MAX_TOKENS), "--k", str(K), "--main-python", sys.executable]
    # PYTHONPATH: our side (`--role ours`) imports this checkout's modules, not an installed copy.
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1500, env=env)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(exports), f"rc={done.returncode}\n{done.stderr[-4000:]}"
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
