"""Fixtures of both tiers: tiny random-weight target folders with SmolLM2's real tokenizer, the
tiny llama target loaded once for every test that reads it (`tiny_llama`, `tiny_model`), a sharp
target, a chat file, one torch thread, a fresh accelerator state per test (the builders behind
them live in tests/support/), and each test's tier marker, taken from its folder.

Real transformers models and real tokenizers, built from a config in seconds; the weights are
seeded so every test sees the same model.

The rule for tests that stand for a user's command: keep the defaults a user gets.
`logging.progress=false` only where the bar is beside the point and a bar-drawing test covers the
same path: tests/e2e/test_readme_commands.py runs the README's commands as typed, under a
terminal; tests/unit/data_prep/test_data_regenerate.py draws regeneration's bar on every backend.
(The README's main job once died on the bar's path while every test turned the bar off.)
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from conf.schema import RootConfig, TargetConfig
from data_prep.target import Target, resolve_target
from tests.support.disk import SmallDisk
from tests.support.targets import build_tiny_target, target_settings, unchanged

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier, the folder it sits in (`-m unit`, `-m e2e`), and `vllm` where
    its module runs the vLLM venv (names `VLLM_PYTHON`): CI runs those once it has built that venv,
    and a new engine test is one of them without remembering a marker."""
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0]
        if tier in ("unit", "e2e"):
            item.add_marker(tier)
        if hasattr(getattr(item, "module", None), "VLLM_PYTHON"):
            item.add_marker("vllm")


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Each test builds its accelerator as a run's own process does. Accelerate keeps one
    `AcceleratorState` per process and refuses a second `Accelerator` with another mixed
    precision (`dist.mixed_precision: auto` is bf16 on a CPU with native bf16, `no` elsewhere)."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch):
    """wandb never goes online in tests, whatever a config says, and keeps quiet."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # pytest's capture is left alone


@pytest.fixture(scope="module")
def single_thread():
    """2 shared cores: one torch thread is several times faster than two fighting for them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs, mounted for the test; skips where it cannot be mounted (not root)."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    yield SmallDisk(path)
    subprocess.run(["umount", "-l", str(path)], check=True)



@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's real tokenizer and chat template (the GGUF is converted once and cached)."""
    return resolve_target(RootConfig(target=TargetConfig(name_or_path="smollm2-135m-instruct"))).tokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama", smol_tokenizer)


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir) -> Target:
    """The tiny llama target, loaded once per test process: float32 on the CPU, one torch thread
    (the tiers run one process per core), eval mode, no gradients. Every test that only reads the
    target shares it; one that changes it (weights, mode, attention) is failed by name after it
    ran (`_shared_target_unchanged`) and the target restored, so no later test reads its change."""
    settings = TargetConfig(name_or_path=str(tiny_llama_dir), device="cpu", dtype="float32", num_threads=1)
    target = resolve_target(RootConfig(target=settings))
    _SHARED.append((target.model, target_settings(target.model), copy.deepcopy(target.model.state_dict())))
    return target


@pytest.fixture(scope="session")
def tiny_model(tiny_llama: Target):
    """`tiny_llama`'s model."""
    return tiny_llama.model


_SHARED: list = []  # (model, its settings, a copy of its weights) of the shared target, once loaded


@pytest.fixture(autouse=True)
def _shared_target_unchanged(request):
    yield
    for model, settings, weights in _SHARED:
        if not unchanged(model, settings, weights):
            model.to(weights[next(iter(weights))].dtype).load_state_dict(weights)
            model.eval().requires_grad_(False)
            model.config._attn_implementation = settings[2]
            pytest.fail(f"{request.node.nodeid} changed the shared tiny target (tests/conftest.py "
                        f"tiny_llama): copy it, or build its own", pytrace=False)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", smol_tokenizer)


@pytest.fixture(scope="session")
def tiny_mtp_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A tiny DeepSeek-V3 target carrying its MTP layer as the vendor's checkpoints do
    (`scripts/build_mtp_target.py`): what `+head=mtp` trains on."""
    from scripts.build_mtp_target import build_mtp_target

    return build_mtp_target(tmp_path_factory.mktemp("tiny-mtp"), "deepseek_v3", smol_tokenizer)


WORDS = "the cat sat on a mat and then it ran to the red house where a dog slept all day".split()


@pytest.fixture(scope="session")
def sharp_target(tmp_path_factory, smol_tokenizer) -> Path:
    """A tiny target whose next-token distributions are peaked (a scaled final norm), so a head
    has something to learn and the loss visibly falls."""
    from transformers import AutoModelForCausalLM

    out = build_tiny_target(tmp_path_factory.mktemp("sharp"), "llama", smol_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(out)
    model.model.norm.weight.data.fill_(30.0)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory) -> Path:
    """64 user/assistant exchanges of random words: cheap, varied, and template-ready."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    with open(path, "w") as fh:
        for _ in range(64):
            q = " ".join(rng.choice(WORDS) for _ in range(8))
            a = " ".join(rng.choice(WORDS) for _ in range(24))
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            fh.write(json.dumps({"messages": msgs}) + "\n")
    return path


