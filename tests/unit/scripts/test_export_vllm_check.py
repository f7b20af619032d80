"""scripts/check_vllm.py: its acceptance arithmetic and the main-venv side ("ours").

The vLLM side needs the separate vLLM venv and runs as the documented script (README); here the
part that runs in this venv is exercised for real on a tiny target and an exported head.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conf.kinds import Eagle3Config
from heads.eagle3.model import Eagle3Head
from heads.export.write import export_head

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "check_vllm.py"


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


def test_ours_side_decodes_the_exported_weights(tiny_model, check_vllm, tiny_llama_dir, tmp_path):
    model = tiny_model
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


def test_the_target_is_the_override_then_the_verifier_then_the_default(check_vllm, tmp_path):
    from conf.errors import UserError
    from conf.schema import TargetConfig

    def export(name: str, verifier: str | None) -> str:
        folder = tmp_path / name
        folder.mkdir()
        cfg = {"speculators_config": {"verifier": {"name_or_path": verifier}}} if verifier else {}
        (folder / "config.json").write_text(json.dumps(cfg))
        return str(folder)

    a, b, plain = export("a", "/models/a"), export("b", "/models/b"), export("plain", None)
    assert check_vllm.choose_target([a, b], "/mine") == "/mine"
    assert check_vllm.choose_target([a, plain], None) == "/models/a"
    assert check_vllm.choose_target([plain], None) == TargetConfig.name_or_path
    with pytest.raises(UserError, match="name different targets"):
        check_vllm.choose_target([a, b], None)


def test_random_prompts_are_seeded_ordinary_ids(check_vllm, smol_tokenizer):
    first = check_vllm.random_prompts(smol_tokenizer, 300, n=3, length=24)
    again = check_vllm.random_prompts(smol_tokenizer, 300, n=3, length=24)
    assert [p.tolist() for p in first] == [p.tolist() for p in again]
    ids = {int(i) for p in first for i in p}
    assert all(len(p) == 24 for p in first) and max(ids) < 300
    assert not ids & set(smol_tokenizer.all_special_ids)


def test_long_prompts_fill_the_evaluators_buckets(check_vllm, smol_tokenizer):
    """`--context-lengths`: the evaluator's long-context prompts, spread over the buckets."""
    from transformers import LlamaConfig

    config = LlamaConfig(max_position_embeddings=8192)
    prompts = check_vllm.long_prompts(smol_tokenizer, config, (1024, 2048), n=4, max_tokens=32)
    assert [len(p) > 1024 for p in prompts] == [False, False, True, True]
    assert all(256 < len(p) <= 2048 for p in prompts)


def test_a_refused_config_reports_what_vllm_refused(check_vllm):
    """vLLM refuses a DSpark draft on the CPU in a pydantic error whose last line is a link."""
    refused = "Value error, Model Runner V1 does not support: dspark speculative decoding"
    err = ValueError(f"1 validation error for VllmConfig\n  {refused}\n    For further information visit "
                     "https://errors.pydantic.dev/2.14/v/value_error")
    assert check_vllm.error_line(err) == f"ValueError: {refused}"


def test_your_own_prompts_file_is_what_both_engine_checks_send(check_vllm, tiny_llama_dir, tmp_path):
    """`--prompts FILE.jsonl` (eval.prompts' format): every prompt of it, templated as the
    evaluator templates it, is what our side decodes and vLLM / llama.cpp then serve; a count
    still means the evaluator's prompts; a bad line is one line naming the file and the line."""
    import argparse

    from conf.errors import UserError
    from conf.schema import EvalConfig
    from data_prep.target import load_target
    from trainer.evaluate.tasks import encode, load_prompts

    turns = [("user", "Hi"), ("assistant", "Hello"), ("user", "Count to 5.")]
    rows = [{"task": "mine", "prompt": "Name three primes."},
            {"task": "mine", "messages": [{"role": r, "content": c} for r, c in turns]}]
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert check_vllm.prompt_source("4") == 4 and check_vllm.prompt_source(str(mine)) == str(mine)
    with pytest.raises(argparse.ArgumentTypeError, match="no-such.jsonl: expected a count > 0 or a JSONL"):
        check_vllm.prompt_source(str(tmp_path / "no-such.jsonl"))
    ref = check_vllm.ours_all([], str(tiny_llama_dir), check_vllm.prompt_source(str(mine)), max_tokens=4, k=3)
    _, tokenizer = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    cfg = EvalConfig(prompts=str(mine), tasks=[])
    assert ref["prompt_token_ids"] == [encode(tokenizer, p).tolist() for p in load_prompts(cfg)["mine"]]
    assert len(ref["greedy_tokens"]) == 2
    mine.write_text(json.dumps(rows[0]) + "\n" + '{"task": "mine"}\n')
    with pytest.raises(UserError, match=r"mine.jsonl' line 2: expected \"prompt\""):
        check_vllm.ours_all([], str(tiny_llama_dir), str(mine), max_tokens=4, k=3)
