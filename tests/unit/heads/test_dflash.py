"""DFlash heads: the config's refusals, the folder format, and vLLM 0.32's two export layouts
(key names, the one-lower `target_layer_ids`, explicit head_dim and rope, the pinned token count),
read back by our strict readers and self-checked. Real heads on the tiny llama target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conf.compose import compose_root
from conf.errors import UserError
from heads.dflash.export import read_native, read_speculators
from heads.dflash.model import DFlashHead, captured_layers, default_mask_token_id
from heads.export.write import detect_format, export_head, load_export
from heads.kinds import head_kind
from tests.support.heads import random_dflash_head
from tests.support.runs import user_error_line
from tests.support.targets import tiny_family_target

AUX = [2, 4, 6]  # of the 8-layer tiny target: vLLM's target_layer_ids [1, 3, 5]
# What vLLM 0.32 `qwen3_dflash.py` loads (each prefixed `model.`; q/k/v and gate/up stacked).
LAYER = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]
KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{k}" for i in (0, 1) for k in LAYER}


@pytest.fixture(scope="module")
def saved(tiny_model, tiny_llama_dir, tmp_path_factory):
    head = random_dflash_head(tiny_model, str(tiny_llama_dir), aux_layer_ids=AUX, block_size=5, causal=True)
    return head.save_pretrained(tmp_path_factory.mktemp("dflash") / "head")


@pytest.mark.parametrize(
    "override, field",
    [("head.block_size=1", "head.block_size=1"), ("head.aux_layer_ids=[2,2]", "head.aux_layer_ids"),
     ("head.position_weights=linear", "head.position_weights"), ("head.loss_decay=0", "head.loss_decay")],
)
def test_bad_settings_are_one_line_naming_the_override(override, field):
    line = user_error_line(lambda: compose_root(["+head=dflash", override]))
    assert field in line


def test_defaults_share_eagle3s_captured_layers():
    cfg = compose_root(["+head=dflash"]).head
    eagle = compose_root(["+head=eagle3"]).head
    assert captured_layers(cfg, 30) == head_kind("eagle3").captured_layers(eagle, 30) == ((2, 15, 27), 30)
    assert captured_layers(compose_root(["+head=dflash", "head.aux_layer_ids=[1,3,5,7]"]).head, 8)[0] == (
        1, 3, 5, 7)


def test_default_mask_token_is_one_no_chat_text_holds(smol_tokenizer):
    # SmolLM2: no mask token, every id a token: its unk, <|endoftext|> (ChatML rows use im_start/im_end)
    assert default_mask_token_id(smol_tokenizer, len(smol_tokenizer)) == smol_tokenizer.unk_token_id == 0
    assert default_mask_token_id(smol_tokenizer, len(smol_tokenizer) + 64) == len(smol_tokenizer)


def test_saved_head_reloads_the_same_and_holds_none_of_the_targets_weights(tiny_model, saved, tiny_llama_dir):
    tensors = load_file(saved / "model.safetensors")
    assert set(tensors) == KEYS  # no embed_tokens / lm_head: the target's are shared
    again = DFlashHead.from_pretrained(saved, tiny_model, str(tiny_llama_dir))
    assert again.block_size == 5 and again.causal and again.aux_layer_ids == AUX
    assert torch.equal(again.lm_head.weight, tiny_model.get_output_embeddings().weight)
    for k, v in tensors.items():
        assert torch.equal(again.state_dict()[k], v), k


def test_a_head_refuses_another_target(saved):
    other = tiny_family_target("qwen2", vocab=300)
    line = user_error_line(lambda: DFlashHead.from_pretrained(saved, other, "other"))
    assert "head was trained for target" in line and "vocab_size" in line


def test_native_export_is_vllms_layout_with_layer_ids_one_lower(tiny_model, saved, tmp_path):
    out, report = export_head(saved, "dflash", tmp_path / "native", target_model=tiny_model, dtype="float32")
    assert report["outputs_identical"] and report["max_abs_diff_vs_trained_float32"] == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["head_dim"] == 16 and cfg["target_hidden_size"] == 64 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 3, 5], "causal": True}
    assert cfg["rope_parameters"]["rope_theta"] == tiny_model.config.rope_parameters["rope_theta"]
    assert "draft_vocab_size" not in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg
    assert set(load_file(out / "model.safetensors")) == KEYS
    assert detect_format(out) == "dflash"
    card = (out / "README.md").read_text()
    assert '"method": "dflash"' in card and '"num_speculative_tokens": 4' in card  # block 5 -> 4 drafts


def test_speculators_export_counts_layers_as_eagle3_and_pins_the_tokens(tiny_model, saved, tmp_path):
    out, _ = export_head(saved, "dflash-speculators", tmp_path / "spec", target_model=tiny_model,
                         num_speculative_tokens=3)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == AUX
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # not the 3 asked
    assert cfg["sliding_window_non_causal"] is False  # vLLM: causal = not this
    assert cfg["transformer_layer_config"]["head_dim"] == 16
    assert detect_format(out) == "dflash-speculators"
    read_cfg, tensors = read_speculators(out)
    assert read_cfg["aux_layer_ids"] == AUX and read_cfg["causal"] and set(tensors) == KEYS


def test_exports_load_back_as_the_trained_head(tiny_model, saved, tmp_path, tiny_llama_dir):
    trained = DFlashHead.from_pretrained(saved, tiny_model, str(tiny_llama_dir))
    check = head_kind("dflash").check
    for fmt in ("dflash", "dflash-speculators"):
        out, _ = export_head(saved, fmt, tmp_path / fmt, target_model=tiny_model, dtype="float32")
        back = load_export(out, tiny_model, str(tiny_llama_dir))
        for k, v in check.outputs(trained).items():
            assert torch.equal(check.outputs(back)[k], v), (fmt, k)


def test_a_renamed_or_missing_tensor_fails_the_read(tiny_model, saved, tmp_path):
    from safetensors.torch import save_file

    out, _ = export_head(saved, "dflash", tmp_path / "native", target_model=tiny_model)
    tensors = load_file(out / "model.safetensors")
    tensors["layers.0.self_attn.k_norm_weight"] = tensors.pop("layers.0.self_attn.k_norm.weight")
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(UserError, match="unknown tensors.*k_norm_weight.*missing.*k_norm.weight"):
        read_native(out)
