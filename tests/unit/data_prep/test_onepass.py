"""Regeneration and capture in one pass (`data_prep.states.onepass`): the engine's kept states are the
states a capture forward computes over the same conversation, the answers do not change, and a
`OnePassCapturer` gives the fields `HfCapturer` gives, asking the target only for rows the
store lacks."""

from __future__ import annotations

import json
import shutil

import torch

from data_prep.answers.regen_engine import generate
from data_prep.prepare import prepare
from data_prep.states.capture import TOP, CaptureSpec, HfCapturer
from data_prep.states.onepass import OnePassCapturer, StateStore, ids_name
from tests.support.runs import assert_states_close, conversations, tiny_prep_config
from tests.support.targets import chat

SPEC = CaptureSpec((1, 2, 3), 4, "bfloat16", target_top=True)  # the tiny targets have 4 layers


def answer(model, prompts, eos, kept=None, **kw):
    """The engine's answers, and with `kept` its states by prompt index."""
    states: dict[int, tuple[list[int], torch.Tensor]] = {}
    keep = (lambda i, ids, s: states.setdefault(i, (ids, s))) if kept else None
    got = generate(model, prompts, max_new_tokens=16, batch_size=5, eos_token_ids=eos, prefill_tokens=150,
                   kept_layers=kept or (), on_states=keep, **kw)
    return got, states


def forward_states(model, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.stack([hs[i][0] for i in layers], dim=1)


def test_the_engine_keeps_every_position_s_states_and_writes_the_same_answers(chaotic):
    model, tok = chaotic
    prompts = chat(tok, 12)
    plain, _ = answer(model, prompts, eos=set())
    eos = {plain[i][(5 * i) % 16] for i in range(0, 12, 3)}  # answers end at varied steps
    plain, _ = answer(model, prompts, eos)
    layers = (1, 3, 4)
    for workers in (1, 2):
        got, states = answer(model, prompts, eos, kept=layers, workers=workers)
        assert got == plain and sorted(states) == list(range(12))
        for i, (ids, s) in states.items():
            assert ids == prompts[i] + got[i]  # the answer's last token too
            want = forward_states(model, ids, layers)
            assert s.shape == want.shape
            # float32 throughout: what the forward over the whole conversation computes, to the
            # rounding of attention over another width (measured below 1e-4 of the largest value).
            assert (s - want).abs().max() <= 1e-4 * want.abs().max()


def test_one_pass_fields_equal_the_capture_forward_s_and_only_missing_rows_run_the_target(chaotic, tmp_path):
    model, tok = chaotic
    prompts = chat(tok, 8)
    store = StateStore(tmp_path / "states", SPEC, model.get_output_embeddings)
    got, states = answer(model, prompts, eos=set(), kept=store.layers)
    for ids, s in states.values():
        store.keep(ids, s)
    rows = [p + a for p, a in zip(prompts, got)]
    (tmp_path / "states" / f"{ids_name(rows[0])}.safetensors").unlink()  # one left to the target
    asked: list[list[int]] = []
    hf = HfCapturer(model, SPEC, 4096)

    def fallback():
        def capture(samples, names):
            asked.extend(samples)
            return hf(samples, names)
        return capture, torch.no_grad()

    one = list(OnePassCapturer(store, fallback)(rows, [f"row {i}" for i in range(8)]))
    two = list(hf(rows, [f"row {i}" for i in range(8)]))
    assert asked == [rows[0]] and store.served == sum(map(len, rows[1:]))
    for a, b in zip(one, two):
        assert a.keys() == b.keys() == {"aux_hidden", "final_hidden", TOP}
        for k in ("aux_hidden", "final_hidden"):  # both as stored: bf16
            assert (a[k] - b[k]).abs().max() <= 1e-2 * b[k].abs().max(), k
        assert (a[TOP] == b[TOP]).float().mean() >= 0.98


def test_non_finite_states_are_left_to_the_capture_that_names_them(tmp_path):
    store = StateStore(tmp_path / "states", CaptureSpec((1,), None, "bfloat16"))
    states = torch.ones(3, 1, 8)
    states[1, 0, 2] = float("inf")
    store.keep([1, 2, 3], states)
    assert store.fields([1, 2, 3]) is None and not list((tmp_path / "states").glob("*"))


def test_a_one_pass_folder_equals_the_two_pass_folder_and_its_store_is_gone(sharp_target, tmp_path):
    """`prepare` with regeneration on the hf engine: one pass (the default) and two passes
    (`data.capture.one_pass=false`) over the same answers build the same rows and, within bf16
    noise, the same states; the one-pass folder says how many tokens regeneration kept."""
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in conversations(16)))
    regen = ("data.regenerate.enabled=true", "data.regenerate.max_new_tokens=12",
             "data.regenerate.batch_size=4")
    one = prepare(tiny_prep_config(sharp_target, source, tmp_path / "one", *regen))
    # The same answers (the cache copied), captured by the forward instead.
    shutil.copytree(tmp_path / "one" / "regenerated", tmp_path / "two" / "regenerated")
    two_pass = tiny_prep_config(sharp_target, source, tmp_path / "two", *regen, "data.capture.one_pass=false")
    two = prepare(two_pass)
    assert one.manifest["one_pass_tokens"] == one.tokens and "one_pass_tokens" not in two.manifest
    assert not list((tmp_path / "one").glob("states/*/*"))  # the store is deleted with the folder built
    assert_states_close(one.path, two.path)
