"""Checkpoints: accelerate writes the optimizer and RNG states with torch.save, so resuming must
read them back with weights_only=True (no arbitrary unpickling) and still restore the RNG."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint


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
