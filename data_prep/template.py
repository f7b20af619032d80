"""Chat template -> token rows and loss masks: exactly the tokens the target sees and emits.

Every render in draftsmith (data prep, regeneration, the evaluator's prompts) goes through one
`ChatTemplate`: the tokenizer's template or `data.chat_template`, with
`data.chat_template_kwargs`, and `strftime_now` pinned to `data.template_date` so a template that
prints today's date gives the same bytes on any day.

Boundaries are found on token ids, never on characters: for each assistant turn i, the context is
the generation-prompt render of `messages[:i]` and the turn is what the render of
`messages[:i+1]` adds after it, through the first stop token (the newline a template puts after
it is not emitted, so not supervised). Tokens the generation prompt supplies are never supervised.
A turn whose context extends the current row's ids (append-only templates: Llama 3, Qwen2.5,
Gemma 3, SmolLM2) joins that row; a template that rewrites history (Qwen3 drops earlier reasoning,
gpt-oss keeps the analysis channel on the last turn only, Mistral v0.3 moves the system text into
the last user turn) starts a new row per turn, as each turn is served in its own context.

Where the full render is not a token-level extension of the context (R1 distills strip the
reasoning from every assistant turn; their generation prompt ends `<think>\\n`), the turn is the
context followed by the assistant's raw text as the model emits it: reasoning, answer, stop token.
Reasoning arrives as `reasoning_content`, `thinking` or inline `<think>...</think>` and is handed
to the template in the field it reads (probed once), or inline when it reads none.

Regenerated data needs none of this: its rows are the prompt ids the template rendered and the
ids the target generated (`Turn`), merged by the same `build_rows`.
"""

from __future__ import annotations

import datetime
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError

from conf.errors import UserError, first_line
from data_prep.stats import PrepStats

Message = dict[str, Any]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Fields a template may read an assistant message's reasoning from (Qwen3, gpt-oss).
REASONING_FIELDS = ("reasoning_content", "thinking")
_PROBE = "draftsmith-reasoning-probe"
_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")
_HARMONY = re.compile(r"<\|channel\|>(analysis|final)<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", re.S)


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[bool]
    truncated: bool  # the row was longer than max_length
    uid: str = ""  # the row's sample uid, once known (`sources.row_uid`); shards record it


@dataclass
class Turn:
    """One assistant turn: the ids it is served after, and the ids it emits (mask: which of
    them are supervised; None = all)."""

    context: list[int]
    ids: list[int]
    mask: list[bool] | None = None


def split_reasoning(message: Message) -> tuple[str | None, str]:
    """(reasoning, answer) of an assistant message: from `reasoning_content`/`thinking`, or an
    inline `<think>...</think>` at the start of the content."""
    content = message.get("content") or ""
    for key in ("reasoning",) + REASONING_FIELDS:
        if isinstance(message.get(key), str):
            return message[key], content
    head, sep, tail = content.partition(THINK_CLOSE)
    if sep and THINK_OPEN in head:
        return head.split(THINK_OPEN, 1)[1].strip("\n"), tail.lstrip("\n")
    return None, content


def parse_answer(text: str) -> Message:
    """A generated answer's text (special tokens kept, stop token removed) -> an assistant
    message: gpt-oss harmony channels, or inline `<think>`, or plain content."""
    channels = dict((c, t) for c, t in _HARMONY.findall(text)) if "<|channel|>" in text else {}
    if channels:
        reasoning, content = channels.get("analysis"), channels.get("final", "")
    else:
        reasoning, content = split_reasoning({"content": text})
    message: Message = {"role": "assistant", "content": content.strip()}
    if reasoning is not None:
        message["reasoning"] = reasoning.strip()
    return message


def inline_reasoning(reasoning: str | None, content: str) -> str:
    """The assistant's raw text with its reasoning inline, as reasoning models emit it."""
    if not reasoning:
        return content
    return f"{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n{content}"


@dataclass
class ChatTemplate:
    """The target's chat template as it is served: one object renders every prompt and row."""

    tok: Any
    source: str  # the Jinja text
    kwargs: dict  # data.chat_template_kwargs
    date: str  # data.template_date: what strftime_now sees
    stop_ids: frozenset[int] = frozenset()
    name: str = "the tokenizer's chat template"  # for messages
    reasoning_field: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.stop_ids and self.tok.eos_token_id is not None:
            self.stop_ids = frozenset({self.tok.eos_token_id})
        self.reasoning_field = self._probe_reasoning_field()

    @property
    def digest(self) -> str:
        """Identity of what renders: the template text, its arguments and the pinned date."""
        key = repr((self.source, sorted(self.kwargs.items()), self.date))
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def _strftime_now(self, fmt: str) -> str:
        return datetime.datetime.strptime(self.date, "%Y-%m-%d").strftime(fmt)

    def _probe_reasoning_field(self) -> str | None:
        """The message field this template reads reasoning from, or None (then it goes inline)."""
        for key in REASONING_FIELDS:
            msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: _PROBE}]
            try:
                if _PROBE in self._render(msgs, False, None):
                    return key
            except (TemplateError, TypeError, KeyError, ValueError):
                continue
        return None

    def for_template(self, message: Message) -> Message:
        """A normalised message as this template wants it: reasoning in its field or inline."""
        out = {k: v for k, v in message.items() if k != "reasoning"}
        if message["role"] != "assistant" or "reasoning" not in message:
            return out
        if self.reasoning_field:
            out[self.reasoning_field] = message["reasoning"]
        else:
            out["content"] = inline_reasoning(message["reasoning"], message.get("content") or "")
        return out

    def _render(self, messages: list[Message], add_generation_prompt: bool, tools) -> str:
        # transformers' own compiled template (its filters and `raise_exception`, as serving
        # engines render it); rendered here because `apply_chat_template` turns callables in its
        # kwargs into strings, and a `strftime_now` passed as a variable shadows the global.
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(self.source).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.tok.special_tokens_map,
            **self.kwargs,
            strftime_now=self._strftime_now,
        )

    def render(self, messages: list[Message], add_generation_prompt: bool = False, tools=None) -> str:
        """The template's text; its own refusals (`raise_exception`) propagate as TemplateError."""
        return self._render([self.for_template(m) for m in messages], add_generation_prompt, tools)

    def encode(self, text: str) -> list[int]:
        # The template already holds any BOS it wants; the tokenizer must not add another.
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def ids(self, messages: list[Message], add_generation_prompt: bool = False, tools=None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt, tools))

    def prompt_ids(self, messages: list[Message], tools=None) -> list[int]:
        """What the target continues: `messages` and the generation prompt."""
        return self.ids(messages, add_generation_prompt=True, tools=tools)

    @property
    def stop_id(self) -> int:
        """The stop token a raw turn ends with."""
        eos = self.tok.eos_token_id
        return eos if eos in self.stop_ids else min(self.stop_ids)

    def through_stop(self, ids: list[int]) -> list[int]:
        """`ids` up to and including the first stop token; without one, trailing whitespace-only
        tokens removed (nothing after the turn's text is emitted)."""
        for i, t in enumerate(ids):
            if t in self.stop_ids:
                return ids[: i + 1]
        end = len(ids)
        while end and not self.tok.decode(ids[end - 1 : end]).strip():
            end -= 1
        return ids[:end]

    def emitted_mask(self, ids: list[int], has_reasoning: bool) -> list[bool]:
        """Which of a turn's ids the model emits: all, except an empty reasoning block the template
        wrote in when the data has none (Qwen3 with thinking on): the model would have reasoned."""
        mask = [True] * len(ids)
        if has_reasoning:
            return mask
        k = next((k for k in range(1, min(len(ids), 16) + 1) if THINK_CLOSE in self.tok.decode(ids[:k])), 0)
        if k and _EMPTY_THINK.fullmatch(self.tok.decode(ids[:k])):
            while k < len(ids) and not self.tok.decode(ids[k : k + 1]).strip():
                k += 1  # the blank line after </think>
            mask[:k] = [False] * k
        return mask

    def raw_turn(self, message: Message, context_text: str) -> list[int]:
        """The assistant's raw text as the model emits it after `context_text` (less what the
        generation prompt already holds, e.g. R1's `<think>\\n`), then the stop token."""
        reasoning, content = split_reasoning(message)
        text = inline_reasoning(reasoning, content)
        overlap = next((k for k in range(min(len(text), 64), 0, -1) if context_text.endswith(text[:k])), 0)
        return self.encode(text[overlap:]) + [self.stop_id]


def load_chat_template(
    tok, path: str | None, kwargs: dict | None, date: str, stop_ids=frozenset()
) -> ChatTemplate:
    """The configured template: `path` (a .jinja file) or the tokenizer's own."""
    if path:
        file = Path(path).expanduser()
        try:
            source = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(
                f"data.chat_template={path!r}: cannot read it ({err.__class__.__name__})"
            ) from None
        name = f"data.chat_template={path!r}"
    else:
        source = tok.chat_template
        name = "the tokenizer's chat template"
        if not isinstance(source, str) or not source:
            raise UserError(
                "the target's tokenizer has no chat template: set data.chat_template=<file.jinja>"
            )
    return ChatTemplate(tok, source, dict(kwargs or {}), date, frozenset(stop_ids), name)


def note_refusal(stats: PrepStats, tpl: ChatTemplate, where: str, err: Exception) -> None:
    """Count a conversation the template itself refuses; the first one is named once."""
    if not stats.conversations_refused_by_template:
        print(
            f"data: {tpl.name} refuses {where}: {first_line(err)} (such conversations are skipped "
            "and counted)"
        )
    stats.conversations_refused_by_template += 1


def build_rows(turns: list[Turn], max_length: int) -> list[Tokenized]:
    """Training rows from turns in order: a turn whose context extends the current row's ids joins
    it (the gap, e.g. the next user turn, unsupervised); any other starts a new row."""
    rows: list[tuple[list[int], list[bool]]] = []
    for turn in turns:
        if rows and turn.context[: len(rows[-1][0])] == rows[-1][0]:
            ids, mask = rows[-1]
            mask += [False] * (len(turn.context) - len(ids))
            ids[:] = turn.context
        else:
            rows.append((list(turn.context), [False] * len(turn.context)))
            ids, mask = rows[-1]
        ids += turn.ids
        mask += turn.mask if turn.mask is not None else [True] * len(turn.ids)
    return [Tokenized(ids[:max_length], mask[:max_length], len(ids) > max_length) for ids, mask in rows]


def conversation_turns(tpl: ChatTemplate, messages: list[Message], tools, stats: PrepStats) -> list[Turn]:
    """Every assistant turn of a conversation used as it is, located on token ids.

    Raises TemplateError when the template refuses the conversation (the caller counts it)."""
    turns = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        context_text = tpl.render(messages[:i], True, tools)
        full_text = tpl.render(messages[: i + 1], tools=tools)
        context, full = tpl.encode(context_text), tpl.encode(full_text)
        if full[: len(context)] == context or full_text.startswith(context_text):
            # On ids where the boundary falls between tokens; where one token straddles it (a
            # marker that is not one token), the turn's text is tokenised on its own, as the model
            # emits it after the prompt's ids.
            if full[: len(context)] == context:
                after = full[len(context) :]
            else:
                after = tpl.encode(full_text[len(context_text) :])
                stats.turns_split_in_text += 1
            ids = tpl.through_stop(after)
            mask = tpl.emitted_mask(ids, split_reasoning(m)[0] is not None)
        elif any(split_reasoning(m)):
            # The template drops part of the turn itself: train on what the model emits.
            ids, mask = tpl.raw_turn(m, context_text), None
            stats.turns_raw_text += 1
        else:
            stats.turns_dropped_unaligned += 1
            continue
        if not ids or (mask is not None and not any(mask)):
            stats.turns_dropped_empty += 1
            continue
        turns.append(Turn(context, ids, mask))
    return turns


def tokenize_conversation(
    tpl: ChatTemplate, messages: list[Message], max_length: int, tools=None, stats: PrepStats | None = None
) -> list[Tokenized]:
    """The training rows of one conversation (see the module docstring)."""
    turns = conversation_turns(tpl, messages, tools, PrepStats() if stats is None else stats)
    return build_rows(turns, max_length)
