"""The training objective both head kinds share: which rows train, how much each weighs, and the
per-row loss of the head's distribution q against the target's p.

Speculative sampling accepts a token drafted from q with probability sum_v min(p_v, q_v) =
1 - TV(p, q) (greedy verification is the point-mass case: q's probability of the target's
choice). Cross-entropy reaches that optimum only indirectly (Pinsker bounds TV by sqrt(KL/2)),
so `tv` trains the acceptance itself. TV's gradient vanishes where q and p barely overlap, as in
a fresh head, so `lk` blends per row lam * KL + (1 - lam) * TV with lam = exp(-eta * sg[overlap])
(Samarin et al., "LK Losses", the hybrid vLLM's speculators ships with eta = 3; SpecForge ships a
batch-level variant): KL's pull while the overlap is small, TV once it has grown.

Everything here is pure tensor maths on rows [N, V], so that EAGLE-3 (soft targets over its draft
vocabulary) and Medusa (the data's token) train the very same objective.

Which rows: `head.prompt_loss_weight=w` trains every real position that is not an answer token
(prompt, system and template tokens) at weight w against the answers' 1 (0: answers only,
Medusa's default; 1: all alike, EAGLE-3's). Capture keeps hidden states at every position, so one
data folder serves every w; validation metrics stay on the answers. `ce+tv` is ce +
`head.tv_weight` x tv; `lk`'s eta is `head.lk_eta`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_v min(p_v, q_v) per row: the probability that the speculative sampling rule accepts
    one token drafted from q against the target's p, i.e. 1 - TV(p, q)."""
    return torch.minimum(p, q).sum(-1)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w * v) / sum(w) over rows, 0 when no row weighs anything. Rows of weight 0 are left
    out, not multiplied, so whatever they hold cannot reach the sum."""
    total = torch.where(weights > 0, values * weights, 0).sum()
    return total / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)


@dataclass(frozen=True)
class Objective:
    """The configured objective (`conf.schema.ObjectiveConfig`): `loss` one of
    conf.schema.LOSSES, its knobs, and the weight of prompt rows against answer rows."""

    loss: str = "ce"
    tv_weight: float = 1.0
    lk_eta: float = 3.0
    prompt_weight: float = 0.0

    @classmethod
    def from_config(cls, head) -> Objective:
        return cls(head.loss, head.tv_weight, head.lk_eta, head.prompt_loss_weight)

    def row_weights(self, answer: torch.Tensor) -> torch.Tensor:
        """Float [N]: 1 for answer rows, `prompt_weight` for the others."""
        return torch.where(answer, 1.0, self.prompt_weight)

    def soft(self, logq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Per-row loss [N] of log-probabilities logq [N, V] against target probabilities p."""
        ce = -(p * logq).sum(-1)
        if self.loss == "ce":
            return ce
        kl = ce - torch.special.entr(p).sum(-1)
        return self._combine(ce, overlap(p, logq.exp()), kl)

    def hard(self, logq: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`soft` against point masses on labels [N], without building them: the overlap is
        q(label) and KL equals the cross-entropy."""
        ce = -logq.gather(-1, labels[:, None]).squeeze(-1)
        if self.loss == "ce":
            return ce
        return self._combine(ce, torch.exp(-ce), ce)

    def _combine(self, ce: torch.Tensor, accept: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
        tv = 1 - accept
        if self.loss == "tv":
            return tv
        if self.loss == "ce+tv":
            return ce + self.tv_weight * tv
        lam = torch.exp(-self.lk_eta * accept.detach())
        return lam * kl + (1 - lam) * tv


CROSS_ENTROPY = Objective()
