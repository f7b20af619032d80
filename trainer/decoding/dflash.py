"""The DFlash drafter: one head forward drafts the whole block, a chain of block_size - 1 tokens.

As vLLM's proposer (`v1/spec_decode/dflash.py`): the context K/V of every verified position are
computed once, when the target has verified it, from its aux-layer features, and kept in a static
cache (`kv_cache.StaticCache`, one buffer per draft layer); each step then runs only the block,
[next_token, mask, ..., mask] at the positions after the committed ones, whose own K/V go to the
slots after them and are overwritten by the next commit. The decoder verifies the chain as any
other, so the output stays the target's own.
"""

from __future__ import annotations

import torch

from conf.errors import UserError
from heads.window import window_of
from trainer.decoding.drafters import Chain, Draft, Shape, one_forward_chain
from trainer.decoding.kv_cache import StaticCache, capacity_for
from trainer.decoding.verify import Sampling


class DFlashDrafter:
    """Drafts up to block_size - 1 tokens per step; a chain of k asks for the block's first
    min(k, K) (the block is always the trained one: its slots see each other). One request at a
    time: the cache outlives a request."""

    def __init__(self, head):
        self.head = head
        self.hidden_layers = list(head.aux_layer_ids)
        self.drafts = head.block_size - 1
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        self.cache = StaticCache()
        self.length = 0
        self.next_token = 0
        self.window = window_of(head.config)  # draft attention over the last `window` positions

    def check(self, shape: Shape) -> None:
        """Refuse a tree: a block is one chain."""
        if not isinstance(shape, Chain):
            raise UserError("eval.mode=tree: a DFlash head drafts one chain per step; use eval.mode=chain")

    def start(self, prompt: torch.Tensor, hidden: list[torch.Tensor], next_token: int) -> None:
        self.length = 0
        self.commit(prompt, hidden, next_token)

    def _reserve(self, n: int) -> None:
        self.cache.reserve(capacity_for(n, False), keep=self.length)

    @torch.no_grad()
    def commit(self, tokens: torch.Tensor, hidden: list[torch.Tensor], next_token: int) -> None:
        """Write the context K/V of the verified `tokens` (their target features `hidden`, one
        [T, H] per aux layer) at their positions; `next_token` anchors the next block."""
        t = tokens.numel()
        self._reserve(self.length + t + self.head.block_size)
        feats = torch.cat(hidden, dim=-1).to(self.device, self.dtype)[None]
        positions = torch.arange(self.length, self.length + t, device=self.device)[None]
        self.cache.slots = positions[0]
        for i, (k, v) in enumerate(self.head.context_kv(self.head.context(feats), positions)):
            self.cache.update(k, v, i)
        self.length += t
        self.next_token = next_token

    @torch.no_grad()
    def block_logits(self) -> torch.Tensor:
        """Logits [K, V] of the block's drafted slots, after the committed positions."""
        b = self.head.block_size
        ids = self.head.block_ids(torch.tensor([self.next_token], device=self.device))
        positions = torch.arange(self.length, self.length + b, device=self.device)[None]
        mask = self.cache.mask(self.head.block_mask(1, self.device), self.length, self.dtype, self.window,
                               positions)
        self.cache.slots = positions[0]
        hidden = self.head.block(ids, positions, mask, [self.cache] * len(self.head.layers))
        return self.head.logits(hidden[0, 1:])

    @torch.no_grad()
    def propose(self, shape: Shape, sampling: Sampling) -> Draft:
        self.check(shape)
        return one_forward_chain(self.block_logits()[: min(shape.k, self.drafts)], shape.p_min, sampling.pick)
