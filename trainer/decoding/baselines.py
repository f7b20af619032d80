"""What a head is compared against: plain greedy decoding on the same cache code, transformers'
prompt-lookup decoding (n-gram drafts copied from the prompt) through `generate`, and the target's
own greedy `generate`, the reference both decoders are held to."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import GenerationConfig

from trainer.decoding.decoder import DecodeStats, Generation, clock, extend
from trainer.decoding.kv_cache import TargetKV


@torch.no_grad()
def greedy_generate(
    target, input_ids: torch.Tensor, max_new_tokens: int, eos_ids: tuple[int, ...] | set[int] = ()
) -> Generation:
    """Plain greedy decoding: one target forward per token."""
    prompt = input_ids.reshape(-1).cpu()
    eos, stats = set(eos_ids), DecodeStats()
    kv = TargetKV(target, [], room=prompt.numel() + max_new_tokens)
    start = clock(kv.device)
    logits, _ = kv.prefill(prompt)
    out: list[int] = []
    done = extend(out, [int(logits[-1].argmax())], max_new_tokens, eos)
    stats.prefill_s = clock(kv.device) - start
    stats.target_forwards = 1
    while not done:
        logits, _ = kv.forward(torch.tensor(out[-1:]))
        kv.keep([0])
        stats.target_forwards += 1
        done = extend(out, [int(logits[-1].argmax())], max_new_tokens, eos)
    stats.total_s = clock(kv.device) - start
    stats.verify_s = stats.total_s - stats.prefill_s
    stats.new_tokens = len(out)
    return Generation(out, stats)


@contextmanager
def _bare_generation_config(model) -> Iterator[None]:
    """Within: `model.generate` starts from transformers' defaults, not from the target's own
    generation config, whose unset values it would otherwise fill in (a repetition penalty, a
    forced or suppressed token) and so change which token greedy decoding picks."""
    own = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = own


def _hf_greedy(
    target, input_ids: torch.Tensor, max_new_tokens: int, eos_ids: tuple[int, ...] | set[int], **extra
) -> tuple[list[int], float]:
    """transformers' own greedy `generate` on one prompt [T] -> (new tokens up to the first EOS
    (kept) or the budget, seconds)."""
    ids = input_ids.reshape(1, -1).to(target.device)
    eos = sorted(eos_ids) or None
    with _bare_generation_config(target):
        start = clock(ids.device)
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0,
            **extra,
        )
        seconds = clock(ids.device) - start
    tokens: list[int] = []
    extend(tokens, out[0, ids.shape[1] :].tolist(), max_new_tokens, set(eos_ids))
    return tokens, seconds


@torch.no_grad()
def reference_generate(
    target, input_ids: torch.Tensor, max_new_tokens: int, eos_ids: tuple[int, ...] | set[int] = ()
) -> list[int]:
    """What the target itself writes greedily (`generate(do_sample=False)` on transformers' own
    caches and masks): the reference the evaluator holds its greedy baseline to, since a fault in
    the static caches would make the baseline and the speculative output wrong alike."""
    return _hf_greedy(target, input_ids, max_new_tokens, eos_ids)[0]


@torch.no_grad()
def prompt_lookup_generate(
    target,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids: tuple[int, ...] | set[int] = (),
    num_tokens: int = 10,
) -> Generation:
    """Greedy `generate(prompt_lookup_num_tokens=...)`; target forwards counted with a hook."""
    stats = DecodeStats()
    calls = []
    hook = target.register_forward_hook(lambda *_: calls.append(1))
    try:
        tokens, stats.total_s = _hf_greedy(
            target, input_ids, max_new_tokens, eos_ids, prompt_lookup_num_tokens=num_tokens
        )
    finally:
        hook.remove()
    stats.new_tokens = len(tokens)
    stats.target_forwards = len(calls)
    return Generation(tokens, stats)
