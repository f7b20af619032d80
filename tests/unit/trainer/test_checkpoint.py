"""Checkpoints: accelerate writes the optimizer and RNG states with torch.save, so resuming must
read them back with weights_only=True (no arbitrary unpickling) and still restore the RNG. They
hold what trains, not the frozen copies of the target's tables, and resume only on the processes
and ZeRO stage that saved them."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from data_prep.target import load_target
from tests.support.runs import tiny_run_config, user_error_line
from trainer.checkpoint import STATE_FILE, TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.distributed import autocast_dtype
from trainer.kinds import build_trainee
from trainer.train import check_run_dir


def test_resume_restores_rng_and_unpickles_only_tensors(tmp_path, monkeypatch):
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    save_checkpoint(acc, tmp_path, TrainState(step=3, epoch=1, batch_in_epoch=2))
    assert (latest_checkpoint(tmp_path) / "model.safetensors").exists()
    torch.manual_seed(999)

    calls, real_load = [], torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    state = load_checkpoint(acc, latest_checkpoint(tmp_path))
    assert (state.step, state.epoch, state.batch_in_epoch) == (3, 1, 2)
    assert len(calls) >= 2 and all(w is True for w in calls)  # optimizer and RNG files
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("name, frozen", [
    ("eagle3", {"head.embed_tokens.weight"}),
    ("dflash", {"head.embed_tokens.weight", "head.lm_head.weight"}),
])
def test_a_checkpoint_holds_what_trains_and_resume_takes_the_frozen_tables_from_the_target(
    name, frozen, tiny_qwen2_dir, chat_file, tmp_path
):
    """The model file holds the trainable parameters and the persistent buffers, none of the
    frozen copies of the target's tables; a rebuilt trainee resumes with its trained weights
    from the file and its frozen tables from the target (here changed before saving, so that a
    checkpoint carrying them would show), and a file lacking a trained weight is refused."""
    cfg = tiny_run_config(name, tiny_qwen2_dir, chat_file, tmp_path / "run")
    target = load_target(str(tiny_qwen2_dir))[0]
    acc = Accelerator(cpu=True)
    trainee = build_trainee(cfg, target, None)
    assert frozen == {n for n, p in trainee.named_parameters() if not p.requires_grad}
    trained = {n for n, p in trainee.named_parameters() if p.requires_grad}
    buffers = set(trainee.state_dict()) - trained - frozen
    with torch.no_grad():
        for p in trainee.parameters():
            p.add_(torch.randn_like(p))  # trained weights and frozen tables both move
    opt = torch.optim.AdamW(trainee.param_groups(1e-3, 0.0)[0]["params"])
    trainee, opt = acc.prepare(trainee, opt)
    path = save_checkpoint(acc, tmp_path, TrainState(step=1))
    saved = load_file(path / "model.safetensors")
    assert set(saved) == trained | buffers

    acc = Accelerator(cpu=True)  # a new run's
    resumed = build_trainee(cfg, target, None)
    opt = torch.optim.AdamW(resumed.param_groups(1e-3, 0.0)[0]["params"])
    resumed, opt = acc.prepare(resumed, opt)
    load_checkpoint(acc, path)
    got = resumed.state_dict()
    for k, v in trainee.state_dict().items():
        assert torch.equal(got[k], v) == (k not in frozen), k
    dtype = autocast_dtype(cfg.dist) or torch.float32  # the training dtype the tables are built in
    assert torch.equal(resumed.head.embed_tokens.weight, target.get_input_embeddings().weight.to(dtype))

    del saved["head.fc.weight"]
    save_file(saved, path / "model.safetensors")
    with pytest.raises(RuntimeError, match=r"missing \['head.fc.weight'\], unexpected \[\]"):
        load_checkpoint(acc, path)


def test_resuming_on_other_processes_or_zero_stage_is_one_line(
    sharp_target, chat_file, tmp_path, monkeypatch
):
    """`rank_batches` deals each rank its share by the process count: a checkpoint resumes on
    the processes and ZeRO stage that saved it, refused before anything loads otherwise (the
    torchrun launch is the WORLD_SIZE it sets), and at the load itself for any other caller."""
    run_dir = tmp_path / "run"
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(torch.nn.Linear(4, 4), torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]))
    path = save_checkpoint(acc, run_dir, TrainState(step=2))
    assert json.loads((path / STATE_FILE).read_text())["world"] == 1
    cfg = tiny_run_config("eagle3", sharp_target, chat_file, run_dir, "resume=true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert user_error_line(lambda: check_run_dir(cfg)) == (
        f"error: resume=true: {path} was saved by 1 process, this run has 2 processes: resume it on the same"
    )
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_run_dir(cfg)
    zero2 = tiny_run_config("eagle3", sharp_target, chat_file, run_dir, "resume=true", "dist=zero2")
    line = user_error_line(lambda: check_run_dir(zero2))
    assert line.endswith(
        "was saved by 1 process, this run has 1 process under dist=zero2: resume it on the same")

    state = json.loads((path / STATE_FILE).read_text())
    (path / STATE_FILE).write_text(json.dumps({**state, "world": 8, "zero_stage": 3}))
    assert user_error_line(lambda: load_checkpoint(acc, path)).endswith(
        "was saved by 8 processes under dist=zero3, this run has 1 process: resume it on the same")
    # A checkpoint saved before the layout was recorded resumes as before.
    unrecorded = {k: v for k, v in state.items() if k not in ("world", "zero_stage")}
    (path / STATE_FILE).write_text(json.dumps(unrecorded))
    assert load_checkpoint(acc, path).step == 2
