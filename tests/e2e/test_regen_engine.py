"""The regeneration engine on the real SmolLM2 target: greedy answers equal transformers' own."""

from __future__ import annotations

import pytest

from data_prep.answers.regen_engine import generate, shared_prefix
from data_prep.target import eos_token_ids, load_target
from data_prep.template import load_chat_template
from tests.support.targets import hf_greedy, until


@pytest.mark.slow
def test_greedy_matches_generate_on_smollm2():
    model, tok = load_target("smollm2-135m-instruct", dtype="float32", device="cpu", num_threads=2)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain recursion to a child.",
        "Hi!",
        "How do I boil an egg?",
        "Translate 'good morning' into Spanish.",
        "What is 12 times 7?",
        "Why is the sky blue? Answer in one long paragraph, please.",
    ]
    tpl = load_chat_template(tok, None, {}, "2026-01-01")
    prompts = [tpl.prompt_ids([{"role": "user", "content": q}]) for q in questions]
    eos = eos_token_ids(model, tok)
    want = [until(hf_greedy(model, p, 32), eos) for p in prompts]
    assert len(set(map(len, want))) > 1  # some answers end early: their slots are refilled
    assert shared_prefix(prompts) > 10
    assert generate(model, prompts, max_new_tokens=32, batch_size=3, eos_token_ids=eos) == want
    assert generate(model, prompts, max_new_tokens=32, batch_size=4, eos_token_ids=eos, workers=2) == want
