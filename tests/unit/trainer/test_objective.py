"""The shared objective's maths: TV is the rejection rate of the decoder's own speculative
sampling rule, its gradient points where acceptance grows, hard labels are point masses, and the
default is the plain cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.decoding.verify import rejection_sample_chain
from trainer.objective import CROSS_ENTROPY, Objective, overlap, weighted_mean

KINDS = ["ce", "tv", "ce+tv", "lk"]


def dists(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(rows, vocab, generator=g), -1)
    logits = 2 * torch.randn(rows, vocab, generator=g)
    return p, logits


def test_tv_is_zero_exactly_when_the_distributions_agree():
    p, logits = dists(4, 7, 0)
    tv = Objective(loss="tv")
    assert torch.allclose(tv.soft(p.log(), p), torch.zeros(4), atol=1e-6)
    assert (tv.soft(F.log_softmax(logits, -1), p) > 1e-3).all()
    assert torch.allclose(overlap(p, p), torch.ones(4))


def test_one_minus_tv_is_the_acceptance_of_the_speculative_sampling_rule():
    """One token drafted from q, verified by the decoder's `rejection_sample_chain` against p:
    accepted with probability sum min(p, q)."""
    p, logits = dists(1, 5, 1)
    q = torch.softmax(logits, -1)
    g = torch.Generator().manual_seed(0)
    draws = 4000
    drafted = torch.multinomial(q[0], draws, replacement=True, generator=g)
    both = torch.cat([p, p])  # the row after the draft (the bonus token) is not looked at here
    accepted = sum(rejection_sample_chain(x[None], both, q, g)[0] for x in drafted)
    expected = float(1 - Objective(loss="tv").soft(q.log(), p))
    assert expected == pytest.approx(float(overlap(p, q)))
    assert accepted / draws == pytest.approx(expected, abs=4 * (0.25 / draws) ** 0.5)


def test_tv_gradient_raises_the_under_drafted_tokens():
    """d TV / d logit < 0 where q < p (more of it is accepted), > 0 where q > p."""
    p, logits = dists(3, 9, 2)
    logits.requires_grad_(True)
    Objective(loss="tv").soft(F.log_softmax(logits, -1), p).sum().backward()
    q = torch.softmax(logits.detach(), -1)
    under = q < p
    assert (logits.grad[under] < 0).all() and (logits.grad[~under] > 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_hard_labels_are_point_masses(kind):
    _, logits = dists(6, 11, 3)
    labels = torch.tensor([0, 3, 10, 5, 5, 2])
    logq = F.log_softmax(logits, -1)
    objective = Objective(loss=kind, tv_weight=0.3, lk_eta=2.0)
    point = F.one_hot(labels, 11).float()
    torch.testing.assert_close(objective.hard(logq, labels), objective.soft(logq, point))


def test_the_default_is_the_soft_cross_entropy():
    p, logits = dists(5, 8, 4)
    logq = F.log_softmax(logits, -1)
    assert torch.equal(CROSS_ENTROPY.soft(logq, p), -(p * logq).sum(-1))
    labels = torch.tensor([1, 2, 3, 4, 5])
    torch.testing.assert_close(
        CROSS_ENTROPY.hard(logq, labels), F.cross_entropy(logits, labels, reduction="none")
    )


def test_mixtures_follow_their_formulas():
    p, logits = dists(4, 6, 5)
    logq = F.log_softmax(logits, -1)
    ce = -(p * logq).sum(-1)
    tv = 1 - overlap(p, logq.exp())
    kl = F.kl_div(logq, p, reduction="none").sum(-1)
    torch.testing.assert_close(Objective(loss="ce+tv", tv_weight=0.5).soft(logq, p), ce + 0.5 * tv)
    lam = torch.exp(-3.0 * (1 - tv))
    torch.testing.assert_close(Objective(loss="lk").soft(logq, p), lam * kl + (1 - lam) * tv)


def test_lk_leans_on_kl_while_the_overlap_is_small():
    """lam = exp(-eta * overlap) is a weight, not a path for gradients: the gradient is
    lam * grad KL + (1 - lam) * grad TV."""
    p, logits = dists(2, 5, 6)
    logits.requires_grad_(True)
    logq = F.log_softmax(logits, -1)
    Objective(loss="lk", lk_eta=2.0).soft(logq, p).sum().backward()
    got = logits.grad.clone()
    lam = torch.exp(-2.0 * overlap(p, logq.exp())).detach()[:, None]
    kl_grad = torch.softmax(logits.detach(), -1) - p  # d KL(p || q) / d logits
    logits.grad = None
    Objective(loss="tv").soft(F.log_softmax(logits, -1), p).sum().backward()
    torch.testing.assert_close(got, lam * kl_grad + (1 - lam) * logits.grad)


def test_row_weights_and_their_mean():
    objective = Objective(prompt_weight=0.25)
    answer = torch.tensor([True, False, True, False])
    weights = objective.row_weights(answer)
    assert weights.tolist() == [1.0, 0.25, 1.0, 0.25]
    values = torch.tensor([1.0, 2.0, 3.0, float("inf")])
    weights[3] = 0  # a row no loss reads: whatever it holds stays out
    assert float(weighted_mean(values, weights)) == pytest.approx((1 + 0.5 + 3) / 2.25)
    assert float(weighted_mean(values, torch.zeros(4))) == 0.0


@pytest.mark.parametrize("loss", ["tv", "lk"])
def test_from_logits_of_the_other_losses_is_soft_of_log_softmax(loss):
    p, logits = dists(5, 7, 7)
    objective = Objective(loss=loss)
    row_loss, top = objective.from_logits(logits, p)
    assert torch.equal(row_loss, objective.soft(F.log_softmax(logits, -1), p))
    assert torch.equal(top, logits.argmax(-1))
