"""A reasoning target end to end: a tiny random-weight Qwen3-architecture model with Qwen3's
published chat template, thinking on: regenerate -> capture -> train -> evaluate (lossless) ->
export, and `data_prep.show` of its rows: the supervised ids are exactly the generated ids."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_prep.answers.regenerate import read_cache
from tests.support.cli import run_train_cli
from tests.support.runs import tiny_run_args
from tests.support.targets import TINY

QWEN3 = Path(__file__).resolve().parents[3] / "shared" / "chat-templates" / "qwen3.jinja"
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smol_tokenizer) -> Path:
    """SmolLM2's tokenizer (it has <|im_start|>/<|im_end|>) with Qwen3's reasoning and tool
    markers, under a tiny Qwen3 model."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = tmp_path_factory.mktemp("tiny-qwen3")
    tok = copy.deepcopy(smol_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    config = Qwen3Config(
        vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True, head_dim=16, **TINY,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.skipif(not QWEN3.exists(), reason=f"{QWEN3} is absent (the shared folder)")
def test_qwen3_thinking_target_end_to_end(tiny_qwen3, chat_file, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_run_args(
        "eagle3", tiny_qwen3, chat_file, run_dir,
        "data.max_samples=16", "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=24",
        "data.regenerate.batch_size=8", "data.max_length=128", "data.draft_vocab_size=300",
        f"data.chat_template={QWEN3}", "optim.max_steps=4", "pipeline.evaluate=true",
        "pipeline.export=true", "eval.max_prompts_per_task=1", "eval.max_new_tokens=12",
        "eval.tasks=[mtbench,gsm8k]",
    )
    proc = run_train_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    report = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert report["lossless"] is True and summary["mean_acceptance_length"] >= 1.0
    assert {Path(p).name for p in summary["exports"]} == {"eagle3", "speculators"}
    # `trainer.evaluate head=...` renders prompts with the run's template, unless told otherwise.
    from heads.folder import compose_for_head

    assert compose_for_head(str(run_dir / "head"), []).data.chat_template == str(QWEN3)
    other = compose_for_head(str(run_dir / "head"), ["data.chat_template_kwargs={enable_thinking: false}"])
    assert other.data.chat_template_kwargs == {"enable_thinking": False}

    # The regenerated turns (prompt ids as the template rendered them, generated ids) ...
    data_dir = Path(summary["data_dir"])
    (cache,) = (data_dir.parent / "regenerated").glob("*.jsonl")
    turns = read_cache(cache)
    # ... are what `data_prep.show` marks as supervised, row for row.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    for index in range(3):
        out = subprocess.run(
            [sys.executable, "-m", "data_prep.show", str(run_dir), f"index={index}", "format=json"],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        (row,) = [json.loads(line) for line in out.stdout.splitlines()]
        (turn,) = turns[row["uid"]]
        assert row["supervised"] == [tok.decode(turn["answer_ids"])]
        assert row["text"] == tok.decode(turn["prompt_ids"] + turn["answer_ids"])
        assert row["text"].startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in row["text"]
    text = subprocess.run(
        [sys.executable, "-m", "data_prep.show", str(data_dir), "index=0"], capture_output=True, text=True
    )
    assert text.returncode == 0 and "[[" in text.stdout and "supervised" in text.stdout
