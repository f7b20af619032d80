"""EAGLE-3 export: engine key sets, config keys, aux-layer numbering, round trips, self-check, card.

Heads are real `Eagle3Head`s built on the tiny random targets of support/targets.py and saved in the
project's folder format; exports are real safetensors folders read back by our strict readers.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from conf.errors import UserError
from conf.kinds import HEAD_CONFIGS, Eagle3Config
from conf.schema import EXPORT_DTYPES
from heads.eagle3.export import engine_layer_ids, read_native, read_speculators, serving_notes
from heads.eagle3.model import Eagle3Head
from heads.export.card import CardFacts, render
from heads.export.check import verify_export
from heads.export.core import cast_weights
from heads.export.write import DTYPES, detect_format, export_head, load_export
from heads.folder import load_head
from heads.kinds import KINDS, head_kind, layouts
from tests.support.heads import DRAFT_VOCAB, cut_in_half, make_eagle3_head

EAGLE3_CHECK = head_kind("eagle3").check

# Checkpoint names the engines load for a one-layer EAGLE-3 head, written down from their source:
# vLLM 0.32 `llama_eagle3.py` (Eagle3LlamaForCausalLM.load_weights + WeightsMapper "midlayer." ->
# "layers.0.", q/k/v and gate/up stacked; `t2d` skipped, `d2t` -> draft_id_to_target_id),
# SGLang `llama_eagle3.py` (LlamaForCausalLMEagle3.load_weights: `midlayer.*`, d2t -> hot_token_id),
# TensorRT-LLM `modeling_speculative.py` (Eagle3DraftModel.midlayer, fc, norm, d2t; lm_head).
LAYER = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
]
TOP = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
NATIVE_KEYS = TOP | {f"midlayer.{k}" for k in LAYER}
# vllm-project/speculators Eagle3DraftModel keeps the decoder layers in `layers` (a ModuleList).
SPECULATORS_KEYS = TOP | {f"layers.0.{k}" for k in LAYER}


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_eagle3_head(tiny_llama_dir, tmp_path_factory.mktemp("heads") / "head")


def trained_outputs(head_dir: Path, target_model) -> dict:
    head = Eagle3Head.from_pretrained(head_dir, target_model, "tiny")
    return EAGLE3_CHECK.outputs(head.eval())


def test_engine_layer_ids_follow_each_engines_capture_rule():
    ids = engine_layer_ids([27, 2, 15])
    assert ids == {"vllm": [2, 15, 27], "sglang": [1, 14, 26], "trtllm": [1, 14, 26]}
    # SGLang: set_eagle3_layers_to_capture stores id+1 and captures hidden+residual *entering*
    # that layer, i.e. HF hidden_states[id+1]. TRT-LLM captures the output of layer id, the same.
    assert [i + 1 for i in ids["sglang"]] == ids["vllm"]
    # Their defaults agree: vLLM/SGLang (2, N//2, N-3) == TRT-LLM (1, N//2-1, N-4) shifted.
    n = 30
    assert engine_layer_ids([2, n // 2, n - 3])["trtllm"] == [1, n // 2 - 1, n - 4]
    with pytest.raises(UserError, match="id 0"):
        engine_layer_ids([0, 4, 5])


@pytest.mark.parametrize("fmt,keys", [("eagle3", NATIVE_KEYS), ("speculators", SPECULATORS_KEYS)])
def test_export_holds_exactly_the_engine_names(head_dir, tmp_path, fmt, keys):
    out, _ = export_head(head_dir, fmt, tmp_path / fmt)
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == keys
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    # Readable by an engine running as another user (mkdtemp/safetensors default to 0700/0600).
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}


def test_native_config_keys(head_dir, tmp_path, tiny_model):
    cfg = json.loads((export_head(head_dir, "eagle3", tmp_path / "e")[0] / "config.json").read_text())
    src_cfg, _, _ = load_head(head_dir, "eagle3")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["vocab_size"] == 49152
    assert cfg["target_hidden_size"] == 64 and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False  # SGLang would tie lm_head to the embeddings
    assert cfg["eagle_aux_hidden_state_layer_ids"] == src_cfg["aux_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    # What vLLM does first: AutoConfig -> LlamaConfig, extra keys kept as attributes.
    auto = AutoConfig.from_pretrained(tmp_path / "e")
    assert auto.rope_parameters["rope_theta"] == tiny_model.config.rope_parameters["rope_theta"]
    assert auto.draft_vocab_size == DRAFT_VOCAB and auto.eagle_config["use_aux_hidden_state"]


def test_speculators_config_keys(head_dir, tmp_path):
    out, _ = export_head(head_dir, "speculators", tmp_path / "s", num_speculative_tokens=4)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and "model_type" not in cfg
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    # vLLM defaults norm_before_residual to True when it is missing: it must be written.
    assert cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    proposal = cfg["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == 4
    assert cfg["speculators_config"]["verifier"]["name_or_path"]


@pytest.mark.parametrize("fmt,reader", [("eagle3", read_native), ("speculators", read_speculators)])
def test_float32_round_trip_gives_identical_logits(head_dir, tmp_path, tiny_model, fmt, reader):
    out, report = export_head(
        head_dir, fmt, tmp_path / fmt, target_model=tiny_model, dtype="float32"
    )
    assert report["max_abs_diff_vs_trained_float32"] == 0.0
    cfg, tensors = reader(out)
    _, spec, _ = load_head(head_dir, "eagle3")
    reloaded = EAGLE3_CHECK.build(cfg, spec, tensors, tiny_model)
    expected = trained_outputs(head_dir, tiny_model)
    got = EAGLE3_CHECK.outputs(reloaded)
    for k in expected:
        assert torch.equal(expected[k], got[k]), k


def test_bfloat16_export_equals_the_rounded_head(head_dir, tmp_path, tiny_model):
    out, report = export_head(
        head_dir, "eagle3", tmp_path / "bf16", target_model=tiny_model
    )
    assert report["outputs_identical"]
    assert 0 < report["max_abs_diff_vs_trained_float32"] < 0.05


def test_qwen2_target_exports(tiny_qwen2_dir, tmp_path):
    head = make_eagle3_head(tiny_qwen2_dir, tmp_path / "head")
    cfg = json.loads((export_head(head, "eagle3", tmp_path / "e")[0] / "config.json").read_text())
    qwen_theta = AutoConfig.from_pretrained(tiny_qwen2_dir).rope_parameters["rope_theta"]
    assert cfg["model_type"] == "llama" and cfg["rope_theta"] == qwen_theta


def test_reader_refuses_a_renamed_tensor(head_dir, tmp_path):
    out, _ = export_head(head_dir, "eagle3", tmp_path / "e")
    tensors = load_file(out / "model.safetensors")
    tensors["midlayer.hidden_norms.weight"] = tensors.pop("midlayer.hidden_norm.weight")
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(UserError, match="unknown tensors.*hidden_norms.*missing.*hidden_norm"):
        read_native(out)


def test_reader_refuses_wrong_sglang_ids(head_dir, tmp_path):
    out, _ = export_head(head_dir, "eagle3", tmp_path / "e")
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="minus one"):
        read_native(out)


def test_self_check_catches_a_changed_weight(head_dir, tmp_path, monkeypatch):
    import heads.eagle3.export as e3

    def corrupt(tensors, cfg, dtype):
        out = e3.rename_layer(cast_weights(tensors, dtype), "midlayer.", "layers.0.")
        out["norm.weight"] = out["norm.weight"] + 1
        return out

    formats = head_kind("eagle3").formats
    monkeypatch.setitem(formats, "speculators", dataclasses.replace(formats["speculators"], tensors=corrupt))
    with pytest.raises(UserError, match="self-check failed: norm.weight: values differ"):
        export_head(head_dir, "speculators", tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.tmp-*"))


def test_not_a_head_folder_is_a_user_error(head_dir, tmp_path):
    with pytest.raises(UserError, match="no draftsmith_head.json"):
        export_head(tmp_path, "eagle3", tmp_path / "x")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))


def test_every_format_belongs_to_one_kind_and_every_kind_to_the_schema():
    """The kinds' records name the formats (config checks, defaults): no format name is shared by
    two kinds (`format_kind` would pick the first), and the records are the schema's head groups."""
    names = [fmt for k in KINDS.values() for fmt in k.formats]
    assert len(names) == len(set(names)) == len(layouts())
    assert {n: k.config for n, k in KINDS.items()} == HEAD_CONFIGS
    assert set(DTYPES) == set(EXPORT_DTYPES)


EVAL = {
    "settings": {"mode": "chain", "num_speculative_tokens": 3, "temperature": 0.0},
    "overall": {"mean_acceptance_length": 2.5, "acceptance_per_position": [0.7, 0.5, 0.3], "prompts": 6},
    "tasks": {
        "mtbench": {"mean_acceptance_length": 2.25},
        "gsm8k": {"mean_acceptance_length": 2.75},
    },
    "lossless": True,
}


def test_model_card_states_metadata_acceptance_serving_and_data():
    facts = CardFacts(
        fmt="eagle3",
        kind="eagle3",
        target_name="smollm2-135m-instruct",
        location="me/smol-eagle3",
        num_speculative_tokens=3,
        license="apache-2.0",
        layer_ids=engine_layer_ids([2, 15, 27]),
        eval_report=EVAL,
        data={
            "source": "sharegpt",
            "max_samples": 240,
            "max_length": 512,
            "regenerate": {"enabled": True},
            "chat_template": "/templates/qwen3.jinja",
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    kind = head_kind("eagle3")
    card = render(facts, kind.title, kind.formats[facts.fmt].library, kind.serve_lines(facts))
    head, _, body = card.partition("\n---\n")
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in head
    assert "library_name: vllm" in head and "license: apache-2.0" in head and "- eagle3" in head
    assert "| mtbench | - | 2.250 |" in body and "| gsm8k | - | 2.750 |" in body
    assert "| overall | 6 | 2.500 | 0.700, 0.500, 0.300 | - |" in body
    assert "chain drafting with 3 speculative tokens, temperature 0.0" in body
    assert "evaluator (chain drafting" in body and ") on 6 prompts in all: read differences" in body
    assert '"method": "eagle3", "model": "me/smol-eagle3"' in body
    assert "--speculative-draft-model-path me/smol-eagle3" in body
    assert "eagle3_layers_to_capture: [1, 14, 26]" in body and "| [2, 15, 27] |" in body
    assert "sharegpt" in body and "regenerated by the target" in body
    assert 'template `qwen3.jinja` and `chat_template_kwargs` {"enable_thinking": false}' in body


def test_export_card_reads_eval_json_and_run_config(head_dir, tmp_path):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "eval.json").write_text(json.dumps(EVAL))
    config = {
        "data": {"source": "sharegpt", "max_samples": 8},
        "head": {"loss": "ce+tv", "tv_weight": 0.5, "prompt_loss_weight": 0.25, "norm_output": True},
        "optim": {"epochs": 3, "lr": 0.001, "batch_tokens": 1024, "select_by": "decoded"},
    }
    (run / "config.json").write_text(json.dumps(config))
    head = run / "head"
    head.mkdir()
    for f in head_dir.iterdir():
        (head / f.name).write_bytes(f.read_bytes())
    out, _ = export_head(head, "speculators", run / "export", eval_json=run / "eval" / "eval.json")
    card = (out / "README.md").read_text()
    assert "| mtbench | - | 2.250 |" in card and "at most 8 conversations" in card
    assert "- loss `ce+tv`, tv weight 0.5, prompt rows weighted 0.25" in card
    assert "- EAGLE-3 norms on: `norm_output`" in card
    assert "3 epochs, lr 0.001, 1024 tokens per batch; the kept checkpoint is the best by decoded" in card
    assert f"vllm serve {out.resolve()}" in card
    assert "![" not in card and not (out / "acceptance.png").exists()  # no picture beside eval.json

    # The evaluation's picture travels with the export and the card shows it.
    (run / "eval" / "acceptance.png").write_bytes(b"\x89PNG picture")
    again, _ = export_head(head, "eagle3", run / "export-2", eval_json=run / "eval" / "eval.json")
    assert (again / "acceptance.png").read_bytes() == b"\x89PNG picture"
    assert "![Per-position acceptance](acceptance.png)" in (again / "README.md").read_text()


def test_cli_bad_format_exits_2_with_one_line(head_dir, capsys):
    from heads.export.__main__ import main

    with pytest.raises(SystemExit) as done:
        main([f"head={head_dir}", "format=onnx"])
    assert done.value.code == 2
    assert capsys.readouterr().err == (
        "error: format=onnx: expected one of eagle3, speculators, gguf (the formats of eagle3 heads)\n"
    )


def test_cli_format_of_the_other_kind_exits_2_before_writing(head_dir, tmp_path, capsys):
    from heads.export.__main__ import main

    with pytest.raises(SystemExit) as done:
        main([f"head={head_dir}", "format=speculators,medusa-tgi", f"out={tmp_path / 'o'}"])
    assert done.value.code == 2
    assert capsys.readouterr().err.startswith("error: format=speculators,medusa-tgi: expected one of")
    assert list(tmp_path.iterdir()) == []


def test_cli_out_an_existing_file_is_refused_before_writing(head_dir, tmp_path, capsys):
    from heads.export.__main__ import main

    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    for fmt in ("format=eagle3", "format=eagle3,speculators"):  # out=taken, out=taken/<fmt>
        with pytest.raises(SystemExit) as done:
            main([f"head={head_dir}", fmt, f"out={taken}"])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: out='{taken}") and err.count("\n") == 1, err
        assert f"{taken} is a file" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
        assert taken.read_text() == "not a folder"


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_broken_export_folder_names_the_file(head_dir, tiny_model, tmp_path, name):
    """check_vllm and load_export read folders that were copied around: a cut-off file is one
    line naming it, from the format's reader, detect_format and load_export alike."""
    out, _ = export_head(head_dir, "eagle3", tmp_path / "e")
    cut_in_half(out / name)
    what = "is not valid JSON" if name == "config.json" else "is not a readable safetensors file"
    readers = [read_native, lambda f: load_export(f, tiny_model, "tiny")]
    if name == "config.json":
        readers.append(detect_format)
    for read in readers:
        with pytest.raises(UserError, match=f"{re.escape(str(out / name))} {what}"):
            read(out)


# ---- layer variants: every flag written where the engines read it, read back strictly ------------

# The two fc-input norms, each with the other variants on: one RMSNorm over the concatenation
# (`input_norm.weight`, [3*Ht]) or one per aux layer (EAGLE 3.1's `fc_norm.{i}.weight`, [Ht] each).
NORM_FLAGS_ON = {"norm_before_fc": True, "fc_norm": False, "norm_before_residual": True, "norm_output": True}
FC_NORM_ON = NORM_FLAGS_ON | {"norm_before_fc": False, "fc_norm": True}
FC_INPUT_NORMS = {
    "input_norm": (NORM_FLAGS_ON, {"input_norm.weight": (3 * 64,)}),
    "fc_norm": (FC_NORM_ON, {f"fc_norm.{i}.weight": (64,) for i in range(3)}),
}


@pytest.fixture(scope="module")
def variant_head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("heads") / "variant"
    return make_eagle3_head(tiny_llama_dir, out, cfg=Eagle3Config(**NORM_FLAGS_ON))


@pytest.fixture(scope="module")
def fc_norm_head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("heads") / "fc_norm"
    return make_eagle3_head(tiny_llama_dir, out, cfg=Eagle3Config(**FC_NORM_ON))


@pytest.mark.parametrize("norm", list(FC_INPUT_NORMS))
@pytest.mark.parametrize("fmt,reader", [("eagle3", read_native), ("speculators", read_speculators)])
def test_norm_variants_round_trip(request, tmp_path, tiny_model, fmt, reader, norm):
    """vLLM 0.32 reads the flags at the top level of both formats (the speculators path copies
    them, defaulting a missing norm_before_residual to true) and `norm_before_fc` from
    eagle_config first (llama_eagle3.LlamaModel); the fc-input norms are `input_norm.weight` and
    `fc_norm.{i}.weight` (one per aux layer, in the order of the ids) in both formats."""
    head_dir = request.getfixturevalue("variant_head_dir" if norm == "input_norm" else "fc_norm_head_dir")
    flags, norm_tensors = FC_INPUT_NORMS[norm]
    out, report = export_head(head_dir, fmt, tmp_path / fmt, target_model=tiny_model, dtype="float32")
    assert report["max_abs_diff_vs_trained_float32"] == 0.0
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in flags} == flags
    if fmt == "eagle3":
        assert cfg["eagle_config"]["norm_before_fc"] is flags["norm_before_fc"]
    keys = (NATIVE_KEYS if fmt == "eagle3" else SPECULATORS_KEYS) | set(norm_tensors)
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == keys
    assert {k: tuple(tensors[k].shape) for k in norm_tensors} == norm_tensors
    _, _, trained = load_head(head_dir, "eagle3")
    assert all(torch.equal(tensors[k], trained[k]) for k in norm_tensors)
    read_cfg, read_tensors = reader(out)
    assert {k: read_cfg[k] for k in flags} == flags
    _, spec, _ = load_head(head_dir, "eagle3")
    got = EAGLE3_CHECK.outputs(EAGLE3_CHECK.build(read_cfg, spec, read_tensors, tiny_model))
    expected = trained_outputs(head_dir, tiny_model)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_flags_off_are_written_false_everywhere(head_dir, tmp_path):
    for fmt in ("eagle3", "speculators"):
        cfg = json.loads((export_head(head_dir, fmt, tmp_path / fmt)[0] / "config.json").read_text())
        assert all(cfg[k] is False for k in NORM_FLAGS_ON)
        assert fmt == "speculators" or cfg["eagle_config"]["norm_before_fc"] is False


def edit_config(folder: Path, edit) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def fc_flag_off(cfg: dict) -> None:
    """norm_before_fc off wherever the format writes it (eagle_config too in the native one)."""
    for where in (cfg, cfg.get("eagle_config", {})):
        where["norm_before_fc"] = False


TAMPERED = {
    # An engine would use its own default for a missing flag (vLLM: norm_before_residual=true).
    "missing": (lambda c: c.pop("norm_before_residual"), "norm_before_residual.*true or false"),
    "not-bool": (lambda c: c.update(norm_output="yes"), "norm_output.*true or false"),
    # The per-aux-layer norms switched on without their weights.
    "fc_norm": (lambda c: c.update(fc_norm=True), r"missing \['fc_norm.0.weight'"),
    # vLLM drops `input_norm.weight` without a word when the flag is off.
    "fc-flag-off": (fc_flag_off, r"unknown tensors \['input_norm.weight'\]"),
}


@pytest.mark.parametrize("fmt,reader", [("eagle3", read_native), ("speculators", read_speculators)])
@pytest.mark.parametrize("case", list(TAMPERED))
def test_reader_refuses_tampered_flags(variant_head_dir, tmp_path, fmt, reader, case):
    out, _ = export_head(variant_head_dir, fmt, tmp_path / fmt)
    edit, message = TAMPERED[case]
    edit_config(out, edit)
    with pytest.raises(UserError, match=message):
        reader(out)


@pytest.mark.parametrize("fmt,reader", [("eagle3", read_native), ("speculators", read_speculators)])
def test_reader_refuses_fc_norm_weights_with_the_flag_off(fc_norm_head_dir, tmp_path, fmt, reader):
    """vLLM would build no fc_norm for them: the head would be served without its norms."""
    out, _ = export_head(fc_norm_head_dir, fmt, tmp_path / fmt)
    edit_config(out, lambda c: c.update(fc_norm=False))
    with pytest.raises(UserError, match=r"unknown tensors \['fc_norm.0.weight'"):
        reader(out)


def test_reader_refuses_nested_fc_flag_disagreeing(variant_head_dir, tmp_path):
    out, _ = export_head(variant_head_dir, "eagle3", tmp_path / "e")
    edit_config(out, lambda c: c["eagle_config"].update(norm_before_fc=False))
    with pytest.raises(UserError, match="eagle_config.norm_before_fc=False but norm_before_fc=True"):
        read_native(out)


@pytest.mark.parametrize("fmt,reader", [("eagle3", read_native), ("speculators", read_speculators)])
def test_reader_refuses_a_dropped_input_norm(variant_head_dir, tmp_path, fmt, reader):
    out, _ = export_head(variant_head_dir, fmt, tmp_path / fmt)
    tensors = load_file(out / "model.safetensors")
    del tensors["input_norm.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(UserError, match=r"missing \['input_norm.weight'\]"):
        reader(out)


def test_self_check_refuses_a_flipped_flag(variant_head_dir, tmp_path):
    """A flag the reader accepts but the trained head does not have: the self-check's config
    comparison names it (norm_output adds no tensor, so only the config tells)."""
    out, _ = export_head(variant_head_dir, "speculators", tmp_path / "s")
    edit_config(out, lambda c: c.update(norm_output=False))
    src_cfg, spec, src_tensors = load_head(variant_head_dir, "eagle3")
    with pytest.raises(UserError, match="config norm_output: True != False"):
        verify_export(EAGLE3_CHECK, src_cfg, spec, src_tensors, read_speculators(out), torch.bfloat16)


def swap_fc_norms(cfg: dict, tensors: dict) -> None:
    """Two aux layers' norms swapped: each applied to the other layer's features."""
    first, last = tensors["fc_norm.0.weight"], tensors["fc_norm.2.weight"]
    tensors["fc_norm.0.weight"], tensors["fc_norm.2.weight"] = last, first


def drop_fc_norms(cfg: dict, tensors: dict) -> None:
    """Read back as a head without them."""
    cfg["fc_norm"] = False
    for i in range(3):
        del tensors[f"fc_norm.{i}.weight"]


SWAPPED_FC_NORMS = {
    "swapped": (swap_fc_norms, r"fc_norm.0.weight: values differ"),
    "flag-off": (drop_fc_norms, r"config fc_norm: True != False"),
}


@pytest.mark.parametrize("case", list(SWAPPED_FC_NORMS))
def test_self_check_covers_fc_norm(fc_norm_head_dir, tmp_path, case):
    out, _ = export_head(fc_norm_head_dir, "speculators", tmp_path / "s")
    read_cfg, read_tensors = read_speculators(out)
    edit, message = SWAPPED_FC_NORMS[case]
    edit(read_cfg, read_tensors)
    src_cfg, spec, src_tensors = load_head(fc_norm_head_dir, "eagle3")
    with pytest.raises(UserError, match=message):
        verify_export(EAGLE3_CHECK, src_cfg, spec, src_tensors, (read_cfg, read_tensors), torch.bfloat16)


def test_serving_notes_name_the_engines_that_ignore_flags(variant_head_dir, head_dir):
    variant, _, _ = load_head(variant_head_dir, "eagle3")
    (note,) = serving_notes(variant, "eagle3")
    assert "serve it with vLLM" in note and "SGLang" in note and "TensorRT-LLM" in note
    assert serving_notes(variant, "speculators") == []  # vLLM only
    assert serving_notes(load_head(head_dir, "eagle3")[0], "eagle3") == []


