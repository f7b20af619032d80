"""The loss mask marks exactly the assistant tokens, checked by decoding the masked spans."""

from __future__ import annotations

import copy

import pytest

from conf.errors import UserError
from data_prep.template import load_chat_template, tokenize_conversation


def rows(tok, conv, max_length):
    return tokenize_conversation(load_chat_template(tok, None, {}, "2026-01-01"), conv, max_length)


def one_row(tok, conv, max_length):
    out = rows(tok, conv, max_length)
    assert len(out) == 1, "an append-only template keeps one row per conversation"
    return out[0]

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
    t = one_row(smol_tokenizer, conv, 4096)
    assert not t.truncated and len(t.input_ids) == len(t.loss_mask)
    assert masked_spans(smol_tokenizer, t.input_ids, t.loss_mask) == assistant_texts(CONV, "<|im_end|>")
    text = smol_tokenizer.decode(t.input_ids)
    assert (system or "You are a helpful AI assistant named SmolLM") in text


def test_llama3_style_template_masks_exactly_the_answers(llama3_tokenizer):
    conv = [{"role": "system", "content": "Be terse."}] + CONV
    # SmolLM2's BPE merges the header's "\n\n" into the answer's first token, so at serving
    # time the second turn's prompt (tokenised whole) does not extend the first turn's ids
    # (prompt ids + emitted ids): each turn is its own row, as it is served.
    out = rows(llama3_tokenizer, conv, 4096)
    assert all(t.input_ids.count(llama3_tokenizer.bos_token_id) == 1 for t in out)
    spans = sum((masked_spans(llama3_tokenizer, t.input_ids, t.loss_mask) for t in out), [])
    assert spans == assistant_texts(CONV, "<|eot_id|>")


def test_truncation_cuts_ids_and_mask_together(smol_tokenizer):
    full = one_row(smol_tokenizer, CONV, 4096)
    n = len(full.input_ids) - 5
    t = one_row(smol_tokenizer, CONV, n)
    assert t.truncated and len(t.input_ids) == len(t.loss_mask) == n
    assert t.input_ids == full.input_ids[:n] and t.loss_mask == full.loss_mask[:n]
    last = masked_spans(smol_tokenizer, t.input_ids, t.loss_mask)[-1]
    assert assistant_texts(CONV, "<|im_end|>")[-1].startswith(last)


def test_a_template_that_rewrites_history_gives_a_row_per_turn(smol_tokenizer):
    """A template whose render of a prefix is not a prefix of the whole (here: the message count
    first) serves each turn in its own context: one row per turn, each supervising its turn."""
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m['role'] + ':' + m['content'] + '<|im_end|>' }}"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    out = rows(tok, CONV, 512)
    assert len(out) == 2
    spans = [masked_spans(tok, r.input_ids, r.loss_mask) for r in out]
    assert spans == [[a] for a in assistant_texts(CONV, "<|im_end|>")]


def test_a_template_file_that_cannot_be_read_is_one_line(smol_tokenizer, tmp_path):
    bad = tmp_path / "t.jinja"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(UserError, match=r"data.chat_template=.*t.jinja.*cannot read it"):
        load_chat_template(smol_tokenizer, str(bad), {}, "2026-01-01")
    with pytest.raises(UserError, match="data.chat_template=.*no.jinja"):
        load_chat_template(smol_tokenizer, str(tmp_path / "no.jinja"), {}, "2026-01-01")
