"""The guard behind the shared tiny target (tests/conftest.py `tiny_llama`): a test that changes
the target must be caught, and one that only changes torch's thread count must not (a float
checksum's rounding followed the thread count and failed every e2e test after one that set 2)."""

from __future__ import annotations

import copy

import torch

from tests.support.targets import target_settings, unchanged


def test_the_guard_catches_a_changed_target_and_not_a_thread_count(tiny_model):
    model = copy.deepcopy(tiny_model)
    settings, weights = target_settings(model), copy.deepcopy(model.state_dict())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert unchanged(model, settings, weights)
    finally:
        torch.set_num_threads(before)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1e-6
    assert not unchanged(model, settings, weights)
    model.load_state_dict(weights)
    assert unchanged(model, settings, weights)
    assert not unchanged(model.to(torch.bfloat16), settings, weights)
    assert not unchanged(model.float().train(), settings, weights)
