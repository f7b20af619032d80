"""Chat template + loss mask: which tokens of a rendered conversation are the assistant's.

The target tokenizer's own template renders the text; the assistant spans are found as character
ranges between rendered prefixes, then mapped to tokens through the offset mapping. Nothing here
knows any template's markup, so it works for every template whose prefixes render as prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

from conf.errors import UserError
from data_prep.sources import Message


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[bool]
    truncated: bool  # the rendered conversation was longer than max_length


def render(tok, messages: list[Message], add_generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _prefix(tok, text: str, messages: list[Message], add_generation_prompt: bool) -> int:
    prefix = render(tok, messages, add_generation_prompt) if messages else ""
    if not text.startswith(prefix):
        raise UserError(
            "target tokenizer's chat template renders a conversation prefix differently from the "
            "full conversation, so assistant turns cannot be located (expected a template whose "
            "rendering of messages[:i] is a prefix of the rendering of messages)"
        )
    return len(prefix)


def assistant_spans(tok, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the [start, end) character span of each assistant turn.

    A span starts after the generation prompt and ends after the turn's closing markup (the
    end-of-turn token) with trailing whitespace removed, i.e. exactly what the model must emit.
    """
    text = render(tok, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _prefix(tok, text, messages[:i], add_generation_prompt=True)
        end = _prefix(tok, text, messages[: i + 1], add_generation_prompt=False)
        end = start + len(text[start:end].rstrip())
        spans.append((start, end))
    return text, spans


def mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """A token is trainable when it starts inside an assistant span."""
    mask, j = [], 0
    for start, _ in offsets:
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        mask.append(j < len(spans) and spans[j][0] <= start)
    return mask


def tokenize_conversation(tok, messages: list[Message], max_length: int) -> Tokenized:
    text, spans = assistant_spans(tok, messages)
    # The template already contains any BOS it wants; the tokenizer must not add another.
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = mask_from_offsets(offsets, spans)
    truncated = len(ids) > max_length
    return Tokenized(ids[:max_length], mask[:max_length], truncated)


def prompt_ids(tok, messages: list[Message]) -> list[int]:
    """Token ids of `messages` followed by the generation prompt: what the target continues."""
    return tok(render(tok, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
