"""A data cache on a disk too small: offline capture refuses before it starts (one line: needed,
free, the online mode), `auto` picks online there, and a disk that fills anyway is one line naming
the folder, after which the same command resumes the partial folder. The disk is a real tmpfs
where this runs as root, else the free-space probe is patched."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

import data_prep.folders.build as build
import data_prep.folders.store as store
import data_prep.prepare as P
from conf.errors import UserError
from data_prep.folders.store import load_manifest
from data_prep.target import Target
from tests.support.runs import shard_bytes, tiny_prep_config


def test_refusal_comes_before_the_target_loads(tiny_llama_dir, chat_file, tmp_path, monkeypatch):
    """The free-space probe says 1 MB: nothing is captured, the target is never loaded."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: type("Usage", (), {"free": 10**6}))
    monkeypatch.setattr(Target, "load_model", lambda self: pytest.fail("the target was loaded"))
    with pytest.raises(UserError) as err:
        P.prepare(tiny_prep_config(tiny_llama_dir, chat_file, tmp_path, "data.hidden_states=offline"))
    # 4 layers x 64 x 2 bytes, the target's top-1 (4) and the token bytes (5)
    assert " tokens x 521 bytes needs " in str(err.value) and "which has 1.0 MB free" in str(err.value)


def fail_writes_after(monkeypatch, shards: int) -> None:
    """Shard writes fail as on a full disk once `shards` have been written."""
    real, written = store.write_hashed, []

    def write_hashed(path, tensors, metadata):
        if len(written) >= shards:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        written.append(path)
        return real(path, tensors, metadata)

    monkeypatch.setattr(store, "write_hashed", write_hashed)


@pytest.mark.parametrize("disk", ["tmpfs", "raised"])
def test_a_disk_that_fills_mid_capture_is_one_line_and_resumes(
    tiny_llama_dir, chat_file, tmp_path, monkeypatch, request, disk
):
    """The estimate passes (the probe is patched to say 1 TB, as when another process fills the
    disk after the check), then a shard write finds the disk full: one line naming the cache;
    the shards written stay, and once there is room the same call resumes after them, to the
    bytes of an uninterrupted build."""
    if disk == "tmpfs":
        small = request.getfixturevalue("small_disk")
        cache = small.path / "data"
        monkeypatch.setattr(build, "free_bytes", lambda path: 10**12)
    else:
        cache = tmp_path / "data"
        fail_writes_after(monkeypatch, shards=2)
    settings = ("data.hidden_states=offline", "data.shard_samples=8")
    cfg = tiny_prep_config(tiny_llama_dir, chat_file, cache, *settings)
    with pytest.raises(UserError) as err:
        P.prepare(cfg)
    message = str(err.value)
    assert message.startswith(f"{cache}: the disk is full (No space left on device, ") and "\n" not in message
    assert message.endswith(f"; {P.DISK_FULL_THEN}")
    [partial] = cache.glob("*.partial")
    kept = {p.name: p.stat().st_ino for p in (partial / "train").iterdir()}
    assert kept and all(name.startswith("shard-") for name in kept)  # no half-written file

    monkeypatch.undo()
    if disk == "tmpfs":
        small.resize("16m")
    resumed = P.prepare(cfg).path
    clean = P.prepare(tiny_prep_config(tiny_llama_dir, chat_file, tmp_path / "clean", *settings)).path
    assert {name: (resumed / "train" / name).stat().st_ino for name in kept} == kept
    assert shard_bytes(resumed) == shard_bytes(clean)
    assert load_manifest(resumed)["splits"] == load_manifest(clean)["splits"]


def test_a_full_disk_while_saving_is_one_line_and_leaves_only_whole_folders(small_disk, tiny_model):
    """A checkpoint (accelerate's state: weights and AdamW moments, 3 MB) and the best head (a
    12 MB lm_head), saved on a 1 MB disk: one line naming the folder and how to go on, and
    nothing half-written beside the whole folders."""
    from accelerate import Accelerator

    from heads.eagle3.model import Eagle3Config, Eagle3Head
    from trainer.checkpoint import RESUME_THEN, TrainState, checkpoint_root, save_checkpoint
    from trainer.loop import save_best

    acc = Accelerator(cpu=True)
    layer = torch.nn.Linear(512, 512)
    layer, _ = acc.prepare(layer, torch.optim.AdamW(layer.parameters()))
    run = small_disk.path / "run"
    with pytest.raises(UserError) as err:
        save_checkpoint(acc, run, TrainState(step=50))
    line = str(err.value)
    assert line.startswith(f"{checkpoint_root(run)}: the disk is full (No space left on device, ")
    assert line.endswith(RESUME_THEN) and "\n" not in line
    assert list(checkpoint_root(run).iterdir()) == []

    model = tiny_model
    v = model.config.vocab_size
    head = Eagle3Head.from_target(model, "tiny", Eagle3Config(), torch.zeros(v, dtype=torch.long),
                                  torch.ones(v, dtype=torch.bool))
    with pytest.raises(UserError) as err:
        save_best(acc, head, run / "head")
    assert str(err.value).startswith(f"{run}: the disk is full") and str(err.value).endswith(RESUME_THEN)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]
