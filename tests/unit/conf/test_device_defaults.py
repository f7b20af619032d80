"""What unset cadences become per device, the GPU preset, and the line a GPU run on the CPU-sized
defaults prints. Pure functions of the config and `cuda: bool`: no GPU is needed (nor mocked) to
check what a GPU run would get, the device is an argument."""

from __future__ import annotations

import pytest

from conf.compose import compose_root
from conf.device_defaults import Cadence, cpu_sized_line
from conf.errors import UserError
from conf.schema import OptimConfig


def test_unset_cadences_resolve_per_device_and_a_users_win_on_any():
    assert Cadence.of(OptimConfig(), cuda=False) == Cadence(val_batches=None, save_every_s=None)
    assert Cadence.of(OptimConfig(), cuda=True) == Cadence(val_batches=200, save_every_s=1800.0)
    # 0 turns either off on CUDA too (the whole split; every optim.save_every steps)
    assert Cadence.of(OptimConfig(val_batches=0, save_every_min=0), cuda=True) == Cadence(None, None)
    assert Cadence.of(OptimConfig(val_batches=5, save_every_min=2), cuda=False) == Cadence(5, 120.0)


@pytest.mark.parametrize("override", ["optim.val_batches=-1", "optim.save_every_min=-5.0"])
def test_negative_cadences_are_one_line_errors(override):
    with pytest.raises(UserError, match=rf"^{override}: expected null \(per device\)"):
        compose_root(["+head=eagle3", override])


def test_the_gpu_preset_composes_to_the_peers_sizes():
    cfg = compose_root(["+head=eagle3", "+preset=gpu"])
    d, o = cfg.data, cfg.optim
    assert (d.max_length, d.draft_vocab_size, d.max_samples) == (2048, 32000, 0)
    assert (o.lr, o.warmup_ratio, o.batch_tokens, o.max_batch_size) == (1e-4, 0.015, 16384, 64)
    assert cfg.budget is None and cfg.budget_s is None  # sized by its data, not by 20 minutes
    # its cadences are written out: the same wherever the run lands
    assert Cadence.of(o, cuda=False) == Cadence.of(o, cuda=True) == Cadence(200, 1800.0)
    # after a target group too (each sets a budget), and under any head kind; overrides still win
    assert compose_root(["+head=medusa", "target=qwen2.5-coder-0.5b", "+preset=gpu"]).budget is None
    assert compose_root(["+head=eagle3", "+preset=gpu", "data.max_length=4096"]).data.max_length == 4096


def test_a_gpu_run_on_the_cpu_sized_defaults_names_the_preset_once():
    defaults = compose_root(["+head=eagle3"])
    line = cpu_sized_line(defaults, cuda=True)
    assert line == (
        "GPU run on the CPU-sized defaults (data.max_length=512, data.draft_vocab_size=8192, "
        "optim.batch_tokens=1024, head.ttt_length=3): for an 8B-class target add +preset=gpu "
        "(conf/preset/gpu.yaml)"
    )
    assert cpu_sized_line(defaults, cuda=False) is None
    assert cpu_sized_line(compose_root(["+head=eagle3", "+preset=gpu"]), cuda=True) is None
    # a size the user chose is not second-guessed
    assert cpu_sized_line(compose_root(["+head=eagle3", "optim.batch_tokens=4096"]), cuda=True) is None
    # a head kind without a TTT depth (P-EAGLE's is null) is judged on the rest
    peagle = cpu_sized_line(compose_root(["+head=peagle"]), cuda=True)
    assert peagle is not None and "ttt_length" not in peagle
