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
`soft_cross_entropy`, which walks the rows in blocks sized for the device (`rows_per_block`). The
[N, V] tensors of the unfused chain (float logits, log-probabilities, their product with p, and
the same again in the backward) are each a pass over main memory, and on a CPU those passes, not
the multiply-adds, were most of a step's loss time (tens of MiB per pass at a few GB/s): a CPU
walks L2-sized chunks. On a GPU the host's kernel launches decide the time instead: it takes
blocks of hundreds of MiB, each one compiled pass forward and one backward.

Which rows: `head.prompt_loss_weight=w` trains every real position that is not an answer token
(prompt, system and template tokens) at weight w against the answers' 1 (0: answers only,
Medusa's default; 1: all alike, EAGLE-3's). Capture keeps hidden states at every position, so one
data folder serves every w; validation metrics stay on the answers. `ce+tv` is ce +
`head.tv_weight` x tv; `lk`'s eta is `head.lk_eta`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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


CHUNK_BYTES = 1 << 20  # a CPU's block: float32 rows that stay in a core's L2 cache
GPU_BLOCK_BYTES = 1 << 28  # a GPU's block: 256 MiB of float32 logits


def rows_per_block(device_type: str, vocab: int, budget: int | None = None) -> int:
    """Rows of [N, vocab] logits `soft_cross_entropy` takes at a time on a `device_type` device:
    `budget` bytes of float32 rows (default: `CHUNK_BYTES` on a CPU, `GPU_BLOCK_BYTES` elsewhere),
    at least one row.

    A CPU's time is its passes over main memory, so a block that stays in L2 cache was fastest
    there (measured). A GPU's time at small blocks is the host launching kernels: at 8 rows a
    chunk (32k draft vocabulary) a TTT step launched ~35k of them against tens of milliseconds
    of GPU work, so a GPU takes every row that fits a budget its memory shrugs off (12k rows at
    32k vocabulary are 6 blocks)."""
    if budget is None:
        budget = CHUNK_BYTES if device_type == "cpu" else GPU_BLOCK_BYTES
    return max(1, budget // (4 * vocab))


def _forward_block(x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logsumexp, cross-entropy, argmax) [n] of one block of logits x [n, V] against p [n, V]."""
    x = x.float()
    lse = torch.logsumexp(x, -1)
    return lse, lse * p.sum(-1) - (p * x).sum(-1), x.argmax(-1)


def _backward_block(x: torch.Tensor, p: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The logits' gradient of one block, g * (sum(p) * softmax - p), in x's dtype. x is copied
    before the in-place steps: float32 logits' `.float()` is the saved tensor itself."""
    q = x.to(torch.float32, copy=True).sub_(lse[:, None]).exp_()
    return q.mul_(p.sum(-1, keepdim=True)).sub_(p).mul_(grad[:, None]).to(x.dtype)


@functools.cache
def _compiled_bodies() -> tuple[Callable, Callable]:
    """`_forward_block` and `_backward_block` compiled (one fused pass each over a block, as
    SpecForge's reference loss is one compiled expression); dynamic, since the row count varies
    from batch to batch."""
    return torch.compile(_forward_block, dynamic=True), torch.compile(_backward_block, dynamic=True)


@functools.cache
def compile_works(device_type: str) -> bool:
    """Whether `torch.compile` can build kernels for `device_type` here (CUDA needs Triton); says
    so in one line, once, when it cannot, and the loss then runs its blocks eagerly."""
    import torch._dynamo
    from torch.utils._triton import has_triton

    works = torch._dynamo.is_dynamo_supported() and (device_type != "cuda" or has_triton())
    if not works:
        print(f"draftsmith: torch.compile is unavailable on {device_type}; the loss runs eagerly")
    return works


def _bodies(compiled: bool) -> tuple[Callable, Callable]:
    return _compiled_bodies() if compiled else (_forward_block, _backward_block)


class SoftCrossEntropy(torch.autograd.Function):
    """-(p * log_softmax(logits)).sum(-1) per row, and the rows' argmax, one block of `rows` rows
    at a time: forward keeps only each row's logsumexp, backward recomputes the softmax block by
    block (grad = g * (sum(p) * softmax - p)), so no [N, V] float tensor beyond the gradient is
    written. `compiled`: each block's body runs compiled (`_compiled_bodies`). Logits may be bf16
    (autocast): each block is computed in float32, the gradient is returned in the logits' dtype,
    as autocast's cast would."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, p: torch.Tensor, rows: int, compiled: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        ce = logits.new_empty(n, dtype=torch.float32)
        lse = torch.empty_like(ce)
        top = torch.empty(n, dtype=torch.long, device=logits.device)
        body = _bodies(compiled)[0]
        for s in range(0, n, rows):
            part = slice(s, s + rows)
            lse[part], ce[part], top[part] = body(logits[part], p[part])
        ctx.save_for_backward(logits, p, lse)
        ctx.rows, ctx.compiled = rows, compiled
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _top: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, p, lse = ctx.saved_tensors
        rows, body = ctx.rows, _bodies(ctx.compiled)[1]
        out = torch.empty_like(logits)
        for s in range(0, logits.shape[0], rows):
            part = slice(s, s + rows)
            out[part] = body(logits[part], p[part], lse[part], grad[part])
        return out, None, None, None


def soft_cross_entropy(
    logits: torch.Tensor, p: torch.Tensor, *, rows: int | None = None, compiled: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(-(p * log_softmax(logits)).sum(-1) [N] float32, argmax(logits) [N]) for logits [N, V]
    (float32 or bf16) and target probabilities p [N, V] float32; see `SoftCrossEntropy`.

    `rows` per block (default `rows_per_block` for the logits' device) and `compiled` (default:
    on CUDA where `compile_works`) choose the path; every choice computes the same numbers
    (tests/unit/trainer/test_loss_blocks.py). The CPU's path on any device is
    `rows=rows_per_block("cpu", V), compiled=False`."""
    device = logits.device.type
    if rows is None:
        rows = rows_per_block(device, logits.shape[-1])
    if compiled is None:
        compiled = device == "cuda" and compile_works(device)
    return SoftCrossEntropy.apply(logits, p, rows, compiled)


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
        training path, where the argmax comes from the same pass. `ce` runs in blocks
        (`soft_cross_entropy`); the other losses need q itself and take the plain path."""
        if self.loss == "ce":
            return soft_cross_entropy(logits, p)
        return self.soft(F.log_softmax(logits.float(), dim=-1), p), logits.argmax(-1)

    def step_term(self, logits: torch.Tensor, teacher_p: torch.Tensor, teacher_top: torch.Tensor,
                  counted: torch.Tensor, weight: torch.Tensor,
                  answer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(one draft step's loss, its top-1 hits) over N rows: `from_logits` against the
        teacher, averaged with `weight` over the `counted` rows, and the counted answer rows whose
        argmax is the teacher's. Every kind that unrolls draft steps (EAGLE-3, MTP) sums these,
        each with its own step weight."""
        row_loss, top = self.from_logits(logits, teacher_p)
        loss = weighted_mean(row_loss, torch.where(counted, weight, 0))
        with torch.no_grad():
            hits = (counted & answer & (top == teacher_top)).sum()
        return loss, hits

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
