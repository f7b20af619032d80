"""Frozen target tables in the training dtype (`trainer.trainee.store_frozen_tables`).

A trainee holds copies of the target's tables it never trains: EAGLE-3's (and P-EAGLE's) embedding
and teacher rows, DFlash's (and DSpark's) embedding and lm_head. They were float32, and autocast
caches the casts of trainable leaves only, so every step cast each multiplied table to bf16 again
(DFlash its whole [V, H] lm_head twice). Under mixed precision they are now built in its 16-bit
dtype: these tests hold the stored values to autocast's own cast, one training step's loss and
gradients to the float32-table step's, and count the casts a step makes of a table.

A real tiny Llama target (`tests.support.decode.chaotic_target`) and the trainees the main job
builds (`trainer.kinds.build_trainee`); bf16 autocast runs on the CPU as on a GPU. Nothing is
mocked.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conf.compose import compose_root
from data_prep.states.capture import TOP, greedy_ids
from tests.support.decode import chaotic_target
from tests.support.heads import batch_of
from trainer.kinds import build_trainee
from trainer.trainee import store_frozen_tables

pytestmark = pytest.mark.usefixtures("single_thread")
KINDS = ("eagle3", "peagle", "dflash", "dspark")


@pytest.fixture(scope="module")
def target():
    return chaotic_target("llama")


def trainee_of(target, kind: str, precision: str):
    """The main job's trainee of `kind` on `target` under `dist.mixed_precision=precision`, its
    trainable weights seeded alike whatever the precision and moved off their init (DSpark's
    Markov bias starts at zero, which any dtype adds exactly)."""
    cfg = compose_root([f"+head={kind}", "target.name_or_path=tiny", f"dist.mixed_precision={precision}",
                        *(["head.mask_token_id=3"] if kind in ("dflash", "dspark") else [])])
    torch.manual_seed(0)
    trainee = build_trainee(cfg, target, None)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainee.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return trainee


def tables(trainee) -> dict[str, torch.Tensor]:
    state = trainee.state_dict(keep_vars=True)
    return {name: state[name] if name in state else trainee.get_buffer(name)
            for name in trainee.frozen_tables}


def batch(target, trainee) -> dict[str, torch.Tensor]:
    """Two captured rows of random tokens, every position trained, with the target's top-1."""
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    rows = batch_of(target, trainee.head, ids)
    return {**rows, TOP: greedy_ids(target.get_output_embeddings(), rows["final_hidden"])}


def step(trainee, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, gradient of each trainable parameter) of one bf16-autocast step, as accelerate runs it."""
    trainee.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = trainee(rows)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in trainee.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_tables_are_autocasts_cast_under_bf16_and_float32_without(target, kind):
    """bf16: each table is bf16 and equals its float32 self as autocast would cast it; `no`: float32
    as before. Every frozen floating parameter of the head is one of the named tables (a table a
    kind adds is not left float32 unnoticed); rotary frequencies and vocabulary maps keep their
    dtypes."""
    half, full = trainee_of(target, kind, "bf16"), trainee_of(target, kind, "no")
    frozen = {f"head.{n}" for n, p in full.head.named_parameters()
              if not p.requires_grad and p.is_floating_point()}
    assert frozen and frozen <= set(full.frozen_tables)
    for name, table in tables(half).items():
        reference = tables(full)[name]
        assert reference.dtype == torch.float32 and table.dtype == torch.bfloat16, name
        assert torch.equal(table, reference.to(torch.bfloat16)), name
        assert not table.requires_grad, name
    assert half.head.rotary.inv_freq.dtype == torch.float32
    maps = [(b, f) for b, f in zip(half.buffers(), full.buffers()) if not f.is_floating_point()]
    assert all(b.dtype == f.dtype and torch.equal(b, f) for b, f in maps)  # EAGLE-3: d2t, t2d


@pytest.mark.parametrize("kind", KINDS)
def test_a_bf16_step_equals_the_float32_table_step(target, kind):
    """Loss and gradients of a bf16-autocast step with bf16 tables against the float32-table step:

    - bit for bit, where the float32 tables hold bf16 values, as the `.float()` copies of a bf16
      target (a GPU run's `target.dtype=auto`) always did: every product of a table ran in bf16
      under autocast, which cast the table to these very values;
    - within bf16 rounding, where the target is float32 (as here): an embedding lookup is no
      autocast op, so a float32 table's rows reached the float32 residual stream (DFlash's block,
      EAGLE-3's later unroll steps) unrounded, and now arrive rounded to bf16 (relative 2**-9).
      Measured here: losses within 2e-4 of each other, each gradient within 1-5% in norm, the
      order of bf16 autocast's own departure from a float32 step (1.5-2.3% on these heads)."""
    full = trainee_of(target, kind, "no")
    half = copy.deepcopy(full)
    store_frozen_tables(half, torch.bfloat16)
    bf16_target = copy.deepcopy(full)  # a bf16 target's float32 copies: bf16 values in float32
    for table in tables(bf16_target).values():
        table.data = table.data.to(torch.bfloat16).float()
    rows = batch(target, full)
    loss, grads = step(half, rows)
    exact_loss, exact_grads = step(bf16_target, rows)
    assert torch.equal(loss, exact_loss)
    assert all(torch.equal(grads[n], exact_grads[n]) for n in grads)
    old_loss, old_grads = step(full, rows)
    assert torch.allclose(loss, old_loss, rtol=1e-3)
    for n in grads:
        assert (grads[n] - old_grads[n]).norm() <= 0.1 * old_grads[n].norm(), n


class TableCasts(TorchDispatchMode):
    """Counts the dtype casts (`aten._to_copy`) whose input is one of `tables`' storage."""

    def __init__(self, tables: list[torch.Tensor]):
        super().__init__()
        self.storage = {t.untyped_storage().data_ptr() for t in tables}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.storage:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind, before", [("eagle3", 1), ("dflash", 2)])
def test_a_step_no_longer_casts_a_frozen_table(target, kind, before):
    """A bf16-autocast training step (forward and backward) of float32 tables cast the teacher's
    rows (EAGLE-3, once) or the whole lm_head (DFlash, teacher and draft: twice); with the tables
    stored in bf16 it casts none."""
    rows = None
    counts = {}
    for precision in ("no", "bf16"):
        trainee = trainee_of(target, kind, precision)
        rows = rows or batch(target, trainee)
        with TableCasts(list(tables(trainee).values())) as casts:
            step(trainee, rows)
        counts[precision] = casts.count
    assert counts == {"no": before, "bf16": 0}
