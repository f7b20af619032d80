"""`data.regenerate.backend=vllm`: one line naming what to install when vLLM is missing; with
vLLM importable (the venv of scripts/setup_vllm_venv.sh plus draftsmith), a real regeneration of
SmolLM2 through vLLM's offline LLM into the same cache format."""

from __future__ import annotations

import importlib.util

import pytest

from conf.errors import UserError
from data_prep.vllm_engine import check_vllm_backend

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_is_one_line_naming_the_install():
    with pytest.raises(UserError, match="backend=vllm needs vLLM .*pip install vllm"):
        check_vllm_backend("data.regenerate.backend=vllm")




@pytest.mark.parametrize("override", ["data.regenerate.backend=vllm", "data.capture.backend=vllm"])
def test_a_vllm_backend_under_torchrun_is_one_line(override, monkeypatch):
    """Every rank would start an engine on the first GPU it sees: refused before anything loads."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=f"^{override} under 2 processes: .*python -m data_prep.prepare"):
        check_vllm_backend(override)
