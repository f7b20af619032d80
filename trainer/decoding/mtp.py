"""The MTP drafter: EAGLE-3's chain (and tree) drafter over the target's own MTP layer.

The MTP layer drafts as an EAGLE-3 head does (vLLM serves both through one proposer): step 0 reads
each newly verified position's target state (the final one, after the norm) with the token after
it, later steps feed the layer's own output back with the token just drafted, and the layer's KV
cache keeps the verified positions only. What differs is the input: no fusion of aux layers, and
drafts over the whole vocabulary (`MtpHead.draft_token_ids`), so the EAGLE-3 drafter runs it once
`commit` passes the final state through unchanged.
"""

from __future__ import annotations

import torch

from trainer.decoding.drafters import Eagle3Drafter


class MtpDrafter(Eagle3Drafter):
    """`Eagle3Drafter` whose step-0 input is the target's final hidden state itself."""

    def commit(self, tokens: torch.Tensor, hidden: list[torch.Tensor], next_token: int) -> None:
        following = torch.cat([tokens[1:].to(self.device), self._ids(next_token)])
        self.pending = (hidden[0].to(self.device, self.dtype)[None], following[None])
