"""Online training fed by servers, its parts that need no server: the bounded prefetch
(`data_prep.folders.prefetch`), a served batch laid out as the offline batch
(`data_prep.folders.online_engine`), the target parts the process holds, and the config refused
up front (`trainer.train`). A real vLLM server feeds a whole run in tests/e2e/test_capture_server.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conf.errors import UserError
from conf.sizes import Sizes
from data_prep.conversations.ranks import SINGLE
from data_prep.folders.online_engine import ServedCapture, documents
from data_prep.folders.prefetch import prefetched
from data_prep.prepare import capture_spec
from data_prep.states.capture import NONFINITE, TOP, CaptureSpec, stored
from data_prep.target import resolve_target
from heads.kinds import head_kind
from tests.support.runs import tiny_run_config, user_error_line
from trainer.batching import collate, collate_packed
from trainer.distributed import build_accelerator
from trainer.kinds import build_trainee
from trainer.loop import checked_device_batch
from trainer.train import check_served_online, decide_sizes, held_target

EAGLE3 = head_kind("eagle3")
SERVED = ("data.hidden_states=online", "data.capture.backend=server",
          "data.capture.endpoints=[http://127.0.0.1:9/v1]")


class Counted:
    """Items handed out one by one, counting how many were taken."""

    def __init__(self, n: int):
        self.n, self.taken = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.taken += 1
            yield i


def test_prefetch_keeps_order_and_its_bound():
    items, depth, ahead = Counted(20), 3, []
    for i, (item, value) in enumerate(prefetched(items, lambda x: x * x, depth)):
        assert (item, value) == (i, i * i)
        time.sleep(0.01)  # a slow consumer: the thread runs as far ahead as it may
        ahead.append(items.taken - (i + 1))
    assert max(ahead) == depth  # reached, never passed
    assert items.taken == 20


def test_prefetch_raises_at_the_failing_item_after_every_item_before_it():
    def work(x: int) -> int:
        if x == 5:
            raise UserError("data.capture.endpoints: no server answers")
        return x

    got = []
    with pytest.raises(UserError, match="no server answers"):
        for item, _ in prefetched(range(10), work, 2):
            got.append(item)
    assert got == [0, 1, 2, 3, 4]


def test_prefetch_closed_early_stops_its_thread():
    items = Counted(1000)
    stream = prefetched(items, lambda x: x, 2)
    assert [next(stream)[0] for _ in range(3)] == [0, 1, 2]
    stream.close()
    assert items.taken <= 3 + 2
    assert not any(t.name == "prefetch" for t in threading.enumerate())


class FakeServer:
    """A `Capturer` whose states are a function of each sample's ids alone, as a server's are:
    what a server computes for a sample does not depend on the batch it came in."""

    def __init__(self, hidden: int = 4):
        self.hidden, self.calls = hidden, 0

    def fields(self, ids: list[int]) -> dict[str, torch.Tensor]:
        t = torch.tensor(ids, dtype=torch.float32)[:, None]
        scale = torch.arange(1, self.hidden + 1, dtype=torch.float32) / 7
        aux = torch.sin(t * scale).repeat(1, 3) + torch.arange(len(ids))[:, None] / 3
        return {"aux_hidden": aux, "final_hidden": torch.cos(t * scale),
                TOP: torch.tensor(ids, dtype=torch.int32) % 5}

    def __call__(self, samples, names):
        self.calls += 1
        return (self.fields(ids) for ids in samples)


def offline_item(server: FakeServer, spec: CaptureSpec, ids: list[int]) -> dict[str, torch.Tensor]:
    """A sample as the offline folder holds it: its states stored, read back."""
    fields = server.fields(ids)
    item = {"input_ids": torch.tensor(ids), "loss_mask": torch.ones(len(ids), dtype=torch.bool)}
    for name, value in fields.items():
        item[name] = value if name == TOP else stored(value, spec.groups(name), spec.storage_dtype)
    return item


@pytest.mark.parametrize("storage", ["bfloat16", "fp8"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_served_batch_is_the_offline_batch(storage, packed):
    spec = CaptureSpec((1, 2, 3), 4, storage, True)
    server = FakeServer()
    samples = [[5, 9, 2, 7, 1], [3, 3, 8], [4, 6], [11, 12, 13, 14, 15, 16, 17]]
    full = [offline_item(server, spec, ids) for ids in samples]
    bare = [{k: item[k] for k in ("input_ids", "loss_mask")} for item in full]
    group = [[0, 2], [1], [3]]
    if packed:
        offline = collate_packed([[full[i] for i in row] for row in group])
        served = collate_packed([[bare[i] for i in row] for row in group])
    else:
        offline, served = collate(full), collate(bare)
    assert len(documents(served)) == len(samples)
    capture = ServedCapture(server, spec, depth=2)
    expected, _ = checked_device_batch(offline, "cpu")
    now, flag = checked_device_batch(served, "cpu", capture)  # asked when the step needs it
    (fetched,) = list(capture.ahead([served]))
    narrow = torch.bfloat16 if storage == "bfloat16" else torch.float32  # exact, half the bytes in bf16
    assert {fetched[n].dtype for n in ("aux_hidden", "final_hidden")} == {narrow}
    ahead, ahead_flag = checked_device_batch(fetched, "cpu", capture)  # not asked again
    assert server.calls == 2
    for got in (now, ahead):
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    assert flag.tolist() == ahead_flag.tolist() == [-1, -1, -1]
    assert NONFINITE not in ahead


@pytest.mark.parametrize("mode", ["served", "offline"])
def test_a_rank_holds_the_parts_a_head_needs_and_trains_as_with_the_target(
    sharp_target, chat_file, tmp_path, mode
):
    """Online from servers and offline, a rank that does not decode holds the target's parts
    only, and drops the whole target if data prep loaded it. (Served, decoded validation's
    default is off by itself; offline, rank 0 would decode by default.)"""
    setting = SERVED if mode == "served" else ("data.hidden_states=offline", "optim.val_decode_prompts=0")
    cfg = tiny_run_config("eagle3", sharp_target, chat_file, tmp_path / "run", *setting,
                          "data.draft_vocab_size=300")
    target = resolve_target(cfg)
    full = target.model  # as data prep leaves it
    hidden = "online" if mode == "served" else "offline"
    parts = held_target(cfg, target, capture_spec(cfg, EAGLE3, target.config.num_hidden_layers), hidden, True)
    assert "model" not in target.__dict__  # dropped
    assert parts is not full
    assert torch.equal(parts.get_input_embeddings().weight, full.get_input_embeddings().weight)
    assert torch.equal(parts.get_output_embeddings().weight, full.get_output_embeddings().weight)
    assert torch.equal(parts.get_decoder().norm.weight, full.get_decoder().norm.weight)
    assert all(p.is_meta for p in parts.get_decoder().layers.parameters())  # no decoder layer held
    a, b = build_trainee(cfg, parts, None), build_trainee(cfg, full, None)
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, value in b.head.state_dict().items():
        if name not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
            continue
        assert torch.equal(a.head.state_dict()[name], value), name
    assert torch.equal(a.teacher_weight, b.teacher_weight)


@pytest.mark.parametrize(
    ("head", "extra", "hidden", "main", "whole"),
    [
        ("eagle3", ("pipeline.evaluate=true",), "offline", True, True),  # rank 0 evaluates with it
        ("eagle3", ("pipeline.evaluate=true",), "offline", False, False),
        ("eagle3", ("optim.val_decode_prompts=2",), "offline", True, True),  # rank 0 decodes with it
        ("eagle3", (), "offline", True, True),  # by default too
        ("eagle3", ("optim.val_decode_prompts=0",), "offline", True, False),
        ("eagle3", (), "online", False, True),  # it computes the states
        ("eagle3", ("optim.on_policy=0.5",), "offline", False, True),  # it runs it on the drafts
        ("medusa", ("head.joint=true",), "offline", False, True),  # Medusa-2 trains the target
    ],
)
def test_a_rank_holds_the_whole_target_where_it_runs_it(sharp_target, chat_file, tmp_path, head, extra,
                                                       hidden, main, whole):
    cfg = tiny_run_config(head, sharp_target, chat_file, tmp_path / "run", f"data.hidden_states={hidden}",
                          *extra)
    target = resolve_target(cfg)
    spec = capture_spec(cfg, head_kind(head), target.config.num_hidden_layers)
    held = held_target(cfg, target, spec, hidden, main)
    assert (held is target.__dict__.get("model")) is whole
    assert any(p.is_meta for p in held.parameters()) is not whole


@pytest.mark.parametrize(
    ("extra", "override"),
    [
        (("pipeline.evaluate=true",), "set pipeline.evaluate=false"),
        (("optim.val_decode_prompts=2",), "set optim.val_decode_prompts=0"),
        (("data.capture.endpoints=[]",), "data.capture.endpoints=[]"),
    ],
)
def test_served_online_refuses_what_runs_the_whole_target_here(
    sharp_target, chat_file, tmp_path, extra, override
):
    cfg = tiny_run_config("eagle3", sharp_target, chat_file, tmp_path / "run", *SERVED, *extra)
    spec = capture_spec(cfg, EAGLE3, resolve_target(cfg).config.num_hidden_layers)
    line = user_error_line(lambda: check_served_online(cfg, spec))
    assert override in line and "data.capture.backend=server" in line, line


def test_served_online_keeps_the_sizes_the_budget_would_plan(sharp_target, chat_file, tmp_path, capsys):
    """The planner times the whole target here: with the states from servers it is skipped, as
    across processes, and the run says so (the budget is on by default)."""
    cfg = tiny_run_config("eagle3", sharp_target, chat_file, tmp_path / "run", *SERVED, "budget=10m",
                          "data.max_samples=null")
    acc = build_accelerator(cfg.dist, cfg.optim, str(tmp_path / "run"))
    sizes, plan = decide_sizes(cfg, acc, resolve_target(cfg), time.perf_counter(), EAGLE3, SINGLE)
    assert plan is None and sizes == Sizes.of(cfg)
    assert "budget=10m: not planned with the states from servers" in capsys.readouterr().out


def test_prefetch_batches_is_bounded(sharp_target, chat_file, tmp_path):
    line = user_error_line(lambda: tiny_run_config(
        "eagle3", sharp_target, chat_file, tmp_path / "run", "data.capture.prefetch_batches=65"
    ))
    assert "data.capture.prefetch_batches=65" in line and "0..64" in line, line
