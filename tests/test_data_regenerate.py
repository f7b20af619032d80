"""Regeneration: target-written answers, turn by turn, resumable from a torn JSONL cache."""

from __future__ import annotations

from collections import Counter

import pytest

from conf.schema import RegenerateConfig
from data_prep.regenerate import read_cache, regenerate
from data_prep.sources import Sample
from data_prep.target import load_target
from data_prep.template import prompt_ids


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_target(str(tiny_llama_dir), num_threads=1)


def user(text):
    return {"role": "user", "content": text}


SAMPLES = [
    Sample("0", [user("What is one plus one?")]),
    Sample("1", [{"role": "system", "content": "Be kind."}, user("Hi"), user("How are you?")]),
    Sample("2", [user("Name a colour.")]),
    Sample("3", [user("Tell me a story about a cat who lived on a boat.")]),
]


def test_answers_every_user_turn_and_resumes_from_a_torn_cache(tiny, tmp_path):
    model, tok = tiny
    cfg = RegenerateConfig(max_new_tokens=6, batch_size=1)
    cache = tmp_path / "regen.jsonl"
    stats = Counter()
    first = regenerate(SAMPLES, model, tok, cfg, 512, cache, stats)
    assert [s.uid for s in first] == ["0", "1", "2", "3"]
    roles = [m["role"] for m in first[1].messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"].strip() == m["content"] for m in first[1].messages)
    assert 0 < stats["regenerated_tokens"] <= 5 * 6

    # A killed run: two finished lines, then half a line.
    lines = cache.read_bytes().splitlines(keepends=True)
    cache.write_bytes(b"".join(lines[:2]) + lines[2][:10])
    assert len(read_cache(cache)) == 2 and cache.read_bytes() == b"".join(lines[:2])
    cache.write_bytes(b"".join(lines[:2]) + lines[2][:10])
    stats = Counter()
    again = regenerate(SAMPLES, model, tok, cfg, 512, cache, stats)
    assert stats["regenerated_from_cache"] == 2
    assert again == first
    assert len(read_cache(cache)) == 4

    # A second run generates nothing.
    stats = Counter()
    assert regenerate(SAMPLES, model, tok, cfg, 512, cache, stats) == first
    assert stats["regenerated_tokens"] == 0 and stats["regenerated_from_cache"] == 4


def test_batched_left_padded_generation_and_length_budget(tiny, tmp_path):
    model, tok = tiny
    cfg = RegenerateConfig(max_new_tokens=4, batch_size=4)
    long = "a question long enough to leave no room for an answer " * 3
    samples = [Sample("a", [user("Hi")]), Sample("b", [user("Hi"), user(long)]), Sample("c", [user(long)])]
    # The budget admits the short first prompts only: b keeps one turn, c is skipped.
    max_length = len(prompt_ids(tok, [user("Hi")])) + 2 + cfg.max_new_tokens
    stats = Counter()
    out = regenerate(samples, model, tok, cfg, max_length, tmp_path / "r.jsonl", stats)
    assert [s.uid for s in out] == ["a", "b"]
    assert [m["role"] for m in out[1].messages] == ["user", "assistant"]
    assert stats["turns_dropped_too_long"] == 2 and stats["skipped_prompt_too_long"] == 1
    # Sampling with a temperature also runs through the same path.
    sampled = RegenerateConfig(max_new_tokens=3, batch_size=2, temperature=0.8, top_p=0.9)
    out = regenerate(SAMPLES[:1], model, tok, sampled, 512, tmp_path / "s.jsonl", Counter())
    assert out[0].messages[-1]["role"] == "assistant"
