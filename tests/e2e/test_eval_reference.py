"""The evaluator's lossless check is held to the target itself: the greedy baseline and the
speculative output run on the same static caches, so a fault there makes them wrong alike and
equal; the baseline is therefore compared with transformers' own `generate` (each task's first
prompt, every prompt with `eval.reference=generate`), and a prompt where they part is named.
`eval.save_outputs=true` writes what was decoded, so anyone can check it against the target.
Three whole evaluations of a sliding-window target (15 s): in e2e since #62; the decoders against
`generate` past the window stay in tests/unit/trainer/test_sliding_window.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from conf.compose import compose_root
from conf.errors import UserError
from data_prep.masks import AttentionLayout
from data_prep.target import eos_token_ids
from tests.support.heads import eagle_head
from tests.support.targets import TINY
from trainer.decoding import kv_cache
from trainer.evaluate.run import evaluate

pytestmark = pytest.mark.usefixtures("single_thread")
RUN = ["eval.max_prompts_per_task=2", "eval.max_new_tokens=40", "eval.tasks=[mtbench,gsm8k]"]


@pytest.fixture(scope="module")
def sliding(tmp_path_factory, smol_tokenizer):
    """(folder, (model, tokenizer), EAGLE-3 head folder): a tiny Mistral whose every layer slides
    over 16 tokens, less than any chat prompt, with SmolLM2's tokenizer and chat template."""
    tok = smol_tokenizer
    folder = tmp_path_factory.mktemp("mistral")
    config = MistralConfig(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, sliding_window=16, initializer_range=0.2, **TINY,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, (model, tok), eagle_head(model, str(folder), folder.parent / "eagle3")


def run_eval(sliding, out, *overrides: str) -> dict:
    folder, target, head = sliding
    cfg = compose_root(["+head=eagle3", f"target.name_or_path={folder}", *RUN, *overrides])
    return evaluate(cfg, head, out)


def test_outputs_equal_the_targets_generate_and_are_saved_for_anyone_to_check(sliding, tmp_path):
    result = run_eval(sliding, tmp_path, "eval.reference=generate", "eval.save_outputs=true")
    assert result["lossless"] is True and result["mismatches"] == []
    assert result["overall"]["checked_against_generate"] == 4
    assert result["settings"]["reference"] == "generate"
    lines = (tmp_path / "outputs.jsonl").read_text().splitlines()
    saved = [json.loads(line) for line in lines]
    assert [s["task"] for s in saved] == ["mtbench", "mtbench", "gsm8k", "gsm8k"]
    assert all(s.keys() == {"task", "prompt_ids", "output_ids"} for s in saved)
    model, tok = sliding[1]
    eos = sorted(eos_token_ids(model, tok))
    for s in saved:  # what anyone would run: the target's own greedy generate on the prompt ids
        ids = torch.tensor([s["prompt_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        assert s["output_ids"] == out[0, ids.shape[1] :].tolist()
        assert len(s["prompt_ids"]) > 16 and len(s["output_ids"]) > 16  # well past the window


def test_a_baseline_that_is_not_the_targets_is_caught_and_the_prompt_named(sliding, tmp_path, monkeypatch):
    # Static caches blind to the window (the fault of the issue): greedy baseline and speculative
    # output are wrong alike and agree; only `generate` tells.
    monkeypatch.setattr(kv_cache, "attention_layout", lambda config: AttentionLayout((None,) * 8))
    result = run_eval(sliding, tmp_path / "first")
    assert result["lossless"] is False
    assert result["mismatches"] == [
        {"task": "mtbench", "prompt": 0, "against": "generate"},
        {"task": "gsm8k", "prompt": 0, "against": "generate"},
    ]
    assert result["overall"]["checked_against_generate"] == 2
    assert result["tasks"]["mtbench"]["mismatched_prompts"] == 1
    md = (tmp_path / "first" / "eval.md").read_text()
    assert "**NO**" in md
    assert "Mismatched prompts: mtbench #0 (plain greedy != generate), gsm8k #0" in md
    assert not (tmp_path / "first" / "outputs.jsonl").exists()  # eval.save_outputs=false

    every = run_eval(sliding, tmp_path / "every", "eval.reference=generate")
    named = [(m["task"], m["prompt"]) for m in every["mismatches"]]
    assert named == [("mtbench", 0), ("mtbench", 1), ("gsm8k", 0), ("gsm8k", 1)]


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.reference=beam", "eval.reference='beam': expected one of greedy, generate"),
        ("eval.save_outputs=maybe", "eval.save_outputs"),
    ],
)
def test_bad_reference_settings_are_refused(override, message):
    with pytest.raises(UserError, match=message):
        compose_root(["+head=eagle3", override])
