"""The vLLM regeneration backend on the real SmolLM2 target (where vLLM is installed)."""

from __future__ import annotations

import importlib.util

import pytest

from conf.schema import RegenerateConfig
from data_prep.regenerate import read_cache, regenerate
from data_prep.sources import Sample
from data_prep.stats import PrepStats

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not importable (scripts/setup_vllm_venv.sh)")
def test_vllm_backend_regenerates_smollm2(tmp_path):
    from data_prep.target import load_target, resolve_target_path

    name = "smollm2-135m-instruct"
    model, tok = load_target(name, dtype="float32", device="cpu")
    samples = [Sample(str(i), [{"role": "user", "content": q}]) for i, q in enumerate(
        ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly."]
    )]
    cfg = RegenerateConfig(max_new_tokens=24, backend="vllm")
    cache = tmp_path / "vllm.jsonl"
    out = regenerate(samples, model, tok, cfg, 512, cache, PrepStats(), target_path=resolve_target_path(name))
    assert [s.uid for s in out] == ["0", "1", "2"]
    assert all(s.messages[-1]["role"] == "assistant" and s.messages[-1]["content"] for s in out)
    assert set(read_cache(cache)) == {"0", "1", "2"}
