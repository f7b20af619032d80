"""Training rows beyond the answers (`head.prompt_loss_weight`) and the per-row losses
(`head.loss`) through both trainees on a tiny real target: prompt rows weigh w against the
answers' 1, padding never trains, and the metrics stay on the answers."""

from __future__ import annotations

import pytest
import torch

from conf.kinds import Eagle3Config, MedusaConfig
from data_prep.states.capture import TOP, greedy_ids
from heads.eagle3.model import Eagle3Head
from heads.medusa.model import MedusaHead
from tests.support.syncs import assert_steps_never_sync
from trainer.batching import collate, collate_packed
from trainer.kinds.eagle3 import Eagle3Trainee
from trainer.kinds.medusa import MedusaTrainee
from trainer.objective import CROSS_ENTROPY, Objective

PROMPT = 5
LENGTHS = (12, 9)  # the second row is padded


def samples(model, aux_layer_ids: list[int]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, 3000, (n,), generator=g)
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        mask = torch.arange(n) >= PROMPT
        aux = torch.cat([hs[i][0] for i in aux_layer_ids], -1)
        final = hs[-1][0]
        top = greedy_ids(model.get_output_embeddings(), final)
        out.append({"input_ids": ids, "loss_mask": mask, "aux_hidden": aux, "final_hidden": final, TOP: top})
    return out


def relabelled(items: list[dict[str, torch.Tensor]], which: str) -> list[dict[str, torch.Tensor]]:
    """The same samples with the loss mask on the prompt only, or on every position."""
    masks = {"prompt": lambda m: ~m, "all": lambda m: torch.ones_like(m)}
    return [{**s, "loss_mask": masks[which](s["loss_mask"])} for s in items]


@pytest.fixture(scope="module")
def eagle3(tiny_model):
    """A head over the whole vocabulary: every target choice is inside it, so every labelled row
    counts and a step's row count is its `total`."""
    vocab = tiny_model.config.vocab_size
    torch.manual_seed(0)
    cfg = Eagle3Config(aux_layer_ids=[2, 4, 5])
    head = Eagle3Head.from_target(
        tiny_model, "tiny", cfg, torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    )
    lm_head = tiny_model.get_output_embeddings().weight

    def trainee(ttt_length: int, objective: Objective = CROSS_ENTROPY) -> Eagle3Trainee:
        return Eagle3Trainee(head, lm_head, ttt_length, 0.8, objective)

    return trainee, samples(tiny_model, cfg.aux_layer_ids)


def run(trainee, items):
    return trainee(collate(items, trainee.batch_index))


@pytest.mark.parametrize("w", [0.25, 1.0])
def test_eagle3_prompt_rows_weigh_w_against_the_answers(eagle3, w):
    make, items = eagle3
    plain = make(1)
    answers, prompts = run(plain, items), run(plain, relabelled(items, "prompt"))
    out = run(make(1, Objective(prompt_weight=w)), items)
    n_a, n_p = answers["total"][0], prompts["total"][0]
    expected = (n_a * answers["loss"] + w * n_p * prompts["loss"]) / (n_a + w * n_p)
    torch.testing.assert_close(out["loss"], expected)
    # The metrics read the answers only, whatever trains.
    assert out["total"].tolist() == answers["total"].tolist()
    assert out["correct"].tolist() == answers["correct"].tolist()


def test_eagle3_weight_one_trains_every_real_position_alike(eagle3):
    """Through the whole unroll: w = 1 is the loss of a mask on every position, padding
    excluded (the padded row's tail is not a position)."""
    make, items = eagle3
    out = run(make(3, Objective(prompt_weight=1.0)), items)
    every = run(make(3), relabelled(items, "all"))
    torch.testing.assert_close(out["loss"], every["loss"])
    assert every["total"][0] == sum(n - 2 for n in LENGTHS)


def test_prompt_rows_of_packed_samples_stay_in_their_own_sample(eagle3, medusa):
    """Two samples back to back in one row: the first tokens of the second are labels predicted
    from nothing before them in their sample, exactly as when each has a row of its own."""
    make, items = eagle3
    head, medusa_items = medusa
    trainees = [(make(3, Objective(prompt_weight=0.5)), items)]
    trainees.append((MedusaTrainee(head, 0.8, Objective(prompt_weight=0.5)), medusa_items))
    for trainee, samples in trainees:
        with torch.no_grad():
            padded = trainee(collate(samples, trainee.batch_index))
            packed = trainee(collate_packed([samples], trainee.batch_index))
        for k in padded:
            torch.testing.assert_close(packed[k], padded[k], atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.parametrize("loss", ["tv", "ce+tv", "lk"])
def test_eagle3_losses_train(eagle3, loss):
    make, items = eagle3
    trainee = make(2, Objective(loss=loss, prompt_weight=0.5))
    out = run(trainee, items)
    assert torch.isfinite(out["loss"]) and out["loss"] > 0
    if loss == "tv":  # per step a mean of 1 - acceptance, in [0, 1]
        assert out["loss"] <= 1 + 0.8
    grads = torch.autograd.grad(out["loss"], [trainee.head.fc.weight])
    assert grads[0].abs().sum() > 0


@pytest.fixture(scope="module")
def medusa(tiny_model):
    torch.manual_seed(0)
    head = MedusaHead.from_target(tiny_model, "tiny", MedusaConfig(num_heads=2))
    for p in head.blocks.parameters():
        p.data.normal_(0, 0.1)
    fields = ("input_ids", "loss_mask", "final_hidden")
    items = [{k: s[k] for k in fields} for s in samples(tiny_model, [1, 2, 3])]
    return head, items


def test_medusa_prompt_rows_and_answer_metrics(medusa):
    head, items = medusa
    with torch.no_grad():  # validation: hits are counted
        out = run(MedusaTrainee(head, 0.8, Objective(prompt_weight=1.0)), items)
        every = run(MedusaTrainee(head, 0.8), relabelled(items, "all"))
        answers = run(MedusaTrainee(head, 0.8), items)
    torch.testing.assert_close(out["loss"], every["loss"])
    for name in ("head_ce", "head_top1", "head_top5", "head_total"):
        torch.testing.assert_close(out[name], answers[name])


def test_medusa_tv_is_one_minus_the_label_probability(medusa):
    """Against the data's token, TV is 1 - q(token): the acceptance of a drafted token by a
    target that would choose that token."""
    head, items = medusa
    out = run(MedusaTrainee(head, 0.5, Objective(loss="tv")), items[:1])
    ids, hidden = items[0]["input_ids"], items[0]["final_hidden"]
    with torch.no_grad():
        q = torch.softmax(head(hidden[None])[:, 0].float(), -1)  # [heads, T, V]
    expected = 0.0
    for k in range(2):
        positions = [t for t in range(len(ids) - 2 - k) if t + 2 + k >= PROMPT]
        targets = ids[[t + 2 + k for t in positions]]
        expected += 0.5**k * (1 - q[k, positions, targets]).mean()
    torch.testing.assert_close(out["loss"], expected)


@pytest.mark.parametrize("loss", ["ce", "lk"])
def test_prompt_rows_and_losses_never_sync(eagle3, medusa, loss, tmp_path):
    """The loop's training step with prompt rows and a non-default loss reads nothing back."""
    objective = Objective(loss=loss, prompt_weight=0.5)
    make, items = eagle3
    assert_steps_never_sync(make(3, objective), items * 2, tmp_path)
    head, medusa_items = medusa
    assert_steps_never_sync(MedusaTrainee(head, 0.8, objective), medusa_items * 2, tmp_path)
