"""Regeneration: target-written answers as token ids, turn by turn, resumable from a torn JSONL
cache; the rows' supervised ids are exactly the ids the target generated."""

from __future__ import annotations

import pytest

from conf.errors import UserError
from conf.schema import RegenerateConfig
from data_prep.answers.regenerate import EngineAnswerer, read_cache, regenerate
from data_prep.conversations.sources import Sample, answer_uid, prompt_uid
from data_prep.stats import PrepStats
from data_prep.template import build_rows, load_chat_template
from tests.support.split import validation_uids


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    return model, load_chat_template(tok, None, {}, "2026-01-01")


def engine(model, cfg: RegenerateConfig):
    return lambda: EngineAnswerer(model, cfg)


def supervised(row) -> list[int]:
    return [t for t, m in zip(row.input_ids, row.loss_mask) if m]


def user(text):
    return {"role": "user", "content": text}


SAMPLES = [
    Sample("0", [user("What is one plus one?")]),
    Sample("1", [{"role": "system", "content": "Be kind."}, user("Hi"), user("How are you?")]),
    Sample("2", [user("Name a colour.")]),
    Sample("3", [user("Tell me a story about a cat who lived on a boat.")]),
]


def test_answers_every_user_turn_and_resumes_from_a_torn_cache(tiny, tmp_path):
    model, tpl = tiny
    cfg = RegenerateConfig(max_new_tokens=6, batch_size=1)
    cache = tmp_path / "regen.jsonl"
    stats = PrepStats()
    first = regenerate(SAMPLES, engine(model, cfg), tpl, cfg, 512, cache, stats)
    assert [uid for uid, _ in first] == ["0", "1", "2", "3"]
    turns = first[1][1]
    assert len(turns) == 2 and 0 < stats.regenerated_tokens <= 5 * 6
    # Each turn is served in the template's context: the system prompt, the earlier answer.
    system, hi, how = SAMPLES[1].messages
    assert turns[0].context == tpl.prompt_ids([system, hi])
    answer = tpl.tok.decode(turns[0].ids, skip_special_tokens=True).strip()
    assert turns[1].context == tpl.prompt_ids([system, hi, {"role": "assistant", "content": answer}, how])
    # The rows supervise exactly the generated ids, after exactly the rendered prompt.
    for _, ts in first:
        rows = build_rows(ts, 512)
        assert sum(map(supervised, rows), []) == sum((t.ids for t in ts), [])
        assert rows[0].input_ids[: len(ts[0].context)] == ts[0].context
        assert not any(rows[0].loss_mask[: len(ts[0].context)])

    # A killed run: two finished lines, then half a line.
    lines = cache.read_bytes().splitlines(keepends=True)
    cache.write_bytes(b"".join(lines[:2]) + lines[2][:10])
    assert len(read_cache(cache)) == 2 and cache.read_bytes() == b"".join(lines[:2])
    cache.write_bytes(b"".join(lines[:2]) + lines[2][:10])
    stats = PrepStats()
    again = regenerate(SAMPLES, engine(model, cfg), tpl, cfg, 512, cache, stats)
    assert stats.regenerated_from_cache == 2
    assert again == first
    assert len(read_cache(cache)) == 4

    # A second run generates nothing.
    stats = PrepStats()
    assert regenerate(SAMPLES, engine(model, cfg), tpl, cfg, 512, cache, stats) == first
    assert stats.regenerated_tokens == 0 and stats.regenerated_from_cache == 4


def test_batched_left_padded_generation_and_length_budget(tiny, tmp_path):
    model, tpl = tiny
    cfg = RegenerateConfig(max_new_tokens=4, batch_size=4)
    long = "a question long enough to leave no room for an answer " * 3
    samples = [Sample("a", [user("Hi")]), Sample("b", [user("Hi"), user(long)]), Sample("c", [user(long)])]
    # The budget admits the short first prompts only: b keeps one turn, c is skipped.
    max_length = len(tpl.prompt_ids([user("Hi")])) + 2 + cfg.max_new_tokens
    stats = PrepStats()
    out = regenerate(samples, engine(model, cfg), tpl, cfg, max_length, tmp_path / "r.jsonl", stats)
    assert [uid for uid, _ in out] == ["a", "b"]
    assert len(out[1][1]) == 1
    assert stats.turns_dropped_too_long == 2 and stats.skipped_prompt_too_long == 1
    # Sampling with a temperature also runs through the same path.
    sampled = RegenerateConfig(max_new_tokens=3, batch_size=2, temperature=0.8, top_p=0.9)
    out = regenerate(SAMPLES[:1], engine(model, sampled), tpl, sampled, 512, tmp_path / "s.jsonl",
                     PrepStats())
    assert len(out[0][1][0].ids) > 0


def test_n_answers_per_prompt_are_samples_seeded_by_uid_and_split_by_prompt(tiny, tmp_path):
    model, tpl = tiny
    cfg = RegenerateConfig(max_new_tokens=8, batch_size=3, temperature=1.0, num_samples=3)
    out = regenerate(SAMPLES, engine(model, cfg), tpl, cfg, 512, tmp_path / "n.jsonl", PrepStats())
    uids = [uid for uid, _ in out]
    assert uids[:3] == ["0", "0~1", "0~2"] and len(uids) == 12
    answers = {uid: turns[-1].ids for uid, turns in out}
    assert len({tuple(answers[u]) for u in ("3", "3~1", "3~2")}) > 1, "n answers should differ"
    # Each answer is a function of its uid alone: another batch size and another set of
    # prompts give the same text.
    one = RegenerateConfig(**{**vars(cfg), "batch_size": 1})
    alone = regenerate(SAMPLES[3:], engine(model, one), tpl, one, 512, tmp_path / "alone.jsonl", PrepStats())
    assert [turns[-1].ids for _, turns in alone] == [answers["3"], answers["3~1"], answers["3~2"]]
    # Validation holds out whole prompts: no prompt has answers in both splits.
    many = [answer_uid(str(i), k) for i in range(200) for k in range(3)]
    val = validation_uids(many, seed=0, val_fraction=0.1)
    assert 0 < len(val) < len(many) and len(val) % 3 == 0
    assert {prompt_uid(u) for u in val}.isdisjoint({prompt_uid(u) for u in many if u not in val})


def test_num_samples_above_one_needs_sampling():
    with pytest.raises(UserError, match="data.regenerate.num_samples=2: greedy answers are all the same"):
        RegenerateConfig(num_samples=2)


@pytest.mark.parametrize("backend", ["hf", "server"])
def test_the_progress_bar_draws_every_answer_for_every_backend(tiny, tmp_path, backend):
    """The bar's path (`logging.progress=true`, what a user gets) answers as the quiet path does:
    it once died at the first answer, and only bar-less runs had been tested. The vLLM backend
    draws the same bar in tests/e2e/test_regen_server.py."""
    import io

    from tqdm import tqdm

    from data_prep.answers.regen_server import ServerAnswerer
    from tests.support.openai_server import Server

    model, tpl = tiny
    cfg = RegenerateConfig(max_new_tokens=4, batch_size=2)
    quiet = regenerate(SAMPLES, engine(model, cfg), tpl, cfg, 512, tmp_path / "quiet.jsonl", PrepStats())
    screen = io.StringIO()
    bar = lambda **kw: tqdm(file=screen, mininterval=0, **kw)  # noqa: E731
    if backend == "hf":
        drawn = regenerate(SAMPLES, engine(model, cfg), tpl, cfg, 512, tmp_path / "b.jsonl", PrepStats(), bar)
    else:
        with Server(model, tpl.tok) as s:
            served = RegenerateConfig(max_new_tokens=4, backend="server", endpoints=[s.url])
            answerer = lambda: ServerAnswerer(served, "tiny", "", tpl.tok)  # noqa: E731
            drawn = regenerate(SAMPLES, answerer, tpl, served, 512, tmp_path / "b.jsonl", PrepStats(), bar)
    assert drawn == quiet
    shown = screen.getvalue()
    assert "regenerate: 100%" in shown and "5/5" in shown and "tok_s=" in shown
    assert backend == "hf" or "ep0=" in shown
