"""Counting the host-device syncs of training steps (ops that read a value back or size their
output by the data), and the tiny trainees and captured items those steps run on."""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conf.kinds import DFlashConfig, DSparkConfig, Eagle3Config, MedusaConfig, MtpConfig, PEagleConfig
from conf.schema import DistConfig, OptimConfig
from data_prep.states.capture import TOP, greedy_ids
from heads.dflash.model import DFlashHead
from heads.dspark.model import DSparkHead
from heads.eagle3.model import Eagle3Head
from heads.kinds import KINDS
from heads.medusa.model import MedusaHead
from heads.mtp.model import MtpHead
from heads.peagle.model import PEagleHead
from scripts.build_mtp_target import tiny_mtp_model
from trainer.batching import batch_loader
from trainer.checkpoint import TrainState
from trainer.distributed import build_accelerator
from trainer.health import NonFiniteWatch
from trainer.kinds.dflash import DFlashTrainee
from trainer.kinds.dspark import DSparkTrainee
from trainer.kinds.eagle3 import Eagle3Trainee
from trainer.kinds.medusa import JointMedusaTrainee, MedusaTrainee
from trainer.kinds.mtp import MtpTrainee
from trainer.kinds.peagle import PEagleTrainee
from trainer.loop import lr_lambda, train_step
from trainer.on_policy import OnPolicy
from trainer.tally import Tally

ROOT = Path(__file__).resolve().parents[2]


# Ops that read a value back or size their output by the data.
SYNC_OPS = {
    "_local_scalar_dense",  # .item(), float(t), int(t), bool(t)
    "nonzero",
    "masked_select",
    "is_nonzero",
    "equal",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
}


INDEXING_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}  # sync with a bool index


def forces_sync(func, args: tuple, kwargs: dict) -> bool:
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    if name in INDEXING_OPS:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if name == "repeat_interleave":  # tensor repeats: the output length is their sum
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    return False


def caller() -> str:
    """The innermost frame in draftsmith's own code (not the tests): where to look."""
    ours = [
        f for f in traceback.extract_stack()
        if f.filename.startswith(str(ROOT)) and not f.filename.startswith(str(ROOT / "tests"))
    ]
    return f"{Path(ours[-1].filename).relative_to(ROOT)}:{ours[-1].lineno}" if ours else "?"


class SyncCounter(TorchDispatchMode):
    """Records each syncing op with the line that called it. `host_scalars()` lists tensors that
    live on the host even in a GPU run, whose reads are no sync: on the CPU every tensor does."""

    def __init__(self, host_scalars=tuple):
        super().__init__()
        self.host_scalars = host_scalars
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if forces_sync(func, args, kwargs) and not any(args[0] is t for t in self.host_scalars()):
            self.syncs.append(f"{func} at {caller()}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_syncs(host_scalars=tuple):
    """The dispatch mode, plus `Tensor.tolist`, which on a CPU tensor reads memory without any op
    (on a GPU it is a device-to-host copy)."""
    counter = SyncCounter(host_scalars)
    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        counter.syncs.append(f"tolist at {caller()}")
        return tolist(t)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            yield counter.syncs
    finally:
        torch.Tensor.tolist = tolist


# Rows of different lengths (padding) and labelled shares: two assistant turns, one long answer,
# a short one, none.
LABELLED = [(14, [range(4, 9), range(11, 14)]), (11, [range(3, 11)]), (9, [range(7, 9)]), (6, [])]


def samples(model, fields: tuple[str, ...], labelled=LABELLED) -> list[dict[str, torch.Tensor]]:
    """Items as `data_prep.folders.store.CapturedDataset` yields them (hidden states stored in bf16, the
    target's top-1 from the stored final one), of `labelled`'s (length, labelled spans)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for length, spans in labelled:
        ids = torch.randint(3, 3000, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.bool)
        for span in spans:
            mask[span.start : span.stop] = True
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        captured = {
            "aux_hidden": torch.cat([hs[i][0] for i in (2, 4, 5)], -1).bfloat16(),
            "final_hidden": hs[-1][0].bfloat16(),
        }
        captured[TOP] = greedy_ids(model.get_output_embeddings(), captured["final_hidden"].float())
        out.append({"input_ids": ids, "loss_mask": mask} | {f: captured[f] for f in fields})
    return out


def eagle3(model, draft: int = 3000, aux: tuple[int, ...] = (2, 4, 5), ttt_length: int = 3, **head):
    """An EAGLE-3 trainee drafting over the first `draft` ids (`head`: more config fields, as
    `sliding_window`), and the captured fields it reads."""
    vocab = model.config.vocab_size
    d2t, t2d = torch.zeros(draft, dtype=torch.long), torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft] = True
    head = Eagle3Head.from_target(model, "tiny", Eagle3Config(aux_layer_ids=list(aux), **head), d2t, t2d)
    lm_head = model.get_output_embeddings().weight
    trainee = Eagle3Trainee(head, lm_head, ttt_length=ttt_length, step_weight=0.8)
    return trainee, ("aux_hidden", "final_hidden", TOP)


def peagle(
    model, draft: int = 3000, aux: tuple[int, ...] = (2, 4, 5), slots: int = 3, anchor_fraction: float = 0.5,
    **head,
):
    """A P-EAGLE trainee drafting over the first `draft` ids (mask slots at a sample of anchors;
    `head`: more config fields), and the captured fields it reads."""
    vocab = model.config.vocab_size
    d2t, t2d = torch.zeros(draft, dtype=torch.long), torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft] = True
    cfg = PEagleConfig(aux_layer_ids=list(aux), parallel_tokens=slots, mask_token_id=0, **head)
    head = PEagleHead.from_target(model, "tiny", cfg, d2t, t2d)
    lm_head = model.get_output_embeddings().weight
    trainee = PEagleTrainee(head, lm_head, slots, 0.8, anchor_fraction=anchor_fraction)
    return trainee, ("aux_hidden", "final_hidden", TOP)


# A block drafter kind: its config, head and trainee classes, and config fields besides DFlash's.
DFLASH = (DFlashConfig, DFlashHead, DFlashTrainee, {})
DSPARK = (DSparkConfig, DSparkHead, DSparkTrainee, {"markov_rank": 8})


def dflash(model, aux: tuple[int, ...] = (2, 4, 5), anchors_per_sample: int = 32, kind=DFLASH):
    """A one-layer DFlash trainee (blocks of 4, mask token 3; more anchors than the samples' answer
    positions take every one), or a derived kind's (`kind`: config, head and trainee classes,
    extra config fields), and the captured fields it reads."""
    config_class, head_class, trainee_class, extra = kind
    cfg = config_class(num_layers=1, aux_layer_ids=list(aux), anchors_per_sample=anchors_per_sample, **extra)
    head = head_class.from_target(model, "tiny", cfg, mask_token_id=3)
    return trainee_class(head, anchors_per_sample), ("aux_hidden", "final_hidden")


def dspark(model, aux: tuple[int, ...] = (2, 4, 5), anchors_per_sample: int = 32):
    """`dflash` of DSpark: rank-8 Markov bias (off its zero init, so that it counts) and the
    confidence head."""
    trainee, fields = dflash(model, aux, anchors_per_sample, DSPARK)
    with torch.no_grad():
        trainee.head.markov_head.markov_w2.weight.normal_(0, 0.02)
    return trainee, fields


def medusa1(model):
    head = MedusaHead.from_target(model, "tiny", MedusaConfig(num_heads=2))
    return MedusaTrainee(head, head_weight=0.8), ("final_hidden",)


def medusa2(model):
    """LoRA, self-distilled, with one warm-up step: the counted steps take both branches."""
    cfg = MedusaConfig(num_heads=2, joint=True, lora_rank=4, head_warmup_steps=1)
    return JointMedusaTrainee(MedusaHead.from_target(model, "tiny", cfg), model, cfg), ()


def mtp(model, family: str = "deepseek_v3"):
    """An MTP trainee (3 steps, a fresh layer) on a tiny `family` target of `model`'s vocabulary
    and width: it reads `model`'s final states as that target's."""
    target = tiny_mtp_model(family, model.config.vocab_size)
    assert target.config.hidden_size == model.config.hidden_size
    head = MtpHead.from_target(target, "tiny", MtpConfig(init="scratch"))
    return MtpTrainee(head, 3, 0.6), ("final_hidden",)


# Each kind's tiny trainees for the kind-wide tests here (the sync-free step).
TINY = {"eagle3": (eagle3,), "medusa": (medusa1, medusa2), "peagle": (peagle,), "dflash": (dflash,),
        "dspark": (dspark,), "mtp": (mtp,)}


def _untested(name: str):
    def build(model):
        pytest.fail(f"head kind {name!r} has no tiny trainee in this kind-wide test's table: add one "
                    "so that the test runs on it")
    build.__name__ = f"{name}-untested"
    return build


def kind_builds(table: dict[str, tuple] = TINY, kinds: Iterable[str] = KINDS) -> list:
    """A kind-wide test's parameters, driven by the records (`heads.kinds.KINDS`): every tiny
    trainee `table` lists for each kind, or for a kind it lacks a parameter that fails naming
    the kind, so a new kind is tested by default."""
    return [pytest.param(build, id=build.__name__) for name in kinds
            for build in table.get(name, (_untested(name),))]


def assert_steps_never_sync(
    trainee, items: list[dict[str, torch.Tensor]], tmp_path: Path, capture=None, packed: bool = False,
    on_policy: OnPolicy | None = None,
):
    """Two rounds of `train_step` (+ the LR schedule) over one loader batch of `items`, the way
    `fit` runs them (`capture`: online mode's target forward; `packed`: two samples a row;
    `on_policy`: as steps of the on-policy stage, whose rows are laid out on the host first, as
    the loop lays them out from the loader's host batch), with the loop's non-finite watch and the
    tracker's tally, counting syncs."""
    order = [[[0, 1], [2, 3]]] if packed else [[0, 1, 2, 3]]
    batches = list(batch_loader(items, order, 0, False, trainee.batch_index, packed))
    optim = OptimConfig()
    acc = build_accelerator(DistConfig(), optim, str(tmp_path))
    opt = torch.optim.AdamW(trainee.param_groups(1e-3, 0.01), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.1))
    trainee, opt = acc.prepare(trainee, opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    staged = TrainState(on_policy_from=0)
    owns = [None if on_policy is None else on_policy.transform(acc.unwrap_model(trainee), b, staged)
            for b in batches]

    def step_counters():
        """AdamW keeps its step counts on the host (unless capturable or fused): reading them is
        no sync on a GPU either."""
        return [s["step"] for s in opt.state.values() if "step" in s]

    watch = NonFiniteWatch(acc.device, 0, check_grad_norm=True)  # the loop's non-finite record
    tally = Tally()  # what the tracker reads at logging steps
    with counting_syncs(step_counters) as syncs:
        for batch, own in zip(batches * 2, owns * 2):
            loss = train_step(acc, trainee, opt, params, optim.grad_clip, batch, capture, watch, tally, own)
            sched.step()
    assert not syncs, "\n".join(f"{n} x {where}" for where, n in sorted(Counter(syncs).items()))
    assert torch.isfinite(loss)  # read back as a logging step would
    assert watch.read(acc) is None and watch.step.item() == 3
    logged = tally.read(acc, acc.unwrap_model(trainee).summarize)  # as a logging step reads it
    assert logged["grad_norm"] > 0 and "score" in logged, logged
