"""DSpark heads: the config's refusals, the Markov and confidence tensors saved and read back, and
vLLM 0.32's two layouts (`Qwen3DSparkModel` with the top-level Markov fields, speculators'
`dspark`), read back by our strict readers and self-checked. Real heads on the tiny llama target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conf.compose import compose_root
from conf.errors import UserError
from conf.kinds import DSparkConfig
from heads.dspark.export import read_native
from heads.dspark.model import DSparkHead
from heads.export.write import detect_format, export_head, load_export
from heads.kinds import head_kind
from tests.support.heads import random_dflash_head, random_dspark_head
from tests.support.runs import user_error_line

AUX = [2, 4, 6]
R = 8
MARKOV = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
CONFIDENCE = {"confidence_head.proj.weight", "confidence_head.proj.bias"}


@pytest.fixture(scope="module")
def saved(tiny_model, tiny_llama_dir, tmp_path_factory):
    head = random_dspark_head(tiny_model, str(tiny_llama_dir), aux_layer_ids=AUX, block_size=5)
    return head.save_pretrained(tmp_path_factory.mktemp("dspark") / "head")


@pytest.mark.parametrize("override, field", [("head.markov_head_type=gated", "head.markov_head_type"),
                                             ("head.markov_rank=0", "head.markov_rank"),
                                             ("head.confidence_weight=-1", "head.confidence_weight")])
def test_bad_settings_are_one_line_naming_the_override(override, field):
    line = user_error_line(lambda: compose_root(["+head=dspark", override]))
    assert line.startswith(f"error: {field}=")


def test_a_fresh_head_drafts_as_dflash_does(tiny_model):
    """markov_w2 starts at zero: the bias is nothing until trained."""
    cfg = DSparkConfig(num_layers=1, markov_rank=R)
    head = DSparkHead.from_target(tiny_model, "tiny", cfg, mask_token_id=3)
    assert not head.bias(torch.arange(10)).any()
    assert head.confidence_head.proj.weight.shape == (1, tiny_model.config.hidden_size + R)


def test_exports_are_vllms_layouts_and_load_back_as_the_trained_head(
    tiny_model, saved, tmp_path, tiny_llama_dir
):
    trained = DSparkHead.from_pretrained(saved, tiny_model, str(tiny_llama_dir))
    check = head_kind("dspark").check
    native, report = export_head(saved, "dspark", tmp_path / "native", target_model=tiny_model,
                                 dtype="float32")
    assert report["outputs_identical"]
    cfg = json.loads((native / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert {k: cfg[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                "confidence_head_with_markov", "sample_from_anchor")} == {
        "markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "sample_from_anchor": False}
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 3, 5], "causal": False}
    assert MARKOV | CONFIDENCE <= set(load_file(native / "model.safetensors"))
    assert detect_format(native) == "dspark"
    assert '"method": "dspark"' in (native / "README.md").read_text()
    spec, _ = export_head(saved, "dspark-speculators", tmp_path / "spec", target_model=tiny_model,
                          num_speculative_tokens=7, dtype="float32")
    top = json.loads((spec / "config.json").read_text())
    assert top["speculators_model_type"] == "dspark" and top["speculators_config"]["algorithm"] == "dspark"
    assert top["sample_from_anchor"] is False and top["markov_rank"] == R
    assert top["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # block 5, not 7
    assert detect_format(spec) == "dspark-speculators"
    for out in (native, spec):
        back = load_export(out, tiny_model, str(tiny_llama_dir))
        assert isinstance(back, DSparkHead)
        for k, v in check.outputs(trained).items():
            assert torch.equal(check.outputs(back)[k], v), (out, k)


def test_a_dflash_export_is_not_read_as_dspark(tiny_model, tiny_llama_dir, tmp_path):
    flash = random_dflash_head(tiny_model, str(tiny_llama_dir), aux_layer_ids=AUX)
    flash = flash.save_pretrained(tmp_path / "h")
    out, _ = export_head(flash, "dflash", tmp_path / "native", target_model=tiny_model)
    assert detect_format(out) == "dflash"
    with pytest.raises(UserError, match="expected \\['Qwen3DSparkModel'\\]"):
        read_native(out)


def test_a_missing_markov_field_or_another_head_type_fails_the_read(tiny_model, saved, tmp_path):
    out, _ = export_head(saved, "dspark", tmp_path / "native", target_model=tiny_model)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "markov_rank"}))
    with pytest.raises(UserError, match="lacks \\['markov_rank'\\]"):
        read_native(out)
    (out / "config.json").write_text(json.dumps(cfg | {"markov_head_type": "gated"}))
    with pytest.raises(UserError, match="loads vanilla"):
        read_native(out)
