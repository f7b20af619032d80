"""Regeneration through vLLM's offline `LLM` (`data.regenerate.backend=vllm`).

For targets where vLLM's kernels beat our engine (large models on GPUs), the same prompts, chat
template, sampling settings and cache file go through vLLM instead. Its numerics differ from
transformers' (other kernels), so greedy answers may differ in a few tokens from the `hf` path:
the regeneration cache is keyed by the backend.
"""

from __future__ import annotations

import torch

from data_prep.vllm_engine import check_vllm_backend, engine


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
    check_vllm_backend("data.regenerate.backend=vllm")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    llm = engine(target_path, dtype, max(2048, longest))
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
