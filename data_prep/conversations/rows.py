"""Which samples a data folder holds and their training rows: the first `max_samples` usable
conversations of the source, and the token rows of each, as it is or as the target answered it
(`data_prep.folders.build.sample_rows` runs the answering and spills the rows to disk).

Rows here need no target's weights: a conversation's rows come from the chat template alone, a
regenerated one's from the prompt ids and the answer ids the answers stage hands back."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Iterator

from conf.errors import UserError
from conf.schema import RootConfig, derive
from conf.sizes import Sizes
from data_prep.conversations.sources import Sample, answer_uid, iter_samples, row_uid
from data_prep.stats import PrepStats
from data_prep.template import (
    ChatTemplate,
    TemplateError,
    Tokenized,
    build_rows,
    conversation_turns,
    note_refusal,
)


def select_samples(cfg: RootConfig, tpl: ChatTemplate, stats: PrepStats) -> Iterator[Sample]:
    """The first `max_samples` usable samples, lazily (the source is read as far as they take);
    with regeneration, those whose first prompt leaves room for a whole answer within max_length
    (so no generation is wasted on truncated text) and that the template renders."""
    d = cfg.data
    samples = iter_samples(d, stats)
    if d.regenerate.enabled:
        budget = d.max_length - d.regenerate.max_new_tokens

        def fits(s: Sample) -> bool:
            first_user = next(i for i, m in enumerate(s.messages) if m["role"] == "user")
            try:
                ok = len(tpl.prompt_ids(s.messages[: first_user + 1], s.tools)) <= budget
            except TemplateError as err:
                note_refusal(stats, tpl, s.where or s.uid, err)
                return False
            stats.skipped_prompt_too_long += not ok
            return ok

        samples = filter(fits, samples)
    return itertools.islice(samples, Sizes.of(cfg).conversations or None)


Spans = tuple[tuple[int, int], ...]  # [start, end) positions among the selected samples


def cached_spans(cfg: RootConfig, tpl: ChatTemplate, cache: Collection[str]) -> Spans:
    """The runs of positions, in the order a data folder selects its samples (`select_samples`
    with no `max_samples`), whose every answer (`answer_uid`) the regeneration cache holds.

    The plan counts these conversations as free. They are seldom the first n: a multi-turn
    regeneration answers round by round, so a killed or smaller run leaves the one-turn
    conversations of its range cached and its long ones not (a long-context run counted 155
    cached conversations as its first 155 and regenerated three times what it planned). The
    source is read until every cached prompt is placed, or a few times the cache's size past it
    (entries of another selection are then left out: priced as new)."""
    answers = cfg.data.regenerate.num_samples
    everything = derive(cfg, {"data.max_samples": 0})
    spans: list[list[int]] = []
    found, limit = 0, 4 * len(cache) // answers + 1000
    for i, s in enumerate(select_samples(everything, tpl, PrepStats())):
        if found * answers >= len(cache) or i >= limit:
            break
        if all(answer_uid(s.uid, k) in cache for k in range(answers)):
            found += 1
            if spans and spans[-1][1] == i:
                spans[-1][1] = i + 1
            else:
                spans.append([i, i + 1])
    return tuple((a, b) for a, b in spans)


def cached_before(spans: Spans, n: int) -> int:
    """How many of the first `n` selected samples are cached."""
    return sum(max(0, min(b, n) - a) for a, b in spans)


def uncached_prefix(spans: Spans, k: int) -> int:
    """The fewest first samples that hold `k` uncached ones."""
    n = k
    while n - cached_before(spans, n) < k:
        n += k - (n - cached_before(spans, n))
    return n


def iter_rows(
    samples: Iterable[Sample], tpl: ChatTemplate, max_length: int, stats: PrepStats
) -> Iterator[tuple[str, Tokenized]]:
    """(row uid, Tokenized) of every row of conversations used as they are (no regeneration),
    each tokenised once; turns and conversations that cannot be trained are counted by reason.
    Raises a UserError when most assistant turns were dropped: a template that does not fit the
    data, which would otherwise train on almost nothing."""
    first_bad = None
    for s in samples:
        turns_in = sum(m["role"] == "assistant" for m in s.messages)
        stats.assistant_turns += turns_in
        raw_before = stats.turns_raw_text
        try:
            turns = conversation_turns(tpl, s.messages, s.tools, stats)
        except TemplateError as err:
            note_refusal(stats, tpl, s.where or s.uid, err)
            stats.turns_dropped_refused += turns_in
            turns = []
        if len(turns) < turns_in:
            first_bad = first_bad or s.where or s.uid
        if stats.turns_raw_text and not raw_before:
            print(
                f"data: {tpl.name} drops part of an assistant turn (e.g. its reasoning), first at "
                f"{s.where or s.uid}: such turns train as the generation prompt followed by the "
                "assistant's raw text, as the model emits it"
            )
        for r, t in enumerate(build_rows(turns, max_length)):
            stats.truncated += t.truncated
            if not any(t.loss_mask):
                stats.skipped_no_assistant_token += 1
                continue
            yield row_uid(s.uid, r), t
    if first_bad and 2 * stats.dropped_turns() > stats.assistant_turns:
        raise UserError(
            f"{tpl.name}: {stats.dropped_turns()} of {stats.assistant_turns} assistant turns could not be "
            f"trained (first at {first_bad}; counts: {stats.drop_counts()}); check data.chat_template and "
            "data.chat_template_kwargs against the data"
        )


def regenerated_rows(
    answered: Iterable[tuple[str, list]], max_length: int, stats: PrepStats
) -> Iterator[tuple[str, Tokenized]]:
    """(row uid, Tokenized) of regenerated conversations: prompt ids and generated ids."""
    for uid, turns in answered:
        for r, t in enumerate(build_rows(turns, max_length)):
            stats.truncated += t.truncated
            yield row_uid(uid, r), t
