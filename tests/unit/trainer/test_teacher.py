"""The EAGLE-3 teacher at the draft vocabulary against the full-vocabulary teacher it replaced.

Training used to multiply every labelled row's final hidden state by the target's whole lm_head in
float32, for the target's argmax and the softmax over the draft columns. Now capture keeps the
target's top-1 (`data_prep.states.capture.TOP`) and training multiplies by the draft rows alone
(`trainer.kinds.eagle3.draft_teacher`). The old computation is written out here as the
reference; on offline and online batches of a tiny real target, loss and metrics are the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import data_prep.prepare as P
from conf.kinds import Eagle3Config
from data_prep.folders.store import CapturedDataset, load_manifest, online_capture
from data_prep.folders.vocab import load_draft_vocab
from data_prep.states.capture import TOP, greedy_ids
from heads.eagle3.model import Eagle3Head
from tests.support.runs import tiny_prep_config
from trainer.batching import batch_loader
from trainer.kinds.eagle3 import Eagle3Trainee, draft_teacher
from trainer.loop import device_batch
from trainer.objective import CROSS_ENTROPY, Objective

pytestmark = pytest.mark.usefixtures("single_thread")


def full_vocab_teacher(
    final: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, target_to_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, as the trainee computed it before: every row times the whole lm_head in
    float32, the argmax over all of it as a draft id, the softmax over the draft columns."""
    logits = final.float() @ lm_head.float().T
    return F.softmax(logits[:, draft_ids], dim=-1), target_to_draft[logits.argmax(-1)]


class FullVocabTrainee(Eagle3Trainee):
    """The trainee with the reference teacher: it ignores the batch's top-1 and takes the argmax
    of the full-vocabulary logits itself."""

    def __init__(self, head: Eagle3Head, lm_head: torch.Tensor, objective: Objective):
        super().__init__(head, lm_head, ttt_length=3, step_weight=0.8, objective=objective)
        self.full_lm_head = lm_head.detach().float()

    def teacher(self, final_hidden: torch.Tensor, target_top: torch.Tensor):
        draft_ids = self.head.draft_token_ids()
        return full_vocab_teacher(final_hidden, self.full_lm_head, draft_ids, self.target_to_draft)


@pytest.fixture(scope="module")
def folders(tiny_model, tiny_llama_dir, chat_file, tmp_path_factory):
    """The target and one EAGLE-3 data folder per mode, from the same conversations."""
    model = tiny_model
    cache = tmp_path_factory.mktemp("teacher")
    built = {
        mode: P.prepare(tiny_prep_config(tiny_llama_dir, chat_file, cache, f"data.hidden_states={mode}")).path
        for mode in ("offline", "online")
    }
    return model, built


@pytest.mark.parametrize("objective", [CROSS_ENTROPY, Objective("lk", prompt_weight=1.0)], ids=["ce", "lk"])
@pytest.mark.parametrize("mode", ["offline", "online"])
def test_draft_vocabulary_teacher_keeps_loss_and_metrics(folders, mode, objective):
    model, built = folders
    folder = built[mode]
    manifest = load_manifest(folder)
    assert manifest["target_top"]
    lm_head = model.get_output_embeddings().weight
    torch.manual_seed(0)
    cfg = Eagle3Config(aux_layer_ids=manifest["aux_layer_ids"])
    head = Eagle3Head.from_target(model, "tiny", cfg, *load_draft_vocab(folder))
    new = Eagle3Trainee(head, lm_head, ttt_length=3, step_weight=0.8, objective=objective)
    old = FullVocabTrainee(head, lm_head, objective)
    assert new.teacher_weight.shape == (300, lm_head.shape[1])  # the draft rows only
    ds, capture = CapturedDataset(folder, "train"), online_capture(manifest, model)
    inside = outside = 0
    for batch in batch_loader(ds, [list(range(0, 6)), list(range(6, 14))], 0, False, new.batch_index):
        batch = device_batch(batch, "cpu", capture)
        got, want = new(batch), old(batch)
        torch.testing.assert_close(got["loss"], want["loss"])
        assert torch.equal(got["correct"], want["correct"]) and torch.equal(got["total"], want["total"])
        grads = [torch.autograd.grad(out["loss"], head.fc.weight)[0] for out in (got, want)]
        torch.testing.assert_close(*grads)
        # The teachers at every real row (a fresh head's hits are too rare to test the argmax).
        real = batch["attention_mask"].bool()
        final, top = batch["final_hidden"][real], batch[TOP][real]
        (got_p, got_top), (want_p, want_top) = new.teacher(final, top), old.teacher(final, top)
        torch.testing.assert_close(got_p, want_p)
        assert torch.equal(got_top, want_top)
        inside, outside = inside + int((got_top >= 0).sum()), outside + int((got_top < 0).sum())
    assert inside > 0 and outside > 0  # both sides of the draft vocabulary's edge were there


def test_stored_top_is_the_targets_argmax(folders):
    """Offline shards and the online capture keep the argmax of the full float32 logits of the
    final hidden state as stored, at every real position."""
    model, built = folders
    lm_head = model.get_output_embeddings().weight
    for mode, folder in built.items():
        capture = online_capture(load_manifest(folder), model)
        for batch in batch_loader(CapturedDataset(folder, "validation"), [[0, 1, 2]], 0, False):
            batch = device_batch(batch, "cpu", capture)
            real = batch["attention_mask"].bool()
            want = (batch["final_hidden"][real] @ lm_head.T).argmax(-1)
            assert batch[TOP].dtype == torch.int32 and torch.equal(batch[TOP][real].long(), want), mode
            assert not batch[TOP][~real].any(), mode  # zero on padding, as collate pads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_teacher_is_the_full_vocabulary_maths(dtype, monkeypatch):
    """The pure function on random rows, in float32 and under bf16 autocast (the training dtype
    on a CPU with native bf16 or a GPU): the reference's probabilities to that dtype's
    tolerance, and its argmax, given the top-1 that `greedy_ids` computes in chunks."""
    g = torch.Generator().manual_seed(0)
    vocab, hidden, rows = 500, 32, 64
    lm_head, final = torch.randn(vocab, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    t2d = torch.rand(vocab, generator=g) < 0.3
    draft_ids = t2d.nonzero().squeeze(1)
    target_to_draft = torch.where(t2d, t2d.long().cumsum(0) - 1, -1)
    want_p, want_top = full_vocab_teacher(final, lm_head, draft_ids, target_to_draft)
    linear = torch.nn.Linear(hidden, vocab, bias=False)
    linear.weight.data = lm_head
    monkeypatch.setattr("data_prep.states.capture.LOGIT_ELEMENTS", 5 * vocab)  # chunks of 5 rows
    top = greedy_ids(linear, final)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        got_p, got_top = draft_teacher(final, lm_head[draft_ids], top, target_to_draft)
    assert got_p.dtype == torch.float32 and torch.equal(got_top, want_top)
    assert (want_top >= 0).any() and (want_top < 0).any()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got_p, want_p, atol=tol, rtol=tol)
