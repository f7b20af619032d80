"""The eleven published chat templates of `../shared/chat-templates/` (next to the checkout), each
loaded on SmolLM2's tokenizer with its family's markers added as special tokens and its BOS/EOS
set, as the family's own tokenizer has them."""

from __future__ import annotations

import copy
from pathlib import Path

from data_prep.template import load_chat_template

TEMPLATES = Path(__file__).resolve().parents[3] / "shared" / "chat-templates"
LLAMA3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|python_tag|>"]
QWEN = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
# template -> (special tokens, bos, eos, extra stop tokens)
FAMILIES = {
    "llama-3.1-3.3-instruct": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ()),
    "llama-3.2-instruct": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ()),
    "qwen2.5-instruct": (QWEN, None, "<|im_end|>", ()),
    "qwen3": (QWEN + ["<think>", "</think>"], None, "<|im_end|>", ()),
    "qwen3-initial-2025-04": (QWEN + ["<think>", "</think>"], None, "<|im_end|>", ()),
    "gemma3-it": (["<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>", ()),
    "gpt-oss": (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                 "<|constrain|>"], None, "<|return|>", ("<|call|>",)),
    "mistral-7b-instruct-v0.3": (MISTRAL, "<s>", "</s>", ()),
    "mistral-small-3.1-24b-instruct-2503": (MISTRAL + ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"], "<s>", "</s>",
                                            ()),
    "mixtral-8x7b-instruct-v0.1": (["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", ()),
    "deepseek-r1-distill": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                             "<｜Assistant｜>", "<think>", "</think>"],
                            "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ()),
}


def family(name: str, **kwargs):
    specials, bos, eos, extra = FAMILIES[name]
    tok = copy.deepcopy(_base_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.bos_token, tok.eos_token = bos, eos
    stops = {tok.convert_tokens_to_ids(t) for t in (eos, *extra)}
    return load_chat_template(tok, str(TEMPLATES / f"{name}.jinja"), kwargs, "2026-01-01", stops)


_BASE = {}


def _base_tokenizer():
    if not _BASE:
        from conf.schema import RootConfig, TargetConfig
        from data_prep.target import resolve_target

        smol = TargetConfig(name_or_path="smollm2-135m-instruct")
        _BASE["tok"] = resolve_target(RootConfig(target=smol)).tokenizer
    return _BASE["tok"]
