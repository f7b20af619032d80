"""One copy of the target per process (`data_prep.resident`): a vLLM engine starting drops the
transformers model (vLLM reserves 92% of the GPU and refuses to start beside it), and loading
the model again stops the engine. vLLM itself lives in the vLLM venv, not in this one: its `LLM`
is stood in for by a class that records what the process held when it was started and stopped."""

from __future__ import annotations

import sys
import types

import torch

from conf.schema import RootConfig, TargetConfig
from data_prep import vllm_engine
from data_prep.target import resolve_target


def test_the_engine_and_the_transformers_model_take_turns(tiny_llama_dir, monkeypatch):
    target = resolve_target(RootConfig(target=TargetConfig(name_or_path=str(tiny_llama_dir))))
    events: list[tuple[str, bool]] = []  # (event, whether the transformers model was loaded then)

    def shutdown() -> None:
        events.append(("engine stopped", "model" in target.__dict__))

    class LLM:
        def __init__(self, **_):
            events.append(("engine started", "model" in target.__dict__))
            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=shutdown))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(vllm_engine, "_current", {"key": None, "llm": None})
    model = target.model  # the planner's probes, or the hf capture
    assert isinstance(model.get_input_embeddings().weight, torch.Tensor)
    vllm_engine.engine(target.path, target.dtype, 64)  # data.regenerate.backend=vllm
    assert events == [("engine started", False)]  # the model was dropped before the engine started
    again = target.model  # a later stage loads it again; the engine stops first
    assert again is not model
    assert events == [("engine started", False), ("engine stopped", False)]
    assert vllm_engine._current["llm"] is None
