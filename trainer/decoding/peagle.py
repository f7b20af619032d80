"""The P-EAGLE drafter: K tokens from one head forward per draft, as vLLM's parallel drafting.

One forward runs the pending verified positions (EAGLE-3's catch-up: the last pairs the last
verified token's feature with the bonus token, slot 1) and k-1 mask slots after them; slot j's
logits draft the j-th token. The mask slots' K/V are written after the committed ones and dropped
as the EAGLE-3 drafter drops its drafted entries, so the cache holds verified positions only.
A chain of k > K runs k-1 mask slots, as vLLM does when asked for more tokens than trained.
"""

from __future__ import annotations

import torch

from trainer.decoding.drafters import Chain, Draft, Eagle3Drafter, Shape, one_forward_chain
from trainer.decoding.kv_cache import causal
from trainer.decoding.verify import Sampling


class PEagleDrafter(Eagle3Drafter):
    """`Eagle3Drafter` whose chain comes from one forward with mask slots (chains only)."""

    @torch.no_grad()
    def propose(self, shape: Shape, sampling: Sampling) -> Draft:
        assert isinstance(shape, Chain), "peagle_drafter refuses trees before decoding"
        feats, ids = self.pending
        t = ids.shape[1]
        pos = torch.arange(self.length, self.length + t, device=self.device)[None]
        hidden, ids, pos = self.head.with_mask_slots(feats, ids, pos, shape.k - 1)
        n = ids.shape[1]
        # The prompt's forward runs eagerly: its length is the request's own.
        _, logits = self._step(hidden, ids, pos, causal(n, self.device), graphed=self.length > 0)
        self.length += t
        return one_forward_chain(logits[0, t - 1 : t - 1 + shape.k], shape.p_min,
                                 lambda row: self._pick(row, sampling))
