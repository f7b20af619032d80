"""DFlash and DSpark as llama.cpp's GGUF drafts (`dflash-gguf`, `dspark-gguf`): keys, tensors,
read-back, refusals, card.

The GGUF is read here with the `gguf` package itself (what llama.cpp's loader sees) and held to
names, shapes and keys written down from llama.cpp's source (llama-cpp-python 0.3.36's vendored
`src/models/dflash.cpp`, `common/speculative.cpp`, `conversion/qwen.py`), not to our writer's
tables. Real heads on the tiny llama target (hidden 64, 4 heads of 16, 2 kv heads, ffn 128). Each GGUF
holds the target's 49,152 token pieces, a second or two to write or parse, and the refusals
rewrite one each: 30-40 s, in e2e since #62 (EAGLE-3's GGUF stays in tests/unit/heads/).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from conf.compose import compose_root
from conf.errors import UserError
from heads.dflash.export import GGUF as DFLASH_GGUF
from heads.export.gguf_file import Value, read_gguf, write_gguf
from heads.export.write import default_formats, detect_format, export_head, formats_for, load_export
from heads.folder import load_head
from heads.formats import load_for_decoding
from heads.kinds import check_export_formats, head_kind
from tests.support.heads import gguf_tensor, random_dflash_head, random_dspark_head

AUX, BLOCK, R = [2, 4, 6], 5, 8
H, HD, NH, NKV, FF = 64, 16, 4, 2, 128
# llama.cpp's tensors of a 2-layer DFlash draft, in torch's order (ggml's ne reversed), and ours.
LAYER = {
    "attn_norm.weight": ("input_layernorm.weight", (H,)),
    "attn_q.weight": ("self_attn.q_proj.weight", (NH * HD, H)),
    "attn_k.weight": ("self_attn.k_proj.weight", (NKV * HD, H)),
    "attn_v.weight": ("self_attn.v_proj.weight", (NKV * HD, H)),
    "attn_output.weight": ("self_attn.o_proj.weight", (H, NH * HD)),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", (HD,)),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", (HD,)),
    "ffn_norm.weight": ("post_attention_layernorm.weight", (H,)),
    "ffn_gate.weight": ("mlp.gate_proj.weight", (FF, H)),
    "ffn_up.weight": ("mlp.up_proj.weight", (FF, H)),
    "ffn_down.weight": ("mlp.down_proj.weight", (H, FF)),
}
DFLASH_NAMES = {
    "fc.weight": ("fc.weight", (H, 3 * H)),
    "enc.output_norm.weight": ("hidden_norm.weight", (H,)),
    "output_norm.weight": ("norm.weight", (H,)),
    **{f"blk.{i}.{k}": (f"layers.{i}.{ours}", shape) for i in range(2) for k, (ours, shape) in LAYER.items()},
}


def dspark_names(vocab: int) -> dict:
    return DFLASH_NAMES | {
        "markov_w1.weight": ("markov_head.markov_w1.weight", (vocab, R)),
        "markov_w2.weight": ("markov_head.markov_w2.weight", (vocab, R)),
        "conf_proj.weight": ("confidence_head.proj.weight", (1, H + R)),
        "conf_proj.bias": ("confidence_head.proj.bias", (1,)),
    }


GGML = {"bfloat16": GGMLQuantizationType.BF16, "float32": GGMLQuantizationType.F32}


@pytest.fixture(scope="module")
def heads(tiny_model, tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """A saved 2-layer DFlash head and a DSpark one (block 5, aux [2, 4, 6], mask token 3)."""
    root, name = tmp_path_factory.mktemp("gguf-blocks"), str(tiny_llama_dir)
    return {
        "dflash": random_dflash_head(tiny_model, name, aux_layer_ids=AUX, block_size=BLOCK).save_pretrained(
            root / "dflash"),
        "dspark": random_dspark_head(tiny_model, name, aux_layer_ids=AUX, block_size=BLOCK).save_pretrained(
            root / "dspark"),
    }


@pytest.fixture(scope="module")
def exported(heads, tiny_model, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, dict]]:
    """Each head exported once per dtype, self-checked against the target (the tests read these;
    one that edits a file edits a copy). 7 tokens asked: a block drafter drafts its block - 1."""
    root = tmp_path_factory.mktemp("gguf-exports")
    return {(kind, dtype): export_head(heads[kind], f"{kind}-gguf", root / f"{kind}-{dtype}", tiny_model,
                                       dtype=dtype, num_speculative_tokens=7)
            for kind in heads for dtype in GGML}


@pytest.fixture(scope="module")
def readers(exported) -> dict[tuple[str, str], GGUFReader]:
    """The `gguf` package's reader of each exported file, opened once: a file holds the target's
    49,152 token pieces, about a second to parse."""
    return {key: GGUFReader(out / "draft.gguf") for key, (out, _) in exported.items()}


@pytest.mark.parametrize("dtype", list(GGML))
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_gguf_holds_the_head_as_llama_cpp_loads_it(heads, exported, readers, tiny_model, kind, dtype):
    out, report = exported[kind, dtype]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "draft.gguf"]
    _, _, trained = load_head(heads[kind], kind)
    names = DFLASH_NAMES if kind == "dflash" else dspark_names(tiny_model.config.vocab_size)
    got = {t.name: t for t in readers[kind, dtype].tensors}
    assert set(got) == set(names)  # no token_embd, no output: the target's are shared
    for name, (ours, shape) in names.items():
        want = trained[ours].to(getattr(torch, dtype))
        one_d = want.dim() == 1  # 1-D tensors in F32, as the converter writes them
        assert got[name].tensor_type == (GGMLQuantizationType.F32 if one_d else GGML[dtype]), name
        assert tuple(reversed(got[name].shape.tolist())) == shape == tuple(want.shape), name
        assert torch.equal(gguf_tensor(got[name]).reshape(shape), want.float() if one_d else want), name
    assert report["tensors"] == len(trained)  # read back through the layout's strict reader


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_q8_0_gguf_self_checks_within_one_quantization_step(heads, tiny_model, tmp_path, kind):
    """export.gguf_type=q8_0 on the block drafters' layouts: matrices of whole 32-value rows as
    Q8_0, the rest (DSpark's rank-8 Markov embedding) F32, read back within one step."""
    out, report = export_head(heads[kind], f"{kind}-gguf", tmp_path / kind, tiny_model, gguf_type="q8_0")
    assert 0 < report["q8_0_max_error_in_steps"] <= 1 and report["outputs_identical"]
    types = {t.name: t.tensor_type for t in GGUFReader(out / "draft.gguf").tensors}
    assert types["fc.weight"] == GGMLQuantizationType.Q8_0
    if kind == "dspark":  # rows of R = 8 values: no whole block
        assert types["markov_w1.weight"] == GGMLQuantizationType.F32


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_gguf_keys_are_the_ones_llama_cpp_reads(heads, readers, tiny_model, kind):
    cfg = load_head(heads[kind], kind)[0]
    fields = readers[kind, "bfloat16"].fields
    values = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    assert values["general.architecture"] == "dflash"  # DSpark too: its markov_w1 tells them apart
    assert {k: values[f"dflash.{k}"] for k in (
        "block_count", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
        "block_size",
    )} == {"block_count": 2, "embedding_length": H, "feed_forward_length": FF, "attention.head_count": NH,
           "attention.head_count_kv": NKV, "attention.key_length": HD, "attention.value_length": HD,
           "rope.dimension_count": HD, "block_size": BLOCK}
    # Layer inputs of target layer k = HF hidden_states[k]: our ids as they are (the converter
    # writes vLLM's target_layer_ids + 1).
    assert values["dflash.target_layers"] == AUX
    assert fields["dflash.target_layers"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert values["dflash.attention.causal"] is False  # the block attends to itself whole
    assert fields["dflash.block_size"].types == [GGUFValueType.UINT32]
    assert values["dflash.rope.freq_base"] == cfg["rope_parameters"]["rope_theta"]
    assert values["dflash.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"])
    # A vocabulary llama.cpp reads a mask token from: as many pieces as the target has ids.
    assert values["tokenizer.ggml.model"] == "llama"
    assert len(values["tokenizer.ggml.tokens"]) == tiny_model.config.vocab_size
    assert values["tokenizer.ggml.mask_token_id"] == 3
    if kind == "dspark":
        assert values["dflash.sample_from_anchor"] is False  # slots 1.. drafted, the anchor passed
        assert values["dflash.has_confidence_head"] is True
    else:
        assert "dflash.sample_from_anchor" not in values


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_gguf_reads_back_as_the_trained_head(heads, exported, tiny_model, tiny_llama_dir, kind):
    """float32: the exported head's outputs are the trained head's, bit for bit, through our
    export reader and through the reader evaluation uses (`heads.formats`)."""
    out, report = exported[kind, "float32"]
    assert report["max_abs_diff_vs_trained_float32"] == 0.0
    assert detect_format(out) == f"{kind}-gguf"
    record = head_kind(kind)
    trained = record.check.outputs(record.load_for_decoding(heads[kind], tiny_model, str(tiny_llama_dir))[0])
    for head in (load_export(out, tiny_model, str(tiny_llama_dir)),
                 load_for_decoding(out, tiny_model, str(tiny_llama_dir))[1]):
        got = record.check.outputs(head.eval())
        assert type(head).kind == kind and all(torch.equal(trained[k], got[k]) for k in trained)


def test_a_dspark_head_without_its_confidence_head_writes_none(tiny_model, tiny_llama_dir, tmp_path):
    head = random_dspark_head(tiny_model, str(tiny_llama_dir), aux_layer_ids=AUX, confidence_head=False)
    out, report = export_head(head.save_pretrained(tmp_path / "h"), "dspark-gguf", tmp_path / "g", tiny_model,
                              dtype="float32")
    assert report["max_abs_diff_vs_trained_float32"] == 0.0
    reader = GGUFReader(out / "draft.gguf")
    assert reader.fields["dflash.has_confidence_head"].contents() is False
    assert not {t.name for t in reader.tensors} & {"conf_proj.weight", "conf_proj.bias"}


def test_gguf_is_a_default_format_of_block_heads(heads):
    """`export.formats=null` (the main job's) writes the GGUF beside vLLM's two layouts."""
    assert formats_for(heads["dflash"], None) == ["dflash", "dflash-speculators", "dflash-gguf"]
    assert formats_for(heads["dspark"], None) == ["dspark", "dspark-speculators", "dspark-gguf"]


def test_a_confidence_head_of_the_hidden_alone_is_refused_when_the_command_starts():
    cfg = compose_root(["+head=dspark", "head.confidence_with_markov=false", "export.formats=[dspark-gguf]"])
    line = "^export.formats=dspark-gguf: head.confidence_with_markov=false"
    with pytest.raises(UserError, match=line) as err:
        check_export_formats(cfg)
    assert "\n" not in str(err.value)
    check_export_formats(compose_root(["+head=dspark", "export.formats=[dspark-gguf]"]))
    settings = vars(compose_root(["+head=dspark", "head.confidence_with_markov=false"]).head)
    assert default_formats(head_kind("dspark"), settings) == ["dspark", "dspark-speculators"]


def test_a_windowed_block_head_is_refused_when_the_command_starts():
    """A command's `head.sliding_window` (its settings carry no layer types yet) is read as the
    saved head's would be: refused when asked for, left out of the defaults."""
    cfg = compose_root(["+head=dflash", "head.sliding_window=64", "export.formats=[dflash-gguf]"])
    with pytest.raises(UserError, match="^export.formats=dflash-gguf: head.sliding_window=64: "):
        check_export_formats(cfg)
    assert default_formats(head_kind("dflash"), vars(cfg.head)) == ["dflash", "dflash-speculators"]


@pytest.mark.parametrize("edit, message", [
    ({"sliding_window": 2, "layer_types": ["sliding_attention"] * 2}, "head.sliding_window=2"),
    ({"aux_layer_ids": [2, 4, 8]}, r"head.aux_layer_ids=\[2, 4, 8\].*ids 0..7"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "scale positions"),
])
def test_what_llama_cpp_cannot_express_is_one_line(heads, edit, message):
    cfg = load_head(heads["dflash"], "dflash")[0] | edit
    with pytest.raises(UserError, match=message) as err:
        DFLASH_GGUF.check_expressible(cfg, 8)
    assert "\n" not in str(err.value) and str(err.value).startswith("export.formats=dflash-gguf: ")


def _rewrite(path: Path, edit) -> None:
    meta, tensors = read_gguf(path, "test")
    meta.pop("general.architecture")
    edit(meta, tensors)
    write_gguf(path, "dflash", meta, tensors)


def setting(key: str, vtype: GGUFValueType, value):
    return lambda m, t: m.update({key: Value(vtype, value)})


TAMPERED = {
    # llama.cpp would read a window the head was not trained with.
    "extra-key": ("dflash", setting("dflash.attention.sliding_window", GGUFValueType.UINT32, 8),
                  r"unknown keys \['dflash.attention.sliding_window'\]"),
    # llama.cpp reads a missing causal flag as false, a missing block size as 16.
    "missing-block": ("dflash", lambda m, t: m.pop("dflash.block_size"), r"missing \['dflash.block_size'\]"),
    "retyped": ("dflash", setting("dflash.block_size", GGUFValueType.INT32, BLOCK),
                r"of another type \['dflash.block_size'\]"),
    "no-k-norm": ("dflash", lambda m, t: t.pop("blk.1.attn_k_norm.weight"), "missing"),
    # llama.cpp would draft slot 0 too, with the anchor's Markov chain shifted by one.
    "anchor": ("dspark", setting("dflash.sample_from_anchor", GGUFValueType.BOOL, True),
               "sample_from_anchor is true"),
    # Without markov_w1 llama.cpp serves it as a DFlash draft.
    "no-markov": ("dspark", lambda m, t: t.pop("markov_w1.weight"), "no markov_w1.weight"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_the_reader_refuses_what_llama_cpp_would_serve_differently(exported, tmp_path, case):
    kind, edit, message = TAMPERED[case]
    out = Path(shutil.copytree(exported[kind, "bfloat16"][0], tmp_path / "g"))
    _rewrite(out / "draft.gguf", edit)
    with pytest.raises(UserError, match=message):
        head_kind(kind).formats[f"{kind}-gguf"].read(out)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_card_serves_it_with_llama_server_drafting_the_block(exported, kind):
    out, _ = exported[kind, "bfloat16"]
    card = (out / "README.md").read_text()
    draft = out.resolve() / "draft.gguf"
    assert f"-md {draft} --spec-type draft-{kind} --spec-draft-n-max {BLOCK - 1}" in card  # the block, not 7
    assert "library_name: gguf" in card and "vllm serve" not in card
    assert json.loads((out / "config.json").read_text()) == {
        "format": f"{kind}-gguf", "architecture": "dflash", "file": "draft.gguf"}
