"""Medusa export: vLLM and TGI names and configs, round trips, zero-bias padding, Medusa-2 refusal.

Real `MedusaHead`s on the tiny random Llama target, saved in the project's folder format, exported
to real safetensors folders and read back by our strict readers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conf.errors import UserError
from heads.export.write import detect_format, export_head, formats_for, load_export
from heads.folder import load_head, save_head
from heads.kinds import head_kind
from heads.medusa.export import read_tgi, read_vllm
from heads.medusa.model import MedusaHead
from tests.support.heads import MEDUSA_HEADS as HEADS
from tests.support.heads import MEDUSA_LAYERS as LAYERS
from tests.support.heads import make_medusa_head


def vllm_names(bias: bool) -> set[str]:
    """vLLM 0.32 medusa.py: Medusa.blocks[h] = ResidualBlock(layers[l] = Linear(bias=
    medusa_fc_bias)), Medusa.lm_heads[h] = ParallelLMHead."""
    names = {f"lm_heads.{h}.weight" for h in range(HEADS)}
    for h in range(HEADS):
        for p in ["weight", "bias"] if bias else ["weight"]:
            names |= {f"blocks.{h}.layers.{j}.{p}" for j in range(LAYERS)}
    return names


# TGI layers/medusa.py: MedusaHead(prefix=h) -> ResBlock(prefix=f"{h}.{l}").linear (bias=True),
# out = FastLinear(prefix=f"{h}.{num_layers}", bias=False).
TGI_NAMES = {f"{h}.{LAYERS}.weight" for h in range(HEADS)} | {
    f"{h}.{j}.linear.{p}" for h in range(HEADS) for j in range(LAYERS) for p in ("weight", "bias")
}


@pytest.fixture(scope="module", params=[True, False], ids=["bias", "no-bias"])
def head_dir(request, tiny_model, tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("medusa") / "head"
    return make_medusa_head(tiny_model, str(tiny_llama_dir), out, fc_bias=request.param)


def test_vllm_layout_names_and_config(head_dir, tmp_path):
    out, _ = export_head(head_dir, "medusa-vllm", tmp_path / "v")
    cfg, _, _ = load_head(head_dir, "medusa")
    assert set(load_file(out / "model.safetensors")) == vllm_names(cfg["fc_bias"])
    top = json.loads((out / "config.json").read_text())
    assert top["architectures"] == ["MedusaModel"] and top["model_type"] == "medusa"
    assert top["num_heads"] == HEADS and top["num_hidden_layers"] == LAYERS
    assert top["medusa_fc_bias"] is cfg["fc_bias"]
    # vLLM's MedusaConfig renames every key holding "num" and "heads"/"layers": only these two.
    assert [k for k in top if "num" in k] == ["num_heads", "num_hidden_layers"]
    assert detect_format(out) == "medusa-vllm"


def test_tgi_layout_names_and_config(head_dir, tmp_path):
    out, _ = export_head(head_dir, "medusa-tgi", tmp_path / "t")
    cfg, _, _ = load_head(head_dir, "medusa")
    tensors = load_file(out / "medusa_lm_head.safetensors")
    assert set(tensors) == TGI_NAMES  # TGI always loads the bias: zeros when the head has none
    if not cfg["fc_bias"]:
        assert not any(torch.count_nonzero(v) for k, v in tensors.items() if k.endswith("bias"))
    top = json.loads((out / "config.json").read_text())
    assert "architectures" not in top  # TGI would take the folder for another speculator
    assert top["medusa_num_heads"] == HEADS and top["medusa_num_layers"] == LAYERS
    assert top["base_model_name_or_path"]
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "medusa_lm_head.safetensors",
    ]


@pytest.mark.parametrize("fmt,reader", [("medusa-vllm", read_vllm), ("medusa-tgi", read_tgi)])
def test_round_trip_gives_identical_logits(head_dir, tmp_path, tiny_model, fmt, reader):
    out, report = export_head(head_dir, fmt, tmp_path / fmt, dtype="float32")
    assert report["outputs_identical"] and report["max_abs_diff_vs_trained_float32"] == 0.0
    trained = MedusaHead.from_pretrained(head_dir, tiny_model, "tiny").eval()
    reloaded = load_export(out, tiny_model, "tiny")
    ops = head_kind("medusa").check
    assert torch.equal(ops.outputs(trained)["logits"], ops.outputs(reloaded)["logits"])
    cfg, tensors = reader(out)
    assert cfg["num_heads"] == HEADS and len(tensors) == len(trained.state_dict())


def test_card_serves_with_num_heads_tokens(head_dir, tmp_path):
    out, _ = export_head(head_dir, "medusa-vllm", tmp_path / "v", num_speculative_tokens=7)
    card = (out / "README.md").read_text()
    assert f'"num_speculative_tokens": {HEADS}' in card and "- medusa" in card
    tgi = export_head(head_dir, "medusa-tgi", tmp_path / "t")[0]
    assert f"--speculate {HEADS}" in (tgi / "README.md").read_text()


def test_tgi_reader_refuses_nonzero_padding_bias(tiny_model, tiny_llama_dir, tmp_path):
    head = make_medusa_head(tiny_model, str(tiny_llama_dir), tmp_path / "h", fc_bias=False)
    out, _ = export_head(head, "medusa-tgi", tmp_path / "t")
    tensors = load_file(out / "medusa_lm_head.safetensors")
    tensors["0.0.linear.bias"] = tensors["0.0.linear.bias"] + 1
    save_file(tensors, out / "medusa_lm_head.safetensors")
    with pytest.raises(UserError, match="0.0.linear.bias is not zero"):
        read_tgi(out)


def test_vllm_reader_refuses_a_misnamed_tensor(tiny_model, tiny_llama_dir, tmp_path):
    """vLLM itself would drop `medusa_head.0...` silently and serve an untrained block."""
    head = make_medusa_head(tiny_model, str(tiny_llama_dir), tmp_path / "h", fc_bias=True)
    out, _ = export_head(head, "medusa-vllm", tmp_path / "v")
    tensors = load_file(out / "model.safetensors")
    tensors["medusa_head.0.layers.0.weight"] = tensors.pop("blocks.0.layers.0.weight")
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(
        UserError, match="unknown tensors.*medusa_head.0.*missing.*blocks.0.layers.0"
    ):
        read_vllm(out)


def test_medusa2_head_is_refused(tiny_model, tiny_llama_dir, tmp_path):
    head = make_medusa_head(tiny_model, str(tiny_llama_dir), tmp_path / "h", fc_bias=True)
    cfg, spec, tensors = load_head(head, "medusa")
    save_head(tmp_path / "joint", "medusa", {**cfg, "target_update": "lora"}, spec, tensors)
    with pytest.raises(UserError, match="Medusa-2 head"):
        export_head(tmp_path / "joint", "medusa-vllm", tmp_path / "x")


def test_eagle3_format_refuses_a_medusa_head(head_dir, tmp_path):
    with pytest.raises(UserError, match="a 'medusa' head, expected 'eagle3'"):
        export_head(head_dir, "eagle3", tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_default_formats_follow_the_head_kind(head_dir):
    assert formats_for(head_dir, None) == ["medusa-vllm", "medusa-tgi"]
    assert formats_for(head_dir, ["medusa-tgi"]) == ["medusa-tgi"]
