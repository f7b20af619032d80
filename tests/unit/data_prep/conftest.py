"""Fixtures the data prep unit tests share."""

from __future__ import annotations

import pytest
import torch

from data_prep.target import load_target


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def chaotic(request):
    """A tiny target scaled up (x10, norms aside) so that greedy text varies with the context;
    at the default init it repeats one token forever, which any engine would reproduce."""
    folder = request.getfixturevalue(f"tiny_{request.param}_dir")
    model, tok = load_target(str(folder), dtype="float32", num_threads=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(10)
    return model, tok
