"""The loss mask marks exactly the assistant tokens, checked by decoding the masked spans."""

from __future__ import annotations

import copy

import pytest

from conf.errors import UserError
from data_prep.template import mask_from_offsets, tokenize_conversation

# Meta's Llama-3 template (bos once, header per turn, content trimmed, <|eot_id|> after each).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

CONV = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris. It has been the capital since 987."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, of course!\n\n- old\n- big"},
]


@pytest.fixture(scope="module")
def llama3_tokenizer(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    )
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def masked_spans(tok, ids, mask) -> list[str]:
    """Decode every maximal run of masked tokens."""
    spans, run = [], []
    for t, m in zip(ids + [None], mask + [False]):
        if m:
            run.append(t)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans


def assistant_texts(conv, end_token):
    return [m["content"] + end_token for m in conv if m["role"] == "assistant"]


@pytest.mark.parametrize("system", [None, "You answer in one line."])
def test_smollm2_template_masks_exactly_the_answers(smol_tokenizer, system):
    conv = ([{"role": "system", "content": system}] if system else []) + CONV
    t = tokenize_conversation(smol_tokenizer, conv, 4096)
    assert not t.truncated and len(t.input_ids) == len(t.loss_mask)
    assert masked_spans(smol_tokenizer, t.input_ids, t.loss_mask) == assistant_texts(CONV, "<|im_end|>")
    text = smol_tokenizer.decode(t.input_ids)
    assert (system or "You are a helpful AI assistant named SmolLM") in text


def test_llama3_style_template_masks_exactly_the_answers(llama3_tokenizer):
    conv = [{"role": "system", "content": "Be terse."}] + CONV
    t = tokenize_conversation(llama3_tokenizer, conv, 4096)
    assert t.input_ids.count(llama3_tokenizer.bos_token_id) == 1
    assert masked_spans(llama3_tokenizer, t.input_ids, t.loss_mask) == assistant_texts(CONV, "<|eot_id|>")


def test_truncation_cuts_ids_and_mask_together(smol_tokenizer):
    full = tokenize_conversation(smol_tokenizer, CONV, 4096)
    n = len(full.input_ids) - 5
    t = tokenize_conversation(smol_tokenizer, CONV, n)
    assert t.truncated and len(t.input_ids) == len(t.loss_mask) == n
    assert t.input_ids == full.input_ids[:n] and t.loss_mask == full.loss_mask[:n]
    last = masked_spans(smol_tokenizer, t.input_ids, t.loss_mask)[-1]
    assert assistant_texts(CONV, "<|im_end|>")[-1].startswith(last)


def test_mask_from_offsets_marks_tokens_starting_inside_spans():
    offsets = [(0, 2), (2, 5), (5, 6), (6, 9), (9, 12)]
    assert mask_from_offsets(offsets, [(2, 6), (9, 12)]) == [False, True, True, False, True]
    assert mask_from_offsets(offsets, []) == [False] * 5


def test_template_whose_prefixes_are_not_prefixes_is_refused(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    # Renders the number of messages first: a prefix conversation renders differently.
    tok.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m['role'] + ':' + m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(UserError, match="chat template"):
        tokenize_conversation(tok, CONV, 512)
