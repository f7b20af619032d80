"""Regeneration through OpenAI-compatible servers (`data.regenerate.backend=server`): the answers
are the hf engine's, spread over every endpoint, kept through failures and resumed after a dead
server; a server that goes silent (connections held, nothing sent) is dropped in about
`silence_s`, its prompts answered by the others; a server of another model, a missing key and a
bad endpoint list stop in one line.

The servers are tests/support/openai_server.py's (draftsmith's engine behind vLLM's API, with
failures on cue); tests/e2e/test_regen_server.py runs the real vLLM server. Real sockets and real
silences (each `silence_s` waited out): 13-20 s, in e2e since #62 (tests/unit/data_prep/ keeps the
engine backend's tests).
"""

from __future__ import annotations

import time

import pytest

from conf.schema import RegenerateConfig
from data_prep.answers.regen_server import ServerAnswerer
from data_prep.answers.regenerate import EngineAnswerer, read_cache, regenerate
from data_prep.conversations.sources import Sample
from data_prep.stats import PrepStats
from data_prep.template import load_chat_template
from tests.support.openai_server import Behaviour, Server
from tests.support.runs import user_error_line

SAMPLES = [Sample(str(i), [{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}])
           for i in range(10)]


@pytest.fixture(scope="module")
def tiny(tiny_llama, tiny_llama_dir):
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    return model, load_chat_template(tok, None, {}, "2026-01-01"), str(tiny_llama_dir)


def server_cfg(*servers: Server, **extra) -> RegenerateConfig:
    fields = {"max_new_tokens": 5, "in_flight": 2, "retries": 2, **extra}
    return RegenerateConfig(backend="server", endpoints=[s.url for s in servers], **fields)


def through(servers_cfg: RegenerateConfig, tiny, cache, samples=SAMPLES, stats=None):
    model, tpl, path = tiny
    answerer = lambda: ServerAnswerer(servers_cfg, "tiny", path, tpl.tok)  # noqa: E731
    return regenerate(samples, answerer, tpl, servers_cfg, 512, cache, stats or PrepStats())


def test_two_servers_answer_as_the_engine_does_and_both_are_used(tiny, tmp_path):
    model, tpl, path = tiny
    local = RegenerateConfig(max_new_tokens=5, batch_size=4)
    engine = lambda: EngineAnswerer(model, local)  # noqa: E731
    expected = regenerate(SAMPLES, engine, tpl, local, 512, tmp_path / "hf.jsonl", PrepStats())
    a, b = Behaviour(model_id="tiny"), Behaviour(model_id="x", root=path)  # by name, by folder
    with Server(model, tpl.tok, a) as sa, Server(model, tpl.tok, b) as sb:
        stats = PrepStats()
        got = through(server_cfg(sa, sb), tiny, tmp_path / "server.jsonl", stats=stats)
    assert got == expected
    assert a.answered and b.answered and len(a.answered) + len(b.answered) == len(SAMPLES)
    assert stats.regenerated_tokens == sum(len(t.ids) for _, ts in got for t in ts)


def test_transient_errors_are_retried(tiny, tmp_path):
    model, tpl, _ = tiny
    flaky = Behaviour(fail_first=2)
    with Server(model, tpl.tok, flaky) as s:
        got = through(server_cfg(s), tiny, tmp_path / "r.jsonl", SAMPLES[:3])
    assert len(got) == 3 and flaky.requests == 5


def test_a_dead_server_loses_no_answer_and_the_rerun_asks_only_for_the_rest(tiny, tmp_path):
    model, tpl, _ = tiny
    cache = tmp_path / "r.jsonl"
    dying = Behaviour(die_after=4)
    with Server(model, tpl.tok, dying) as s:
        line = user_error_line(lambda: through(server_cfg(s), tiny, cache))
    assert line.startswith("error: data.regenerate.endpoints: no server answers (") and "run again" in line
    kept = read_cache(cache)
    assert len(kept) == 4
    # The rerun on another server asks for the six prompts left, and only those.
    fresh = Behaviour()
    with Server(model, tpl.tok, fresh) as s:
        stats = PrepStats()
        got = through(server_cfg(s), tiny, cache, stats=stats)
    assert len(got) == len(SAMPLES) and len(fresh.answered) == 6 and stats.regenerated_from_cache == 4


def test_one_dead_endpoint_leaves_its_prompts_to_the_others(tiny, tmp_path):
    model, tpl, _ = tiny
    dying, alive = Behaviour(die_after=1), Behaviour()
    with Server(model, tpl.tok, dying) as sd, Server(model, tpl.tok, alive) as sa:
        got = through(server_cfg(sd, sa), tiny, tmp_path / "r.jsonl")
    assert len(got) == len(SAMPLES) and len(dying.answered) + len(alive.answered) == len(SAMPLES)


def test_a_silent_endpoint_costs_one_silence_and_the_other_answers_its_prompts(tiny, tmp_path):
    """The silent server holds its requests open and sends nothing (a blocking request waited
    `timeout_s`): one `silence_s` later the prompts it held are answered by the good server, and
    every answer is the one a server that never fell silent gives."""
    model, tpl, _ = tiny
    silence = 2.0
    with Server(model, tpl.tok) as s:
        expected = through(server_cfg(s), tiny, tmp_path / "ref.jsonl")
    mute, alive = Behaviour(silent_after=1), Behaviour()
    with Server(model, tpl.tok, mute) as sm, Server(model, tpl.tok, alive) as sa:
        cfg = server_cfg(sm, sa, retries=4, silence_s=silence)
        start = time.monotonic()
        got = through(cfg, tiny, tmp_path / "r.jsonl")
        took = time.monotonic() - start
    assert got == expected
    assert mute.held >= 1 and len(mute.answered) == 1 and len(alive.answered) == len(SAMPLES) - 1
    assert silence <= took < 2 * silence, took


def test_the_only_endpoint_silent_stops_in_one_line_keeping_every_answer(tiny, tmp_path):
    model, tpl, _ = tiny
    cache = tmp_path / "r.jsonl"
    mute = Behaviour(silent_after=4)
    with Server(model, tpl.tok, mute) as s:
        start = time.monotonic()
        line = user_error_line(lambda: through(server_cfg(s, retries=4, silence_s=1), tiny, cache))
        took = time.monotonic() - start
    assert took < 2.5, took  # about one silence_s: retried, each of its silences took one more
    assert line.startswith(f"error: data.regenerate.endpoints: no server answers ({s.url}: silent for 1 s "
                           "(data.regenerate.silence_s)); 4 of 10 answers of this round are cached"), line
    assert len(read_cache(cache)) == 4
    fresh = Behaviour()
    with Server(model, tpl.tok, fresh) as s:
        got = through(server_cfg(s), tiny, cache)
    assert len(got) == len(SAMPLES) and len(fresh.answered) == 6


@pytest.mark.parametrize("behaviour, says", [
    (Behaviour(model_id="other-model"), "serves ['other-model'], not the target 'tiny'"),
    (Behaviour(token_offset=1), "tokenizes text otherwise than the target 'tiny': it serves another model"),
])
def test_a_server_of_another_model_is_refused_before_any_request(tiny, tmp_path, behaviour, says):
    model, tpl, _ = tiny
    with Server(model, tpl.tok, behaviour) as s:
        line = user_error_line(lambda: through(server_cfg(s), tiny, tmp_path / "r.jsonl"))
    assert line.startswith(f"error: data.regenerate.endpoints: {s.url}") and says in line
    assert behaviour.requests == 0 and not (tmp_path / "r.jsonl").exists()


def test_the_api_key_comes_from_the_environment_and_is_never_shown(tiny, tmp_path, monkeypatch):
    model, tpl, _ = tiny
    secret = "sk-never-shown-0123"
    guarded = Behaviour(key=secret)
    with Server(model, tpl.tok, guarded) as s:
        line = user_error_line(lambda: through(server_cfg(s, api_key_env="DS_KEY"), tiny, tmp_path / "a"))
        assert line == "error: data.regenerate.api_key_env='DS_KEY': no such environment variable"
        monkeypatch.setenv("DS_KEY", "wrong")
        line = user_error_line(lambda: through(server_cfg(s, api_key_env="DS_KEY"), tiny, tmp_path / "b"))
        assert "HTTP 401" in line and "wrong" not in line
        monkeypatch.setenv("DS_KEY", secret)
        got = through(server_cfg(s, api_key_env="DS_KEY"), tiny, tmp_path / "c.jsonl", SAMPLES[:2])
    assert len(got) == 2 and secret not in (tmp_path / "c.jsonl").read_text()


@pytest.mark.parametrize("fields, says", [
    ({"endpoints": ["http://h:1/v1"]}, "given with data.regenerate.backend=server only"),
    ({"backend": "server", "endpoints": ["h:1"]}, "data.regenerate.endpoints=['h:1']"),
    ({"api_key_env": "not a name"}, "data.regenerate.api_key_env='not a name': expected null or the name"),
    ({"silence_s": 0}, "data.regenerate.silence_s=0: expected a number >= 1"),
])
def test_bad_server_settings_are_one_line(fields, says):
    assert says in user_error_line(lambda: RegenerateConfig(**fields))


def test_no_endpoints_is_refused_only_when_an_answer_is_missing(tiny, tmp_path):
    model, tpl, _ = tiny
    with Server(model, tpl.tok) as s:
        through(server_cfg(s), tiny, tmp_path / "r.jsonl", SAMPLES[:2])
    cached = RegenerateConfig(max_new_tokens=5, backend="server")
    assert len(through(cached, tiny, tmp_path / "r.jsonl", SAMPLES[:2])) == 2  # no server needed
    line = user_error_line(lambda: through(cached, tiny, tmp_path / "r.jsonl", SAMPLES[:3]))
    assert line.startswith("error: data.regenerate.endpoints=[]: some answers or states are not cached yet")
