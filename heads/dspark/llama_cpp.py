"""DSpark heads as llama.cpp's draft model: `export.formats=[dspark-gguf]`, DFlash's GGUF
(`heads.dflash.llama_cpp`) with what DSpark adds, `--spec-type draft-dspark`.

Read off the llama.cpp that llama-cpp-python 0.3.36 vendors (`src/models/dflash.cpp`
`load_arch_tensors` and `build_dspark_markov_head`, `common/speculative.cpp`,
`conversion/qwen.py` `DSparkModel`):
- tensors `markov_w1.weight` {R, n_vocab} and `markov_w2.weight` {R, n_vocab} (our
  `markov_head.markov_w1` embedding [V, R] and `markov_w2` linear [V, R]), optional
  `conf_proj.weight` {H + R, 1} and `conf_proj.bias` {1} (our confidence head's `proj`). The
  Markov tensor's presence is what makes the architecture DSpark;
- `dflash.sample_from_anchor` false: slot 0 is the anchor, passed through, and slots 1.. are
  drafted, each biased by markov_w2 . markov_w1[the argmax of the slot before] (the anchor for
  slot 1), in the graph: our fill-in layout and our greedy drafter's chain;
- `dflash.has_confidence_head`; llama.cpp reads the confidence only with `--spec-draft-p-min`
  above 0 (it then cuts a draft at the first slot below it; our decoder never does), and only as
  [hidden ; markov_w1[prev]], so a confidence head of the hidden alone is refused.
"""

from __future__ import annotations

from typing import ClassVar

from conf.errors import UserError
from heads.dflash.llama_cpp import DFlashGGUF
from heads.export.core import Tensors
from heads.export.llama_cpp import BOOL

MARKOV = {f"markov_head.markov_{w}.weight": f"markov_{w}.weight" for w in ("w1", "w2")}
CONFIDENCE = {f"confidence_head.proj.{p}": f"conf_proj.{p}" for p in ("weight", "bias")}


def _confidence(cfg: dict) -> tuple[bool, bool]:
    """(confidence head, reading the Markov embedding) of a saved config or `head.*` settings."""
    if "enable_confidence_head" in cfg:
        return bool(cfg["enable_confidence_head"]), bool(cfg["confidence_head_with_markov"])
    return bool(cfg.get("confidence_head", True)), bool(cfg.get("confidence_with_markov", True))


class DSparkGGUF(DFlashGGUF):
    """The `dspark-gguf` layout: DFlash's and the Markov and confidence heads (module docstring)."""

    fmt, spec_type = "dspark-gguf", "draft-dspark"
    extra_keys: ClassVar[dict] = {".sample_from_anchor": BOOL, ".has_confidence_head": BOOL}

    def refusal(self, cfg: dict, target_layers: int | None = None) -> str | None:
        enabled, with_markov = _confidence(cfg)
        if enabled and not with_markov:
            return ("head.confidence_with_markov=false: llama.cpp's confidence head reads "
                    "[hidden ; markov_w1[prev]] only")
        return super().refusal(cfg, target_layers)

    def extra_names(self, cfg: dict) -> dict[str, str]:
        return MARKOV | (CONFIDENCE if cfg["enable_confidence_head"] else {})

    def extra_values(self, cfg: dict) -> dict:
        key = self.schema.key
        return {key("sample_from_anchor"): False,
                key("has_confidence_head"): bool(cfg["enable_confidence_head"])}

    def extra_fields(self, get, stored: Tensors, where: str) -> dict:
        if get("sample_from_anchor"):
            raise UserError(f"{where}: sample_from_anchor is true; this head drafts slots 1.. of its block")
        if "markov_w1.weight" not in stored:
            raise UserError(f"{where}: no markov_w1.weight: a DFlash draft, not a DSpark one")
        conf = bool(get("has_confidence_head"))
        return {
            "markov_rank": stored["markov_w1.weight"].shape[1],
            "markov_head_type": "vanilla",
            "enable_confidence_head": conf,
            "confidence_head_with_markov": conf,
        }
