"""`data.regenerate.backend=vllm`: one line naming what to install when vLLM is missing; with
vLLM importable (the venv of scripts/setup_vllm_venv.sh plus draftsmith), a real regeneration of
SmolLM2 through vLLM's offline LLM into the same cache format."""

from __future__ import annotations

import importlib.util

import pytest

from conf.errors import UserError
from data_prep.vllm_engine import check_vllm_installed

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_is_one_line_naming_the_install():
    with pytest.raises(UserError, match="backend=vllm needs vLLM .*pip install vllm"):
        check_vllm_installed("data.regenerate.backend=vllm")


