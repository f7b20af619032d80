"""The eleven published chat templates of `../shared/chat-templates/`: the supervised tokens are
exactly what the model emits in each assistant turn (reasoning, answer, stop token), never user,
system, template-injected or generation-prompt tokens.

Each template runs on SmolLM2's tokenizer with that family's markers added as special tokens and
its BOS/EOS set, as the family's own tokenizer has them.
"""

from __future__ import annotations

import pytest
import torch
from jinja2.exceptions import TemplateError

from data_prep.stats import PrepStats
from data_prep.template import tokenize_conversation
from tests.support.templates import FAMILIES, TEMPLATES, family
from trainer.kinds.eagle3 import ttt_batch_index
from trainer.trainee import LABEL_INDEX

pytestmark = pytest.mark.skipif(not TEMPLATES.is_dir(), reason=f"{TEMPLATES} is absent (the shared folder)")

SYSTEM = {"role": "system", "content": "You are terse."}
CONV = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four.", "reasoning": "Two and two make four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "It is six.", "reasoning": "Three and three make six."},
]


def supervised_runs(tpl, rows) -> list[str]:
    """Every maximal run of supervised tokens, decoded, row by row."""
    runs = []
    for row in rows:
        run = []
        for t, m in zip(row.input_ids + [None], row.loss_mask + [False]):
            if m:
                run.append(t)
            elif run:
                runs.append(tpl.tok.decode(run))
                run = []
    return runs


def emitted(name: str, reasoning: str | None, answer: str, eos: str) -> str:
    """What a model of this family emits for one assistant turn after its generation prompt."""
    if name == "gpt-oss":
        think = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning else ""
        return f"{think}<|channel|>final<|message|>{answer}{eos}"
    if name == "deepseek-r1-distill":  # the generation prompt already holds "<think>\n"
        return (f"{reasoning}\n</think>\n\n" if reasoning else "") + answer + eos
    return (f"<think>\n{reasoning}\n</think>\n\n" if reasoning else "") + answer + eos


@pytest.mark.parametrize("with_system", [False, True], ids=["no-system", "system"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_supervised_tokens_are_exactly_each_turns_reasoning_answer_and_stop(name, with_system):
    tpl = family(name)
    conv = ([SYSTEM] if with_system else []) + CONV
    if name == "mixtral-8x7b-instruct-v0.1" and with_system:
        with pytest.raises(TemplateError, match="alternate"):  # prepare counts and skips it
            tokenize_conversation(tpl, conv, 4096)
        return
    stats = PrepStats()
    rows = tokenize_conversation(tpl, conv, 4096, stats=stats)
    eos = tpl.tok.eos_token
    want = [emitted(name, m["reasoning"], m["content"], eos) for m in conv if m["role"] == "assistant"]
    runs = supervised_runs(tpl, rows)
    if name == "mistral-7b-instruct-v0.3":  # its template writes " " + content after [/INST]
        runs = [r.lstrip(" ") for r in runs]
    assert runs == want
    bos = tpl.tok.bos_token_id
    for row in rows:
        assert len(row.input_ids) == len(row.loss_mask)
        if bos is not None:
            assert row.input_ids.count(bos) == 1, "exactly one BOS"
        text = tpl.tok.decode(row.input_ids)
        if with_system and name != "deepseek-r1-distill" and name != "mistral-7b-instruct-v0.3":
            assert SYSTEM["content"] in text
    # Templates that rewrite history (reasoning dropped from earlier turns, the system text
    # moved, the analysis channel kept on the last turn only) give a row per turn.
    rewrites = {"qwen3", "qwen3-initial-2025-04", "gpt-oss", "deepseek-r1-distill"}
    if name in rewrites or (name == "mistral-7b-instruct-v0.3" and with_system):
        assert len(rows) == 2
    if name == "deepseek-r1-distill":
        assert stats.turns_raw_text == 2  # the template strips the reasoning it emits


@pytest.mark.parametrize("name", ["qwen3", "qwen3-initial-2025-04"])
@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_without_reasoning_supervises_the_answer_not_the_empty_think_scaffold(name, thinking):
    tpl = family(name, **({} if thinking else {"enable_thinking": False}))
    conv = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    (row,) = tokenize_conversation(tpl, conv, 4096)
    assert supervised_runs(tpl, [row]) == ["Hello.<|im_end|>"]
    assert "<think>\n\n</think>\n\nHello." in tpl.tok.decode(row.input_ids)
    prompt = tpl.render(conv[:1], add_generation_prompt=True)
    assert prompt.endswith("<think>\n\n</think>\n\n") != thinking  # off: the prompt supplies it


def test_the_stop_tokens_trailing_newline_is_not_supervised():
    tpl = family("qwen2.5-instruct")
    (row,) = tokenize_conversation(tpl, CONV, 4096)  # both turns in one row
    eos = tpl.tok.eos_token_id
    ends = [i for i, (t, m) in enumerate(zip(row.input_ids, row.loss_mask)) if m and t == eos]
    assert len(ends) == 2 and ends[-1] == len(row.input_ids) - 1
    first = ends[0] + 1
    assert tpl.tok.decode(row.input_ids[first : first + 1]) == "\n" and not row.loss_mask[first]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call12345", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]},
    {"role": "tool", "content": "sunny and 21 degrees", "tool_call_id": "call12345"},
    {"role": "assistant", "content": "It is sunny."},
]


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3", "llama-3.1-3.3-instruct"])
def test_a_tool_call_is_supervised_and_its_result_is_not(name):
    tpl = family(name)
    rows = tokenize_conversation(tpl, TOOL_CONV, 4096, tools=TOOLS)
    runs = supervised_runs(tpl, rows)
    eos = tpl.tok.eos_token
    assert len(runs) == 2 and all(r.endswith(eos) for r in runs)
    assert "get_weather" in runs[0] and "Paris" in runs[0]
    assert runs[1] == "It is sunny." + eos
    assert not any("sunny and 21" in r for r in runs)
    assert all("sunny and 21" in tpl.tok.decode(r.input_ids) for r in rows[-1:])


def test_the_mask_stays_aligned_with_every_ttt_steps_shifted_targets():
    """The labels of each unroll step are the supervised positions, predicted from the position
    2+k before them, so each step's target token is a supervised (emitted) token."""
    tpl = family("qwen3")
    rows = tokenize_conversation(tpl, [SYSTEM] + CONV, 4096)
    for row in rows:
        ids, mask = torch.tensor([row.input_ids]), torch.tensor([row.loss_mask])
        index = ttt_batch_index({"input_ids": ids, "loss_mask": mask}, ttt_length=3)
        labels = index[LABEL_INDEX]
        assert labels.tolist() == [u for u, m in enumerate(row.loss_mask) if m]
        assert tpl.tok.decode(ids[0, labels]) == "".join(supervised_runs(tpl, [row]))
        positions = index["ttt_positions"].flatten()
        for k in range(1, 3):
            has = labels >= 2 + k
            assert torch.equal(positions[index["ttt_rows"][k][has]], labels[has] - 2 - k)
