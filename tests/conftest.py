"""Shared fixtures: tiny random-weight targets (Llama and Qwen2) with SmolLM2's real tokenizer.

Real transformers models and a real tokenizer, built from a config in seconds; the weights are
seeded so every test sees the same model.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_prep.target import load_tokenizer

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Each test builds its accelerator as a run's own process does. Accelerate keeps one
    `AcceleratorState` per process and refuses a second `Accelerator` with another mixed
    precision (`dist.mixed_precision: auto` is bf16 on a CPU with native bf16, `no` elsewhere)."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's real tokenizer and chat template (the GGUF is converted once and cached)."""
    return load_tokenizer("smollm2-135m-instruct")


def build_tiny_target(out: Path, family: str, tokenizer, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    config = cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **{**TINY, **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama", smol_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", smol_tokenizer)


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


def run_train_cli(args: list[str], launcher: list[str] | None = None, timeout: int = 600):
    """`python -m trainer.train` (or under `launcher`) as users run it, one thread per process."""
    cmd = (launcher or [sys.executable]) + ["-m", "trainer.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def tiny_run_args(head: str, target: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    """`trainer.train` overrides for a seconds-long run of `head` on a tiny target: no
    regeneration, no evaluation or export, small batches."""
    return [
        f"+head={head}",
        f"target.name_or_path={target}",
        "target.num_threads=1",
        f"data.source={data}",
        "data.regenerate.enabled=false",
        "data.max_samples=0",
        "data.val_fraction=0.1",
        f"data.cache_dir={run_dir.parent / 'data-cache'}",
        f"run_dir={run_dir}",
        "pipeline.evaluate=false",
        "pipeline.export=false",
        "optim.batch_tokens=512",
        "optim.max_batch_size=4",
        "optim.lr=1e-3",
        "logging.log_every=2",
        "logging.progress=false",
        *extra,
    ]
