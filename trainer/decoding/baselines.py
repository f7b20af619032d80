"""What a head is compared against: plain greedy decoding on the same cache code, and
transformers' prompt-lookup decoding (n-gram drafts copied from the prompt) through `generate`."""

from __future__ import annotations

import torch

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
    ids = input_ids.reshape(1, -1).to(target.device)
    eos = sorted(eos_ids) or None
    try:
        start = clock(ids.device)
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            prompt_lookup_num_tokens=num_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
        )
        stats.total_s = clock(ids.device) - start
    finally:
        hook.remove()
    tokens: list[int] = []
    extend(tokens, out[0, ids.shape[1] :].tolist(), max_new_tokens, set(eos_ids))
    stats.new_tokens = len(tokens)
    stats.target_forwards = len(calls)
    return Generation(tokens, stats)
