"""`head.sliding_window` in every export: each format of each kind with draft attention writes
the window where vLLM 0.32 reads it (a draft config's `sliding_window` over `layer_types` of
"sliding_attention": `llama.py`'s LlamaAttention for EAGLE-3 and P-EAGLE, `qwen3_dflash.py`'s
`_resolve_layer_attention` for DFlash; a speculators folder's `transformer_layer_config` is the
config vLLM builds), and reads back as the same head, drafting with the same window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen3Config

from conf.kinds import Eagle3Config, PEagleConfig
from heads.export.write import default_formats, export_head, load_export
from heads.kinds import head_kind
from heads.peagle.model import PEagleHead
from heads.window import SLIDING, window_of
from tests.support.heads import make_eagle3_head, random_dflash_head
from trainer.decoding.dflash import DFlashDrafter
from trainer.decoding.drafters import Eagle3Drafter
from trainer.decoding.peagle import PEagleDrafter

W = 24
# kind -> (the engine config class vLLM builds from the draft's config.json, the drafter)
KINDS = {
    "eagle3": (LlamaConfig, Eagle3Drafter),
    "peagle": (LlamaConfig, PEagleDrafter),
    "dflash": (Qwen3Config, DFlashDrafter),
}


@pytest.fixture(scope="module")
def heads(tiny_model, tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {
        "eagle3": make_eagle3_head(tiny_llama_dir, root / "eagle3", cfg=Eagle3Config(sliding_window=W)),
        "peagle": make_eagle3_head(tiny_llama_dir, root / "peagle", head_class=PEagleHead,
                                   cfg=PEagleConfig(sliding_window=W)),
        "dflash": random_dflash_head(
            tiny_model, str(tiny_llama_dir), aux_layer_ids=[1, 2, 3], sliding_window=W
        )
        .save_pretrained(root / "dflash" / "head"),
    }


WINDOWED = {"layer_types": [SLIDING], "sliding_window": W}  # what a windowed head saves


@pytest.mark.parametrize("kind,fmt", [(k, f) for k in KINDS for f in default_formats(head_kind(k), WINDOWED)])
def test_every_export_carries_the_window_where_vllm_reads_it(heads, tiny_model, tiny_llama_dir, tmp_path,
                                                             kind, fmt):
    engine_config, drafter = KINDS[kind]
    out, report = export_head(heads[kind], fmt, tmp_path / fmt, target_model=tiny_model, dtype="float32")
    top = json.loads((out / "config.json").read_text())
    layer = top.get("transformer_layer_config", top)
    built = engine_config(**layer)  # as vLLM builds it: Qwen3Config drops a window without its flag
    assert built.sliding_window == W and set(built.layer_types) == {SLIDING}
    back = load_export(out, tiny_model, str(tiny_llama_dir))
    assert window_of(back.config) == W and drafter(back).window == W
    assert report["max_abs_diff_vs_trained_float32"] == 0.0


def test_a_head_without_a_window_exports_none(tiny_llama_dir, tmp_path, tiny_model):
    plain = make_eagle3_head(tiny_llama_dir, tmp_path / "plain")
    out, _ = export_head(plain, "speculators", tmp_path / "out", target_model=tiny_model)
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert "layer_types" not in layer and window_of(layer) is None
