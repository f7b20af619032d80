"""On-policy training (`optim.on_policy`, `trainer.on_policy`): the head drafts the chain the
decoder drafts, the frozen target's distributions on those drafts are the teacher, the loss is
the plain computation on a tiny case, each draft counts up to the first the target rejects,
gradients reach the head alone, steps stay sync-free, decoding stays lossless and a resumed run
trains what the uninterrupted one did."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conf.kinds import Eagle3Config
from conf.schema import LoggingConfig, OptimConfig, RootConfig, TargetConfig
from data_prep.states.capture import TOP, CaptureSpec, checked_capture
from tests.support.syncs import assert_steps_never_sync, eagle3, samples
from tests.support.targets import hf_greedy
from trainer.batching import collate
from trainer.decoding import Chain, Eagle3Drafter, speculative_generate
from trainer.decoding.verify import Sampling
from trainer.distributed import build_accelerator
from trainer.kinds.eagle3 import ANCHORS, LABEL_WEIGHT
from trainer.loop import fit
from trainer.on_policy import OnPolicy, stage_start

pytestmark = pytest.mark.usefixtures("single_thread")

AUX = (2, 4, 5)  # the layers `tests.support.syncs.samples` stores


def target_capture(model):
    """The target's capture of any rows, as `data_prep.folders.store.target_capture` makes it."""
    return partial(checked_capture, model, CaptureSpec(AUX, model.config.num_hidden_layers, target_top=True))


def on_policy_batch(trainee, model, capture=None, seed: int = 0):
    """(the loader's host batch, the on-policy rows trainee trains on) over `samples`."""
    batch = collate(samples(model, ("aux_hidden", "final_hidden", TOP)), trainee.batch_index)
    rows = trainee.on_policy_rows(batch, torch.Generator().manual_seed(seed))
    moved = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    return batch, trainee.on_policy_batch(moved, rows, capture or target_capture(model))


def test_the_stage_is_the_last_share_of_the_steps():
    assert [stage_start(10, s) for s in (0.0, 0.2, 0.5, 1.0)] == [10, 8, 5, 0]


@torch.no_grad()
def test_the_head_drafts_the_chain_the_decoder_drafts(tiny_model):
    torch.manual_seed(0)
    trainee, _ = eagle3(tiny_model)
    batch = collate(samples(tiny_model, ("aux_hidden",)))
    anchors = torch.tensor([5, 9, 7, 3])
    drafts = trainee.draft_chain(batch["aux_hidden"].float(), batch["input_ids"], anchors)
    assert drafts.shape == (4, 3)
    for row, t in enumerate(anchors.tolist()):
        ids, aux = batch["input_ids"][row], batch["aux_hidden"][row].float()
        drafter = Eagle3Drafter(trainee.head)
        drafter.start(ids[: t + 1], list(aux[: t + 1].chunk(3, -1)), int(ids[t + 1]))
        assert drafter.propose(Chain(3), Sampling()).tokens.tolist() == drafts[row].tolist(), row


@torch.no_grad()
def test_the_loss_is_the_plain_computation_on_the_drafted_rows(tiny_model):
    """One step deep: each row cut at its anchor t, the head's argmax draft after it, the
    target run over the prefix and the draft; the loss is the head's cross-entropy at t on those
    states against the target's distribution at t+1, averaged over the rows whose target
    choice the draft vocabulary holds."""
    model, vocab = tiny_model, tiny_model.config.vocab_size
    torch.manual_seed(0)
    trainee, _ = eagle3(model, draft=vocab, ttt_length=1)
    head = trainee.head
    batch, rows = on_policy_batch(trainee, model)
    losses = []
    for row, t in enumerate(rows[ANCHORS].tolist()):
        ids, aux = batch["input_ids"][row], batch["aux_hidden"][row].float()
        places = torch.arange(t + 1)[None]
        logits = head.step(head.fuse(aux[None, : t + 1]), ids[None, 1 : t + 2], places)[1][0, t]
        seq = torch.cat([ids[: t + 2], head.to_target_ids(logits.argmax())[None]])
        assert torch.equal(rows["input_ids"][row, : t + 3], seq) and rows["loss_mask"][row].sum() == 1
        hs = model(seq[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i][0] for i in AUX], -1).bfloat16().float()  # as stored
        final = hs[-1][0, t + 1].bfloat16().float()
        teacher = final @ model.get_output_embeddings().weight.T
        mine = head.step(head.fuse(feats[None, : t + 1]), seq[None, 1 : t + 2], places)[1][0, t]
        losses.append(-(F.softmax(teacher, -1) * F.log_softmax(mine, -1)).sum())
    want = torch.stack(losses).mean()
    torch.testing.assert_close(trainee(rows)["loss"], want, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_each_draft_counts_up_to_the_first_the_target_rejects(tiny_model):
    torch.manual_seed(0)
    trainee, _ = eagle3(tiny_model)
    captured = target_capture(tiny_model)
    accept = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)

    def rigged(rows):
        """The real capture, with the target's choice before each draft set to that draft
        where `accept` says (a random head's drafts are all rejected)."""
        out = captured(rows)
        cols = anchors[:, None] + 2 + torch.arange(3)
        drafted = rows["input_ids"].gather(1, cols)
        out[TOP] = out[TOP].scatter(1, cols - 1, torch.where(accept, drafted, -1).int())
        return out

    batch = collate(samples(tiny_model, ("aux_hidden", "final_hidden", TOP)), trainee.batch_index)
    rows = trainee.on_policy_rows(batch, torch.Generator().manual_seed(0))
    anchors = rows[ANCHORS]
    moved = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    out = trainee.on_policy_batch(moved, rows, rigged)
    cols = anchors[:, None] + 2 + torch.arange(3)
    assert out[LABEL_WEIGHT].gather(1, cols).tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert out[LABEL_WEIGHT].sum() == 9 and out["loss_mask"].sum() == 12


def test_gradients_reach_the_head_alone_and_the_target_stays_frozen(tiny_model):
    torch.manual_seed(0)
    trainee, _ = eagle3(tiny_model, draft=tiny_model.config.vocab_size)  # every target choice counts
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    _, rows = on_policy_batch(trainee, tiny_model)
    assert not any(v.requires_grad for v in rows.values() if torch.is_tensor(v))  # drafted, captured
    trainee(rows)["loss"].backward()
    trained = [p for p in trainee.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)
    assert all(p.grad is None for p in tiny_model.parameters())
    assert not any(p is q for p in trained for q in tiny_model.parameters())
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in before.items())


def test_on_policy_steps_never_sync(tiny_model, tmp_path):
    torch.manual_seed(0)
    trainee, fields = eagle3(tiny_model, draft=tiny_model.config.vocab_size)
    stage = OnPolicy(target_capture(tiny_model), seed=0)
    assert_steps_never_sync(trainee, samples(tiny_model, fields), tmp_path, on_policy=stage)


def test_a_head_trained_on_policy_decodes_losslessly(tiny_model):
    torch.manual_seed(0)
    trainee, _ = eagle3(tiny_model, draft=tiny_model.config.vocab_size)
    opt = torch.optim.AdamW(trainee.param_groups(1e-2, 0.0))
    for seed in range(3):
        _, rows = on_policy_batch(trainee, tiny_model, seed=seed)
        trainee(rows)["loss"].backward()
        opt.step()
        opt.zero_grad()
    head = trainee.head.eval()
    prompt = torch.randint(3, 3000, (12,), generator=torch.Generator().manual_seed(1))
    out = speculative_generate(tiny_model, Eagle3Drafter(head), prompt, 24, Chain(3))
    assert out.tokens == hf_greedy(tiny_model, prompt.tolist(), 24)


class Samples(torch.utils.data.Dataset):
    """The loop's dataset interface (items and `lengths`) over samples made in memory."""

    def __init__(self, items: list[dict[str, torch.Tensor]]):
        self.items, self.lengths = items, [len(s["input_ids"]) for s in items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def test_a_resumed_run_trains_what_the_uninterrupted_one_did(tiny_model, tmp_path):
    """Four steps, the last half on-policy, checkpointed every two; a run resumed from step 2
    (the stage's start, which its checkpoint keeps) ends on the same weights and losses."""
    items = Samples(samples(tiny_model, ("aux_hidden", "final_hidden", TOP)) * 2)

    def train(run_dir: Path, resume: bool):
        cfg = RootConfig(
            target=TargetConfig(name_or_path="tiny", device="cpu"),
            optim=OptimConfig(max_steps=4, save_every=2, val_every=2, batch_tokens=32, max_batch_size=2,
                              warmup_ratio=0.0, on_policy=0.5),
            logging=LoggingConfig(tensorboard=False, progress=False, log_every=1),
            head=Eagle3Config(aux_layer_ids=list(AUX)),
            run_dir=str(run_dir),
            resume=resume,
        )
        torch.manual_seed(0)
        trainee, _ = eagle3(tiny_model)
        acc = build_accelerator(cfg.dist, cfg.optim, str(run_dir))
        fit(cfg, acc, trainee, items, items, run_dir, teacher=target_capture(tiny_model))
        losses = [h["loss"] for h in json.loads((run_dir / "history.json").read_text()) if "loss" in h]
        return losses, {k: v.detach().clone() for k, v in trainee.named_parameters() if v.requires_grad}

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    losses, weights = train(straight, False)
    kept = straight / "checkpoints" / "step-0000002"
    assert json.loads((kept / "trainer_state.json").read_text())["on_policy_from"] == 2
    shutil.copytree(kept, resumed / "checkpoints" / kept.name)
    again, rest = train(resumed, True)
    assert again == losses and len(losses) == 4
    assert all(torch.equal(rest[k], w) for k, w in weights.items())
