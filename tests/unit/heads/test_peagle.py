"""P-EAGLE heads: the config's refusals, the mask token's default, save/load, refusing another
target, and the two vLLM layouts (EAGLE-3's plus `mask_hidden` and the mask token), read back
strictly, self-checked, told apart from EAGLE-3 folders, and carded with `parallel_drafting`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conf.errors import UserError
from conf.kinds import PEagleConfig
from heads.export.write import detect_format, export_head, load_export
from heads.kinds import head_kind
from heads.peagle.model import PEagleHead, load_for_decoding
from tests.support.decode import chaotic_target
from tests.support.heads import make_eagle3_head

PEAGLE = head_kind("peagle")
CFG = PEagleConfig(parallel_tokens=4)


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_eagle3_head(tiny_llama_dir, tmp_path_factory.mktemp("peagle") / "head", cfg=CFG,
                            head_class=PEagleHead)


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"parallel_tokens": 1}, "head.parallel_tokens=1: expected an integer >= 2"),
        ({"ttt_length": 3}, "head.ttt_length=3: expected null: a peagle head drafts its slots"),
        ({"anchor_fraction": 0.0}, "head.anchor_fraction=0.0: expected a value in (0, 1]"),
        ({"mask_token_id": -1}, "head.mask_token_id=-1: expected null or a token id >= 0"),
    ],
)
def test_config_refuses_in_one_line(fields, says):
    with pytest.raises(UserError) as err:
        PEagleConfig(**fields)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_mask_token_defaults_to_pad_and_refuses_an_id_outside_the_vocabulary(tiny_model):
    v = tiny_model.config.vocab_size
    d2t, t2d = torch.zeros(v, dtype=torch.long), torch.ones(v, dtype=torch.bool)
    head = PEagleHead.from_target(tiny_model, "tiny", CFG, d2t, t2d)
    assert head.mask_token_id == tiny_model.config.pad_token_id is not None
    with pytest.raises(UserError, match=f"head.mask_token_id={v}: expected an id below"):
        PEagleHead.from_target(tiny_model, "tiny", PEagleConfig(mask_token_id=v), d2t, t2d)


def test_save_load_round_trip_and_refusal_of_another_target(head_dir, tiny_model):
    head, verifier = load_for_decoding(head_dir, tiny_model, "tiny")
    saved = load_file(head_dir / "model.safetensors")
    assert verifier is tiny_model and head.kind == "peagle" and head.parallel_tokens == 4
    assert saved["mask_hidden"].shape == (1, 3 * tiny_model.config.hidden_size)
    assert all(torch.equal(head.state_dict()[k], v) for k, v in saved.items())
    with pytest.raises(UserError, match="head was trained for target"):
        load_for_decoding(head_dir, chaotic_target(), "other")
    with pytest.raises(UserError, match="peagle"):  # an EAGLE-3 loader refuses the other kind
        head_kind("eagle3").load_for_decoding(head_dir, tiny_model, "tiny")


@pytest.mark.parametrize("fmt, layer", [("peagle", "midlayer."), ("peagle-speculators", "layers.0.")])
def test_export_layout_reads_back_and_serves_in_parallel(head_dir, tiny_model, tmp_path, fmt, layer):
    out, report = export_head(head_dir, fmt, tmp_path / fmt, tiny_model, dtype="float32")
    assert report["outputs_identical"] and detect_format(out) == fmt
    top = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    head = PEagleHead.from_pretrained(head_dir, tiny_model, "tiny")
    assert torch.equal(tensors["mask_hidden"], head.mask_hidden.detach())
    assert any(k.startswith(layer) for k in tensors) and "embed_tokens.weight" not in tensors
    if fmt == "peagle":
        assert top["architectures"] == ["LlamaForCausalLMEagle3"]
        assert top["pard_token"] == head.mask_token_id and top["parallel_tokens"] == 4
        assert "speculators_model_type" not in top and "mask_token_id" not in top
    else:
        assert top["speculators_model_type"] == "peagle" and top["architectures"] == ["PEagleSpeculator"]
        assert top["mask_token_id"] == head.mask_token_id
        assert top["speculators_config"]["algorithm"] == "peagle"
        assert top["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    back = load_export(out, tiny_model, "tiny")
    assert isinstance(back, PEagleHead) and back.mask_token_id == head.mask_token_id
    torch.testing.assert_close(back.mask_state(), head.mask_state())
    card = (out / "README.md").read_text()
    spec = {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 4,
            "parallel_drafting": True}
    assert f"--speculative-config '{json.dumps(spec)}'" in card
    assert PEAGLE.speculative_keys(fmt) == {"method": "eagle3", "parallel_drafting": True}


def test_reader_refuses_a_folder_without_mask_hidden_or_mask_token(head_dir, tiny_model, tmp_path):
    out, _ = export_head(head_dir, "peagle", tmp_path / "p", tiny_model)
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "mask_hidden"}, weights)
    with pytest.raises(UserError, match=r"missing \['mask_hidden'\]"):
        PEAGLE.formats["peagle"].read(out)
    save_file(tensors, weights)
    top = json.loads((out / "config.json").read_text())
    del top["pard_token"]
    (out / "config.json").write_text(json.dumps(top))
    assert detect_format(out) == "eagle3"  # without its mask token it is an EAGLE-3 folder...
    with pytest.raises(UserError, match="pard_token=None"):  # ...which P-EAGLE's reader refuses
        PEAGLE.formats["peagle"].read(out)


def test_eagle3_folders_are_not_taken_for_peagle_ones(tiny_llama_dir, tiny_model, tmp_path):
    head = make_eagle3_head(tiny_llama_dir, tmp_path / "head")
    for fmt in ("eagle3", "speculators"):
        out, _ = export_head(head, fmt, tmp_path / fmt, tiny_model)
        assert detect_format(out) == fmt
    assert head_kind("eagle3").speculative_keys("eagle3") == {"method": "eagle3"}
