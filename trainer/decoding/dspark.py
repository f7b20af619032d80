"""The DSpark drafter: DFlash's one block forward, then the slots drawn one after the other, each
with the Markov bias of the token drawn before it (the anchor for the first), as vLLM's DSpark
proposer samples them (`_sample_sequential`). The decoder verifies the chain as any other: each
draft's distribution is the one it was drawn from, so the output stays the target's own."""

from __future__ import annotations

import torch

from trainer.decoding.dflash import DFlashDrafter
from trainer.decoding.drafters import Draft, Shape, stack_probs, top_probs
from trainer.decoding.verify import Sampling


class DSparkDrafter(DFlashDrafter):
    @torch.no_grad()
    def propose(self, shape: Shape, sampling: Sampling) -> Draft:
        self.check(shape)
        base = self.block_logits()[: min(shape.k, self.drafts)]
        prev, tokens, probs, confidence = self.next_token, [], [], []
        for row in base:
            row = row + self.head.bias(torch.as_tensor(prev, device=self.device))
            top = top_probs(row)[0]
            if top < shape.p_min:
                break
            token, q = sampling.pick(row)
            tokens.append(token)
            probs.append(q)
            confidence.append(top)
            prev = token
        return Draft(torch.tensor(tokens, dtype=torch.long), None, stack_probs(probs), confidence)
