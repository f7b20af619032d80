"""The serving engine's hidden states made transformers': its files read (ids checked, then
deleted), its last layer normed by the target's own final norm loaded alone (`TargetTail`), the
top-1 from the lm_head. The engine's output is stood in for by the tiny target's own residual
stream with the last layer taken before the norm, as vLLM's `extract_hidden_states` gives it
(tests/e2e/test_vllm_capture.py runs vLLM itself). A capture server that holds its requests
and sends nothing (as a vLLM sent SIGTERM does) stops the capture in about one `silence_s`."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import save_file

from conf.compose import compose_root
from conf.errors import UserError
from data_prep.states.capture import TOP, CaptureSpec, HfCapturer
from data_prep.states.capture_engine import (
    PREP_RESUME,
    EngineStates,
    ServerCapturer,
    engine_args,
    engine_layer_ids,
    read_states,
    tail_device,
)
from data_prep.target import resolve_target
from tests.support.openai_server import Behaviour, Server
from tests.support.runs import user_error_line


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    cfg = compose_root(["+head=eagle3", f"target.name_or_path={tiny_llama_dir}", "target.dtype=float32"])
    return resolve_target(cfg)


def engine_like(model, ids: list[int], layers: list[int]) -> torch.Tensor:
    """[T, layers, H] as vLLM writes it: layer L is the input of decoder layer L, and the last
    layer's output comes before the final norm."""
    seen = {}
    hook = model.model.norm.register_forward_pre_hook(lambda _, args: seen.setdefault("raw", args[0]))
    try:
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    last = model.config.num_hidden_layers
    return torch.stack([(seen["raw"] if k == last else hs[k])[0] for k in layers], dim=1)


def test_engine_states_become_the_hf_fields_and_the_final_norm_is_what_makes_them_so(target):
    model, n = target.model, target.config.num_hidden_layers
    spec = CaptureSpec((1, 3, 5), n, target_top=True)
    ids = torch.randint(5, 300, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = next(iter(HfCapturer(model, spec, 4096)([ids], ["s"])))
    states = EngineStates.of(target, spec)
    with torch.no_grad():
        raw = engine_like(model, ids, engine_layer_ids(spec))
    got = states.fields(raw, "s")
    assert set(got) == set(expected)
    for name in ("aux_hidden", "final_hidden"):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[TOP], expected[TOP])
    states.tail.norm = torch.nn.Identity()  # the trap: the engine's last layer taken as it comes
    assert not torch.allclose(states.fields(raw, "s")["final_hidden"], expected["final_hidden"], atol=1e-2)


def test_an_engine_file_is_read_once_checked_against_the_ids_sent_and_deleted(tmp_path):
    path = tmp_path / "req-1.safetensors"
    states = torch.randn(4, 2, 8)
    for ids in ([1, 2, 3, 4], [1, 2, 3, 9]):
        save_file({"hidden_states": states, "token_ids": torch.tensor([1, 2, 3, 4])}, str(path))
        (tmp_path / "req-1.safetensors.lock").touch()
        if ids[-1] == 4:
            assert torch.equal(read_states(str(path), ids, "server X"), states)
        else:
            with pytest.raises(UserError, match="server X: the engine's hidden states are for 4 tokens, not"):
                read_states(str(path), ids, "server X")
        assert list(tmp_path.iterdir()) == []  # the file and its lock, read or refused, are gone
    with pytest.raises(UserError, match="not readable here; data prep and the servers must share"):
        read_states(str(path), [1], "server X")
    # A lock without its file: the writer died mid-write (a killed server), a request to retry.
    (tmp_path / "req-1.safetensors.lock").touch()
    with pytest.raises(FileNotFoundError):
        read_states(str(path), [1], "server X")
    assert list(tmp_path.iterdir()) == []


def test_the_engine_keeps_each_layer_once_without_prefix_caching_or_chunked_prefill():
    spec = CaptureSpec((2, 15, 27), 30, target_top=True)
    args = engine_args(spec, "/shared", stock=False)
    assert args["speculative_config"]["draft_model_config"]["hf_config"] == {
        "eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}
    assert args["enable_prefix_caching"] is False and args["enable_chunked_prefill"] is False
    assert args["kv_transfer_config"]["kv_connector_module_path"] == "data_prep.states.vllm_connector"
    assert "kv_connector_module_path" not in engine_args(spec, "/shared", stock=True)["kv_transfer_config"]


def test_a_capture_server_silent_on_every_request_stops_the_capture_in_one_line_in_about_silence_s(target):
    """Retries could not cure it: each would wait out another silence (the blocking request once
    waited `timeout_s`, 600 s, on each of its 4 retries)."""
    mute = Behaviour(model_id=target.path, silent_after=0)
    with Server(target.model, target.tokenizer, mute) as s:
        cfg = compose_root(["+head=eagle3", f"target.name_or_path={target.path}", "target.dtype=float32",
                            "data.capture.backend=server", f"data.capture.endpoints=[{s.url}]",
                            "data.regenerate.silence_s=1", "data.regenerate.retries=4"])
        capturer = ServerCapturer(cfg, target, CaptureSpec((1, 3, 5), 6, target_top=True))
        start = time.monotonic()
        line = user_error_line(lambda: list(capturer([[5, 6, 7]] * 4, list("abcd"))))
        took = time.monotonic() - start
    assert took < 2.5, took
    assert mute.held >= 2  # the endpoint's threads all waited: no request was answered
    assert line == (f"error: data.capture.endpoints: no server answers ({s.url}: silent for 1 s "
                    f"(data.regenerate.silence_s)); {PREP_RESUME}"), line


def test_the_tail_runs_on_this_ranks_gpu_where_there_is_one(monkeypatch):
    """The final norm and the full-vocabulary lm_head (the top-1) run on `cuda:LOCAL_RANK` in
    data prep, not on the host's cores; a machine without a GPU keeps them on the CPU (where the
    engine tests above hold the fields to the hf path's)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tail_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert tail_device() == torch.device("cuda", 1)
