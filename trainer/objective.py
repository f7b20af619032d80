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

`Objective.from_logits` is the training path from a head's logits: for `ce` it is
`soft_cross_entropy`, which walks the rows in cache-sized chunks. The [N, V] tensors of the
unfused chain (float logits, log-probabilities, their product with p, and the same again in the
backward) are each a pass over main memory, and on a CPU those passes, not the multiply-adds, were
most of a step's loss time (tens of MiB per pass at a few GB/s).

Which rows: `head.prompt_loss_weight=w` trains every real position that is not an answer token
(prompt, system and template tokens) at weight w against the answers' 1 (0: answers only,
Medusa's default; 1: all alike, EAGLE-3's). Capture keeps hidden states at every position, so one
data folder serves every w; validation metrics stay on the answers. `ce+tv` is ce +
`head.tv_weight` x tv; `lk`'s eta is `head.lk_eta`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_v min(p_v, q_v) per row: the probability that the speculative sampling rule accepts
    one token drafted from q against the target's p, i.e. 1 - TV(p, q)."""
    return torch.minimum(p, q).sum(-1)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w * v) / sum(w) over rows, 0 when no row weighs anything. Rows of weight 0 are left
    out, not multiplied, so whatever they hold cannot reach the sum."""
    total = torch.where(weights > 0, values * weights, 0).sum()
    return total / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)


CHUNK_BYTES = 1 << 20  # a chunk of float32 rows that stays in a core's L2 cache


class SoftCrossEntropy(torch.autograd.Function):
    """-(p * log_softmax(logits)).sum(-1) per row, and the rows' argmax, one chunk of rows at a
    time: forward keeps only each row's logsumexp, backward recomputes the softmax chunk by chunk
    (grad = g * (sum(p) * softmax - p)), so no [N, V] float tensor beyond the gradient is written.
    Logits may be bf16 (autocast): each chunk is computed in float32, the gradient is returned in
    the logits' dtype, as autocast's cast would."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        step = max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
        ce = logits.new_empty(n, dtype=torch.float32)
        lse = torch.empty_like(ce)
        top = torch.empty(n, dtype=torch.long, device=logits.device)
        for s in range(0, n, step):
            x, pc = logits[s : s + step].float(), p[s : s + step]
            lse[s : s + step] = torch.logsumexp(x, -1)
            ce[s : s + step] = lse[s : s + step] * pc.sum(-1) - (pc * x).sum(-1)
            top[s : s + step] = x.argmax(-1)
        ctx.save_for_backward(logits, p, lse)
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _top: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, p, lse = ctx.saved_tensors
        step = max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
        out = torch.empty_like(logits)
        for s in range(0, logits.shape[0], step):
            pc = p[s : s + step]
            x = logits[s : s + step].float().sub_(lse[s : s + step, None]).exp_()
            out[s : s + step] = x.mul_(pc.sum(-1, keepdim=True)).sub_(pc).mul_(grad[s : s + step, None])
        return out, None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(-(p * log_softmax(logits)).sum(-1) [N] float32, argmax(logits) [N]) for logits [N, V]
    (float32 or bf16) and target probabilities p [N, V] float32; see `SoftCrossEntropy`."""
    return SoftCrossEntropy.apply(logits, p)


@dataclass(frozen=True)
class Objective:
    """The configured objective (`conf.kinds.ObjectiveConfig`): `loss` one of
    conf.kinds.LOSSES, its knobs, and the weight of prompt rows against answer rows."""

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

    def from_logits(
        self, logits: torch.Tensor, p: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(`soft` of log_softmax(logits) against p, per row [N]; the logits' argmax [N]): the
        training path, where the argmax comes from the same pass. `ce` runs chunked
        (`soft_cross_entropy`); the other losses need q itself and take the plain path."""
        if self.loss == "ce":
            return soft_cross_entropy(logits, p)
        return self.soft(F.log_softmax(logits.float(), dim=-1), p), logits.argmax(-1)

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
