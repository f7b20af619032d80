"""EAGLE-3 as llama.cpp's GGUF draft (`export.formats=gguf`): keys, tensors, read-back, refusals, card.

The GGUF is read back here with the `gguf` package itself (what llama.cpp's loader sees), and held
to names, shapes, layouts and keys written down from llama.cpp's source (llama-cpp-python 0.3.36's
vendored `src/models/eagle3.cpp`, `src/llama-arch.cpp`, `conversion/llama.py`), not to our
writer's tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from conf.compose import compose_root
from conf.errors import UserError
from conf.kinds import Eagle3Config
from heads.eagle3 import llama_cpp
from heads.eagle3.model import Eagle3Head
from heads.export.card import CardFacts
from heads.export.core import read_folder
from heads.export.gguf_file import Value, read_gguf, write_gguf
from heads.export.write import detect_format, export_head, formats_for, load_export
from heads.folder import load_head
from heads.formats import load_for_decoding
from heads.kinds import check_export_formats, head_kind
from tests.support.heads import ORIGINAL_LAYOUT, gguf_tensor, make_eagle3_head
from tests.support.targets import LLAMA3_ROPE, build_tiny_target

EAGLE3 = head_kind("eagle3")
# llama.cpp's names for our tensors (`src/models/eagle3.cpp` load_arch_tensors, `conversion/llama.py`).
GGUF_NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGML = {"bfloat16": GGMLQuantizationType.BF16, "float16": GGMLQuantizationType.F16,
        "float32": GGMLQuantizationType.F32}
# llama.cpp's flags only: norm_before_fc and norm_before_residual (eagle3.cpp load_arch_hparams).
LLAMA_CPP_LAYOUT = Eagle3Config(norm_before_fc=True, norm_before_residual=True, norm_output=False)


def permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """`conversion/llama.py` LlamaModel.permute, verbatim: HF q/k rows to llama.cpp's rope order."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """norm_before_fc and norm_before_residual on (both written), a 512-id draft vocabulary."""
    return make_eagle3_head(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "head", cfg=LLAMA_CPP_LAYOUT)


@pytest.mark.parametrize("dtype", list(GGML))
def test_gguf_holds_the_head_as_llama_cpp_loads_it(head_dir, tmp_path, dtype):
    out, report = export_head(head_dir, "gguf", tmp_path / "g", dtype=dtype)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "draft.gguf"]
    cfg, _, trained = load_head(head_dir, "eagle3")
    reader = GGUFReader(out / "draft.gguf")
    got = {t.name: t for t in reader.tensors}
    assert set(got) == set(GGUF_NAMES.values()) | {"d2t"}  # no t2d, no token_embd (the target's)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for ours, name in GGUF_NAMES.items():
        want = trained[ours].to(getattr(torch, dtype))
        if name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
            rows = permute(want.float().numpy(), nh, nh if "attn_q" in name else nkv)
            want = torch.from_numpy(rows).to(want.dtype)
        is_norm = want.dim() == 1  # 1-D tensors in F32, as the converter writes them
        assert got[name].tensor_type == (GGMLQuantizationType.F32 if is_norm else GGML[dtype]), name
        assert list(got[name].shape) == list(reversed(want.shape)), name  # GGUF's ne order
        assert torch.equal(gguf_tensor(got[name]), want.float() if is_norm else want), name
    d2t = got["d2t"]
    assert d2t.tensor_type == GGMLQuantizationType.I64
    assert torch.equal(gguf_tensor(d2t), trained["d2t"] + torch.arange(len(trained["d2t"])))  # absolute ids
    assert report["tensors"] == len(trained)  # read back through the layout's strict reader


def test_q8_0_gguf_round_trips_within_one_quantization_step(head_dir, tmp_path, tiny_model, tiny_llama_dir):
    """export.gguf_type=q8_0: matrices as ggml's block_q8_0 (per 32 values of a row: one f16
    scale d, 32 int8 q; value q * d), read here byte by byte, each weight within one step
    max|w| / 127 of its block's trained one; norms F32, d2t I64; our readers read it back."""
    out, report = export_head(head_dir, "gguf", tmp_path / "q", target_model=tiny_model, gguf_type="q8_0")
    bf16, _ = export_head(head_dir, "gguf", tmp_path / "b")
    assert 0 < report["q8_0_max_error_in_steps"] <= 1 and report["outputs_identical"]
    assert (out / "draft.gguf").stat().st_size < 0.7 * (bf16 / "draft.gguf").stat().st_size
    _, _, trained = load_head(head_dir, "eagle3")
    reader = GGUFReader(out / "draft.gguf")
    assert reader.fields["general.file_type"].contents() == 7  # LlamaFileType.MOSTLY_Q8_0
    got = {t.name: t for t in reader.tensors}
    for ours, name in GGUF_NAMES.items():
        kind = got[name].tensor_type
        assert kind == (GGMLQuantizationType.F32 if trained[ours].dim() == 1 else GGMLQuantizationType.Q8_0)
    w = trained["fc.weight"].float().reshape(-1, 32)  # fc's rows are not permuted
    raw = np.array(got["fc.weight"].data).reshape(-1, 34)
    scale = torch.from_numpy(raw[:, :2].copy().view(np.float16).astype(np.float32))
    q = torch.from_numpy(raw[:, 2:].copy().view(np.int8).astype(np.float32))
    step = w.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(scale, step, rtol=1e-3)  # d = max|w| / 127, in f16
    assert ((q * scale - w).abs() <= step).all() and q.abs().max() == 127
    # Both our readers dequantize it: the layout's own (the self-check's) and evaluation's.
    _, tensors = llama_cpp.read_export(out)
    assert torch.equal(tensors["fc.weight"], (q * scale).reshape(trained["fc.weight"].shape))
    head = load_for_decoding(out, tiny_model, str(tiny_llama_dir))[1]
    assert torch.equal(head.fc.weight.float(), tensors["fc.weight"])


def test_gguf_keys_are_the_ones_llama_cpp_reads(head_dir, tmp_path, tiny_llama_dir):
    out, _ = export_head(head_dir, "gguf", tmp_path / "g")
    cfg, spec, _ = load_head(head_dir, "eagle3")
    fields = GGUFReader(out / "draft.gguf").fields
    values = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    assert values["general.architecture"] == "eagle3"
    # llama.cpp captures the input of target layer k = HF hidden_states[k]: our ids, unshifted.
    assert values["eagle3.target_layers"] == sorted(cfg["aux_layer_ids"]) == [2, 4, 5]
    assert fields["eagle3.target_layers"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert values["eagle3.target_hidden_size"] == spec.hidden_size == 64
    assert values["eagle3.norm_before_fc"] is True and values["eagle3.norm_before_residual"] is True
    assert fields["eagle3.norm_before_fc"].types == [GGUFValueType.BOOL]
    assert {k: values[f"eagle3.{k}"] for k in (
        "block_count", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "rope.dimension_count", "vocab_size",
    )} == {"block_count": 1, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
           "attention.head_count_kv": 2, "attention.key_length": 16, "rope.dimension_count": 16,
           "vocab_size": spec.vocab_size}
    assert values["eagle3.rope.freq_base"] == cfg["rope_parameters"]["rope_theta"]
    assert values["eagle3.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"])
    assert values["tokenizer.ggml.model"] == "none"  # llama.cpp sizes the vocabulary by vocab_size
    assert values["general.file_type"] == 32  # LlamaFileType.MOSTLY_BF16 (the default export.dtype)


def test_gguf_reads_back_as_the_trained_head(head_dir, tmp_path, tiny_model, tiny_llama_dir):
    """float32: the exported head's outputs are the trained head's, bit for bit, through our
    export reader and through the reader evaluation uses (`heads.formats`)."""
    out, report = export_head(head_dir, "gguf", tmp_path / "g", target_model=tiny_model, dtype="float32")
    assert report["max_abs_diff_vs_trained_float32"] == 0.0
    assert detect_format(out) == "gguf"
    own = load_head(head_dir, "eagle3")
    trained = EAGLE3.check.outputs(Eagle3Head.from_pretrained(head_dir, tiny_model, "tiny").eval())
    for head in (load_export(out, tiny_model, str(tiny_llama_dir)),
                 load_for_decoding(out, tiny_model, str(tiny_llama_dir))[1]):
        got = EAGLE3.check.outputs(head.eval())
        assert all(torch.equal(trained[k], got[k]) for k in trained)
        assert torch.equal(head.t2d, own[2]["t2d"])
    assert set(read_folder(out, "draft.gguf")[1]) == set(GGUF_NAMES.values()) | {"d2t"}


def test_a_full_draft_vocabulary_writes_no_d2t(tiny_llama_dir, tiny_model, tmp_path):
    """llama.cpp reads a draft without d2t as drafting over the target's vocabulary."""
    vocab = tiny_model.config.vocab_size
    head = make_eagle3_head(tiny_llama_dir, tmp_path / "head", cfg=LLAMA_CPP_LAYOUT, draft_vocab=vocab)
    out, _ = export_head(head, "gguf", tmp_path / "g", dtype="float32")
    names = {t.name for t in GGUFReader(out / "draft.gguf").tensors}
    assert "d2t" not in names and "output.weight" in names


def test_gguf_is_a_default_format_of_the_heads_llama_cpp_expresses(head_dir, tiny_llama_dir, tmp_path):
    """`export.formats=null` (the main job's) writes gguf for a head llama.cpp's graph expresses,
    and skips it for a default head (norm_output on), which it would serve as another head."""
    assert formats_for(head_dir, None) == ["eagle3", "speculators", "gguf"]
    default = make_eagle3_head(tiny_llama_dir, tmp_path / "default", cfg=Eagle3Config())
    assert formats_for(default, None) == ["eagle3", "speculators"]
    assert formats_for(default, ["gguf"]) == ["gguf"]  # asked for: refused by the writer, below


@pytest.mark.parametrize("override,message", [
    ("head.norm_output=true", "head.norm_output=true, which llama.cpp"),
    ("head.fc_norm=true", "head.fc_norm=true, which llama.cpp"),
    ("head.sliding_window=64", "head.sliding_window=64: llama.cpp's EAGLE-3 draft attends over every"),
])
def test_gguf_asked_for_a_head_it_cannot_express_is_refused_when_the_command_starts(override, message):
    cfg = compose_root(["+head=eagle3", "head.norm_output=false", override, "export.formats=[gguf]"])
    with pytest.raises(UserError, match=f"^export.formats=gguf: {message}") as err:
        check_export_formats(cfg)
    assert "\n" not in str(err.value)
    check_export_formats(compose_root(["+head=eagle3", "head.norm_output=false", "export.formats=[gguf]"]))


def _cfg(head_dir: Path, **edit) -> dict:
    return load_head(head_dir, "eagle3")[0] | edit


REFUSED = {
    "norm_output": ({"norm_output": True}, "head.norm_output=true"),
    "fc_norm": ({"norm_before_fc": False, "fc_norm": True}, "head.fc_norm=true"),
    "window": ({"sliding_window": 32, "layer_types": ["sliding_attention"]}, "head.sliding_window=32"),
    "last-layer": ({"aux_layer_ids": [2, 4, 8]}, r"head.aux_layer_ids=\[2, 4, 8\].*ids 0..7"),
    "rope": ({"rope_parameters": LLAMA3_ROPE}, "rope_parameters"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_llama_cpp_cannot_express_is_one_line(head_dir, case):
    edit, message = REFUSED[case]
    with pytest.raises(UserError, match=message) as err:
        llama_cpp.check_expressible(_cfg(head_dir, **edit), 8)
    assert "\n" not in str(err.value) and str(err.value).startswith("export.formats=gguf: ")


def test_a_default_head_is_refused_before_anything_is_written(tiny_llama_dir, tmp_path):
    head = make_eagle3_head(tiny_llama_dir, tmp_path / "head", cfg=Eagle3Config())
    with pytest.raises(UserError, match="head.norm_output=true"):
        export_head(head, "gguf", tmp_path / "g")
    assert not (tmp_path / "g").exists() and not list(tmp_path.glob(".g.tmp-*"))


def test_a_llama3_rope_target_is_refused(smol_tokenizer, tmp_path):
    target = build_tiny_target(tmp_path / "t", "llama", smol_tokenizer, rope_parameters=LLAMA3_ROPE)
    head = make_eagle3_head(target, tmp_path / "head", cfg=ORIGINAL_LAYOUT)
    with pytest.raises(UserError, match="rope_parameters"):
        export_head(head, "gguf", tmp_path / "g")


def _rewrite(path: Path, edit) -> None:
    meta, tensors = read_gguf(path, "test")
    meta.pop("general.architecture")
    edit(meta, tensors)
    write_gguf(path, "eagle3", meta, tensors)


TAMPERED = {
    # llama.cpp would scale positions the head was not trained with.
    "extra-key": (lambda m, t: m.update({"eagle3.rope.scaling.factor": Value(GGUFValueType.FLOAT32, 8.0)}),
                  r"unknown keys \['eagle3.rope.scaling.factor'\]"),
    # llama.cpp reads a missing flag as false.
    "missing-flag": (lambda m, t: m.pop("eagle3.norm_before_residual"),
                     r"missing \['eagle3.norm_before_residual'\]"),
    # Without its own output.weight llama.cpp drafts with the target's lm_head.
    "no-lm-head": (lambda m, t: t.pop("output.weight"), r"missing \['output.weight'\]"),
    "d2t-repeats": (lambda m, t: t["d2t"].__setitem__(1, t["d2t"][0]), "distinct"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_the_reader_refuses_what_llama_cpp_would_serve_differently(head_dir, tmp_path, case):
    out, _ = export_head(head_dir, "gguf", tmp_path / "g")
    edit, message = TAMPERED[case]
    _rewrite(out / "draft.gguf", edit)
    with pytest.raises(UserError, match=message):
        llama_cpp.read_export(out)


def test_a_cut_off_gguf_is_one_line(head_dir, tmp_path):
    out, _ = export_head(head_dir, "gguf", tmp_path / "g")
    data = (out / "draft.gguf").read_bytes()
    (out / "draft.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="not a readable GGUF file"):
        llama_cpp.read_export(out)


def test_card_serves_it_with_llama_server(head_dir, tmp_path):
    out, _ = export_head(head_dir, "gguf", tmp_path / "g")
    card = (out / "README.md").read_text()
    assert f"-md {out.resolve() / 'draft.gguf'} --spec-type draft-eagle3 --spec-draft-n-max 3" in card
    assert "llama-server -m target.gguf" in card and "library_name: gguf" in card
    assert "| llama.cpp (input of layer k = draftsmith's `hidden_states[k]`) | [2, 4, 5] |" in card
    assert json.loads((out / "config.json").read_text()) == llama_cpp.MARKER
    hub = CardFacts(fmt="gguf", kind="eagle3", target_name="/m/t.gguf", location="me/draft",
                    num_speculative_tokens=4, license="apache-2.0")
    (line,) = [x for x in EAGLE3.serve_lines(hub) if x.startswith("llama-server")]
    assert line == ("llama-server -m /m/t.gguf -hfd me/draft --spec-type draft-eagle3 --spec-draft-n-max 4 "
                    "--spec-draft-p-min 0")  # llama.cpp's own default (0.75) is not what was measured


def sweep(best: bool) -> dict:
    """An eval.json whose settings sweep (`trainer.evaluate.settings`) found k=2, p_min 0.5 fastest,
    paying (`best`) or not."""
    row = {"k": 2, "p_min": 0.5, "drafted_per_step": 1.2, "mean_acceptance_length": 1.6,
           "speedup_vs_greedy": 1.3 if best else 0.8}
    return {"settings": {"mode": "chain", "num_speculative_tokens": 3, "draft_p_min": 0.0},
            "overall": {"prompts": 2}, "tasks": {}, "lossless": True,
            "draft_settings": {"rows": [row], "fastest": row, "best": row if best else None}}


@pytest.mark.parametrize("pays", [True, False], ids=["best-pays", "none-pays"])
def test_card_serves_the_evaluators_best_setting_or_says_none_pays(head_dir, tmp_path, pays):
    (tmp_path / "eval.json").write_text(json.dumps(sweep(pays)))
    out, _ = export_head(head_dir, "gguf", tmp_path / "g", eval_json=tmp_path / "eval.json")
    card = (out / "README.md").read_text()
    if pays:
        assert "--spec-draft-n-max 2 --spec-draft-p-min 0.5" in card
        assert "2 speculative tokens, p_min 0.5 (predicted mean acceptance length 1.600, 1.300x" in card
    else:  # the configured k and p_min, and no recommendation of a slower decode
        assert "--spec-draft-n-max 3 --spec-draft-p-min 0" in card
        assert "**No drafting setting was faster than plain greedy decoding**" in card
        assert "0.800x" in card and "serve the target alone" in card
