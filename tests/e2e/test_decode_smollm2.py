"""The decoder on the real embedded target (SmolLM2-135M-Instruct) and real chat prompts:
greedy speculative output equals plain greedy decoding with the target as its own drafter (every
draft accepted) and through the evaluator with a random EAGLE-3 head (every draft rejected), and
plain greedy decoding on the decoder's static cache equals transformers' on its dynamic cache."""

from __future__ import annotations

import pytest
import torch

from conf.compose import compose_root
from conf.kinds import Eagle3Config
from conf.schema import EvalConfig
from data_prep.target import eos_token_ids, load_target
from heads.eagle3.model import Eagle3Head
from trainer.decoding import Chain, OracleDrafter, Tree, greedy_generate, speculative_generate
from trainer.evaluate.run import evaluate, greedy_verdict
from trainer.evaluate.tasks import encode, load_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol():
    return load_target(NAME)


@pytest.mark.parametrize("shape", [Chain(3), Tree(depth=4)], ids=["chain", "tree"])
def test_oracle_drafts_are_all_accepted_and_output_is_greedy(smol, shape):
    model, tok = smol
    ids = encode(tok, load_prompts(EvalConfig(tasks=["gsm8k"], max_prompts_per_task=1))["gsm8k"][0])
    plain = greedy_generate(model, ids, 24).tokens
    spec = speculative_generate(model, OracleDrafter(model), ids, 24, shape)
    assert greedy_verdict(model, ids, plain, spec.tokens) != "mismatch"
    depth = shape.k if isinstance(shape, Chain) else shape.depth
    assert spec.stats.mean_acceptance_length > depth  # k+1 up to a rare rounding tie


def test_evaluator_with_a_random_head_is_lossless(smol, tmp_path):
    model, tok = smol
    v, vd = model.config.vocab_size, 32000
    d2t, t2d = torch.zeros(vd, dtype=torch.long), torch.arange(v) < vd
    head = Eagle3Head.from_target(model, NAME, Eagle3Config(), d2t, t2d)
    folder = head.save_pretrained(tmp_path / "head")
    cfg = compose_root(["+head=eagle3", "eval.max_prompts_per_task=1", "eval.max_new_tokens=24"])
    result = evaluate(cfg, folder, tmp_path / "eval")
    assert result["lossless"] and result["overall"]["prompts"] == 3
    assert result["overall"]["drafts"] > 0


def test_static_cache_greedy_equals_generate_on_a_dynamic_cache(smol):
    model, tok = smol
    ids = encode(tok, load_prompts(EvalConfig(tasks=["mtbench"], max_prompts_per_task=1))["mtbench"][0])
    eos = sorted(eos_token_ids(model, tok))
    out = model.generate(
        ids[None],
        attention_mask=torch.ones_like(ids[None]),
        max_new_tokens=24,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )
    dynamic = out[0, ids.numel() :].tolist()
    static = greedy_generate(model, ids, 24, eos).tokens
    assert greedy_verdict(model, ids, dynamic, static) != "mismatch"
