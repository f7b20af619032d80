"""Packed batches (`optim.packing`): several samples share a row, and every objective, the online
capture and Medusa-2's target see each of them exactly as they see it alone in a padded batch.

Samples here are labelled up to their first token, so that a shift across a sample's start would
be counted if anything let it through; the tiny target is "chaotic" (large init), so attention
across samples would move its hidden states far beyond the tolerances.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from conf.kinds import MedusaConfig
from data_prep.states.capture import (
    TOP,
    CaptureSpec,
    capture_batch,
    causal_mask,
    document_mask,
    greedy_ids,
    hidden_states,
)
from heads.medusa.model import MedusaHead
from tests.support.decode import chaotic_target
from tests.support.runs import tiny_run_config, train_losses
from tests.support.syncs import assert_steps_never_sync, kind_builds
from tests.support.syncs import dflash as dflash_trainee
from tests.support.syncs import dspark as dspark_trainee
from tests.support.syncs import eagle3 as eagle3_trainee
from tests.support.syncs import mtp as mtp_trainee
from tests.support.syncs import peagle as peagle_trainee
from trainer.batching import (
    collate,
    collate_packed,
    length_grouped_batches,
    pack_row,
    packed_batches,
    padding_share,
    shard_batches,
)
from trainer.kinds.medusa import JointMedusaTrainee, MedusaTrainee
from trainer.train import run

pytestmark = pytest.mark.usefixtures("single_thread")

AUX = (1, 2, 3)
# (length, first labelled position): labels from the very start, from the middle, and none.
DOCS = [(13, 0), (7, 1), (10, 4), (5, 0), (9, 9)]
ROWS = [[0, 1, 2], [3, 4]]  # the packed layout: three samples in a row, two in the other


def eagle3_spec(model) -> CaptureSpec:
    """EAGLE-3's capture for `model`: the aux layers, the final one and the target's top-1."""
    return CaptureSpec(AUX, model.config.num_hidden_layers, target_top=True)


@pytest.fixture(scope="module")
def target():
    return chaotic_target(layers=4)


def items(model, fields: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
    """Samples as `data_prep.folders.store.CapturedDataset` yields them (hidden states stored in bf16),
    each captured alone."""
    g = torch.Generator().manual_seed(0)
    out = []
    for length, first in DOCS:
        ids = torch.randint(1, model.config.vocab_size, (length,), generator=g)
        mask = torch.arange(length) >= first
        hs = hidden_states(model, ids[None], eagle3_spec(model))
        captured = {name: hs[name][0].bfloat16() for name in ("aux_hidden", "final_hidden")}
        captured[TOP] = greedy_ids(model.get_output_embeddings(), captured["final_hidden"].float())
        out.append({"input_ids": ids, "loss_mask": mask} | {f: captured[f] for f in fields})
    return out


def eagle3(model):
    torch.manual_seed(0)
    return eagle3_trainee(model, draft=200, aux=AUX, ttt_length=4)


def peagle(model):
    """Every anchor's mask slots: the sample of anchors is seeded by the batch's tokens, which
    packing reorders."""
    torch.manual_seed(0)
    return peagle_trainee(model, draft=200, aux=AUX, slots=4, anchor_fraction=1.0)


def dflash(model):
    """Every answer position an anchor: the draw is seeded by the batch's tokens, which packing
    reorders."""
    torch.manual_seed(0)
    return dflash_trainee(model, aux=AUX)


def dspark(model):
    """As `dflash`, with DSpark's Markov bias and confidence head."""
    torch.manual_seed(0)
    return dspark_trainee(model, aux=AUX)


def medusa1(model):
    torch.manual_seed(0)
    head = MedusaHead.from_target(model, "tiny", MedusaConfig(num_heads=3))
    return MedusaTrainee(head, head_weight=0.8), ("final_hidden",)


def medusa2(model):
    """Full fine-tuning, self-distilled: the trained target and the teacher both run packed."""
    cfg = MedusaConfig(num_heads=2, joint=True)
    torch.manual_seed(0)
    return JointMedusaTrainee(MedusaHead.from_target(model, "tiny", cfg), model, cfg), ()


def mtp(model):
    torch.manual_seed(0)
    return mtp_trainee(model)


PACKED = {"eagle3": (eagle3,), "medusa": (medusa1, medusa2), "peagle": (peagle,), "dflash": (dflash,),
          "dspark": (dspark,), "mtp": (mtp,)}


def only(samples: list[dict[str, torch.Tensor]], d: int) -> list[dict[str, torch.Tensor]]:
    """`samples` with every loss mask but sample d's cleared: the loss is sample d's alone."""
    return [s | {"loss_mask": s["loss_mask"] & (i == d)} for i, s in enumerate(samples)]


def packed(samples: list[dict[str, torch.Tensor]], index) -> dict[str, torch.Tensor]:
    return collate_packed([[samples[i] for i in row] for row in ROWS], index)


def floats(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `trainer.loop.device_batch` hands the objective on the CPU."""
    return {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}


@pytest.mark.parametrize("build", kind_builds(PACKED))
def test_packed_batch_gives_each_sample_its_unpacked_loss(target, build):
    trainee, fields = build(target)
    trainee.eval()  # Medusa-2 counts training batches; nothing else differs
    samples = items(target, fields)
    assert sum(len(row) for row in ROWS) == len(DOCS) and max(len(row) for row in ROWS) >= 3
    for d in range(len(DOCS)):
        chosen = only(samples, d)
        unpacked = trainee(floats(collate(chosen, trainee.batch_index)))
        together = trainee(floats(packed(chosen, trainee.batch_index)))
        assert unpacked.keys() == together.keys()
        for k in unpacked:
            torch.testing.assert_close(together[k], unpacked[k], atol=1e-5, rtol=1e-5, msg=f"doc {d}: {k}")
    # All samples at once: the same loss, metric sums and gradients.
    params = [p for p in trainee.parameters() if p.requires_grad]
    outs = [trainee(floats(make(samples, trainee.batch_index))) for make in (collate, packed)]
    for k in outs[0]:
        torch.testing.assert_close(outs[1][k], outs[0][k], atol=1e-5, rtol=1e-5, msg=k)
    grads = [torch.autograd.grad(out["loss"], params) for out in outs]
    for padded_grad, packed_grad in zip(*grads):
        torch.testing.assert_close(packed_grad, padded_grad, atol=1e-5, rtol=1e-4)


def test_packed_rows_keep_positions_and_attention_per_sample():
    rows = [
        [{"input_ids": torch.arange(3) + 1}, {"input_ids": torch.arange(2) + 1}],
        [{"input_ids": torch.ones(1)}],
    ]
    batch = collate_packed(rows)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    mask = document_mask(batch["position_ids"])[:, 0].int().tolist()
    assert mask[0] == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert mask[1] == torch.eye(5, dtype=torch.int).tolist()  # padding attends to itself only
    one = pack_row([{"input_ids": torch.arange(4)}])["position_ids"]
    assert torch.equal(document_mask(one[None]), causal_mask(4, "cpu"))


def test_online_capture_of_packed_rows_equals_each_sample_alone(target):
    spec = eagle3_spec(target)
    samples = items(target, ())
    batch = packed(samples, None)
    got = hidden_states(target, batch["input_ids"], spec, batch["position_ids"])
    plain = hidden_states(target, batch["input_ids"], spec)  # as if one sample a row
    stored = capture_batch(target, spec, batch)
    for r, row in enumerate(ROWS):
        start = 0
        for i in row:
            n = len(samples[i]["input_ids"])
            alone = hidden_states(target, samples[i]["input_ids"][None], spec)
            for name, want in alone.items():
                torch.testing.assert_close(got[name][r, start : start + n], want[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(stored[name][r, start : start + n], want[0], atol=1e-2, rtol=1e-2)
                if start:  # the control: without its own attention a later sample is changed
                    assert not torch.allclose(plain[name][r, start : start + n], want[0], atol=1e-3)
            start += n
        assert not stored["final_hidden"][r, start:].any()  # zero on padding, as collate pads


@pytest.mark.parametrize("build", kind_builds(PACKED))
def test_packed_training_steps_never_sync(target, build, tmp_path):
    trainee, fields = build(target)
    assert_steps_never_sync(trainee, items(target, fields)[:4], tmp_path, packed=True)


def test_online_packed_training_steps_never_sync(target, tmp_path):
    trainee, _ = eagle3(target)
    capture = partial(capture_batch, target, eagle3_spec(target))
    assert_steps_never_sync(trainee, items(target, ())[:4], tmp_path, capture, packed=True)


def lengths_of(seed: int, n: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 120, (n,), generator=g).tolist()


def test_packer_keeps_samples_whole_in_a_fixed_order():
    lengths = lengths_of(0)
    batches = packed_batches(lengths, 256, 8, seed=3, epoch=1)
    assert batches == packed_batches(lengths, 256, 8, seed=3, epoch=1)  # exact resume
    assert batches != packed_batches(lengths, 256, 8, seed=3, epoch=2)
    assert batches != packed_batches(lengths, 256, 8, seed=4, epoch=1)
    flat = sorted(i for b in batches for row in b for i in row)
    assert flat == list(range(len(lengths)))  # every sample once, none split
    row_tokens = max(lengths)
    assert all(len(b) <= 256 // row_tokens for b in batches)
    assert all(sum(lengths[i] for i in row) <= row_tokens for b in batches for row in b)
    padded = length_grouped_batches(lengths, 256, 8, seed=3, epoch=1)
    assert padding_share(lengths, batches) < padding_share(lengths, [[[i] for i in b] for b in padded])
    shards = [shard_batches(batches, r, 2) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(batches) // 2


def test_a_sample_longer_than_a_batch_stays_whole():
    lengths = [40, 700, 30, 90, 20, 60]
    batches = packed_batches(lengths, 256, 8, seed=0, epoch=0)
    assert [[1]] in batches  # alone, unsplit: a row (and a batch) of its own
    assert all(len(b) == 1 and sum(lengths[i] for i in b[0]) <= 256 for b in batches if b != [[1]])


def test_online_training_runs_packed(sharp_target, chat_file, tmp_path):
    """The loop end to end: packed batches, the target's capture inside, validation."""
    run_dir = tmp_path / "run"
    cfg = tiny_run_config(
        "eagle3",
        sharp_target,
        chat_file,
        run_dir,
        "data.draft_vocab_size=400",
        "head.ttt_length=3",
        "optim.packing=true",
        "optim.max_steps=6",
        "optim.val_every=3",
        "data.hidden_states=online",
    )
    assert run(cfg)["steps"] == 6 and (run_dir / "head" / "model.safetensors").exists()
    assert all(torch.isfinite(torch.tensor(train_losses(run_dir))))
