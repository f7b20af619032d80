"""Shared fixtures: tiny random-weight targets (Llama and Qwen2) with SmolLM2's real tokenizer.

Real transformers models and a real tokenizer, built from a config in seconds; the weights are
seeded so every test sees the same model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.target import load_tokenizer

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


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
