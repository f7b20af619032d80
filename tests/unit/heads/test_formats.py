"""Heads from elsewhere (`heads.formats`): `trainer.evaluate head=<folder>` and `head.init_from=<folder>`
take an engine's head folder as well as draftsmith's own, and refuse one that does not fit in one line.

The engine folders are real: our exports in the speculators and native EAGLE-3 formats (float32,
so they hold exactly the trained tensors), and a speculators EAGLE-3 folder written here by hand
as vLLM reads one (engine-formats.md section 2, speculators' `Eagle3SpeculatorConfig`): a
`transformer_layer_config` of LlamaConfig's non-default keys, `norm_before_residual` alone of the
flags, no `target_hidden_size`, the verifier's `embed_tokens.weight` beside the head's tensors and
no `t2d` (vLLM skips it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from conf.compose import compose_root
from conf.kinds import Eagle3Config
from data_prep.target import load_target
from heads.export.__main__ import main as export_main
from heads.export.write import export_head
from heads.folder import load_head
from heads.formats import compose_for_any_head, load_for_decoding, read_any_head
from heads.kinds import head_kind
from tests.support.cli import error_lines, run_cli
from tests.support.heads import MEDUSA_HEADS, MEDUSA_LAYERS, cut_in_half, make_eagle3_head, make_medusa_head
from tests.support.runs import QUICK, tiny_run_config, user_error_line
from tests.support.targets import build_tiny_target
from trainer.evaluate.__main__ import main as evaluate_main
from trainer.evaluate.run import evaluate
from trainer.kinds import build_trainee, check_init_from
from trainer.train import run

pytestmark = pytest.mark.usefixtures("single_thread")

EAGLE3 = head_kind("eagle3")
# What an evaluation measured, without its clock readings.
MEASURED = ("prompts", "new_tokens", "drafts", "accepted_tokens", "mean_acceptance_length",
            "acceptance_per_position")


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama.model, tiny_llama.tokenizer


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """A draftsmith EAGLE-3 head with the run defaults' layer variants, over a 512-id vocabulary."""
    return make_eagle3_head(tiny_llama_dir, tmp_path_factory.mktemp("own") / "head", cfg=Eagle3Config())


@pytest.fixture(scope="module")
def exports(head_dir, tiny, tmp_path_factory) -> dict[str, Path]:
    """`head_dir` exported by our exporter, as float32 (the trained tensors exactly)."""
    root = tmp_path_factory.mktemp("exports")
    return {
        fmt: export_head(head_dir, fmt, root / fmt, target_model=tiny[0], dtype="float32")[0]
        for fmt in ("speculators", "eagle3")
    }


@pytest.fixture(scope="module")
def medusa(tiny, tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """A draftsmith Medusa head ("own") and its exports in both of Medusa's formats, float32."""
    root = tmp_path_factory.mktemp("medusa")
    own = make_medusa_head(tiny[0], str(tiny_llama_dir), root / "own", fc_bias=True)
    return {"own": own} | {
        fmt: export_head(own, fmt, root / fmt, target_model=tiny[0], dtype="float32")[0]
        for fmt in ("medusa-vllm", "medusa-tgi")
    }


def measured(result: dict) -> dict:
    return {k: result["overall"][k] for k in MEASURED} | {"lossless": result["lossless"]}


def evaluated(head: Path, out: Path, *overrides: str) -> tuple[dict, list[dict]]:
    cfg = compose_for_any_head(str(head), [*QUICK, "eval.save_outputs=true", *overrides])
    result = evaluate(cfg, head, out)
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return result, outputs


def draft_outputs(head: Path, model, target: Path) -> dict[str, torch.Tensor]:
    _, module, verifier = load_for_decoding(head, model, str(target))
    assert verifier is model
    return EAGLE3.check.outputs(module.eval())


@pytest.fixture(scope="module")
def own_eval(head_dir, tmp_path_factory) -> tuple[dict, list[dict]]:
    return evaluated(head_dir, tmp_path_factory.mktemp("own-eval"))


@pytest.mark.parametrize("fmt", ["speculators", "eagle3"])
def test_an_export_evaluates_as_the_head_it_was_written_from(fmt, exports, own_eval, head_dir, tiny,
                                                             tiny_llama_dir, tmp_path):
    folder = exports[fmt]
    own, own_outputs = own_eval
    # The speculators config names its verifier; a native folder names no target.
    target = [] if fmt == "speculators" else [f"target.name_or_path={tiny_llama_dir}"]
    assert compose_for_any_head(str(folder), target).target.name_or_path == str(tiny_llama_dir.resolve())
    theirs, their_outputs = evaluated(folder, tmp_path / fmt, *target)
    assert measured(theirs) == measured(own) and their_outputs == own_outputs
    assert theirs["settings"]["kind"] == "eagle3"
    # The same head: its draft step on fixed inputs, bit for bit.
    want = draft_outputs(head_dir, tiny[0], tiny_llama_dir)
    got = draft_outputs(folder, tiny[0], tiny_llama_dir)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("fmt", ["medusa-vllm", "medusa-tgi"])
def test_a_medusa_export_evaluates_as_the_head_it_was_written_from(fmt, medusa, tiny_llama_dir, tmp_path):
    # TGI's config names its base model; vLLM's names none.
    target = [f"target.name_or_path={tiny_llama_dir}"] if fmt == "medusa-vllm" else []
    tree = "eval.tree.medusa_choices=[[0],[1],[0,0],[0,1],[0,0,0]]"  # three heads deep
    own, own_outputs = evaluated(medusa["own"], tmp_path / "own", tree)
    theirs, their_outputs = evaluated(medusa[fmt], tmp_path / fmt, tree, *target)
    assert measured(theirs) == measured(own) and their_outputs == own_outputs
    assert theirs["settings"]["mode"] == "tree"  # evaluated as a Medusa head is served


def test_the_evaluate_command_takes_a_speculators_folder(exports, tmp_path):
    evaluate_main([f"head={exports['speculators']}", *QUICK, f"eval.out_dir={tmp_path}"])
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["settings"]["head"] == str(exports["speculators"]) and report["lossless"] is True


def test_the_export_command_takes_an_engine_folder(exports, tiny_llama_dir, tmp_path, capsys):
    """`python -m heads.export head=<folder>` takes what `trainer.evaluate` takes: our speculators
    export (which names its target) becomes the native folder our exporter writes from the head
    itself, tensors and config alike; a native folder, which names no target, with `target.name_or_path=`."""
    out = tmp_path / "native"
    export_main([f"head={exports['speculators']}", "format=eagle3", f"out={out}", "export.dtype=float32"])
    assert json.loads(capsys.readouterr().out)["format"] == "eagle3"
    want = load_file(exports["eagle3"] / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((exports["eagle3"] / "config.json").read_text())
    back = tmp_path / "back"
    export_main([f"head={exports['eagle3']}", "format=speculators", f"out={back}", "export.dtype=float32",
                 f"target.name_or_path={tiny_llama_dir}"])
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (exports["speculators"] / "config.json").read_text())


# ---- a speculators folder built by hand ----------------------------------------------------------

DRAFT, INTER, AUX = 256, 96, [1, 4, 7]


def hand_built_speculators(out: Path, target_dir: Path, model, embed: torch.Tensor | None = None) -> dict:
    """A speculators EAGLE-3 folder written directly (no draftsmith code): bfloat16 weights under
    speculators' names, the draft vocabulary as `d2t` offsets. Returns what was written."""
    h, v = model.config.hidden_size, model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    keep = torch.sort(torch.randperm(v, generator=g)[:DRAFT]).values
    shapes = {
        "fc.weight": (h, 3 * h),
        "layers.0.self_attn.q_proj.weight": (h, 2 * h),
        "layers.0.self_attn.k_proj.weight": (h // 2, 2 * h),
        "layers.0.self_attn.v_proj.weight": (h // 2, 2 * h),
        "layers.0.self_attn.o_proj.weight": (h, h),
        "layers.0.mlp.gate_proj.weight": (INTER, h),
        "layers.0.mlp.up_proj.weight": (INTER, h),
        "layers.0.mlp.down_proj.weight": (h, INTER),
        "lm_head.weight": (DRAFT, h),
    }
    tensors = {k: (0.1 * torch.randn(s, generator=g)).bfloat16() for k, s in shapes.items()}
    norms = ("layers.0.input_layernorm", "layers.0.hidden_norm", "layers.0.post_attention_layernorm", "norm")
    for norm in norms:
        tensors[f"{norm}.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    tensors["d2t"] = keep - torch.arange(DRAFT)
    own_embed = model.get_input_embeddings().weight.detach().bfloat16()
    tensors["embed_tokens.weight"] = own_embed if embed is None else embed
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    layer = {  # LlamaConfig.to_diff_dict() of the draft layer: head_dim and the rope type left out
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": INTER, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": v, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": DRAFT,
        "norm_before_residual": True,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": AUX,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]},
        },
        "speculators_version": "0.3.0",
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return {"tensors": tensors, "keep": keep}


def test_a_hand_built_speculators_folder_loads_as_vllm_reads_it_and_evaluates(tiny, tiny_llama_dir, tmp_path):
    model = tiny[0]
    folder = tmp_path / "speculator"
    written = hand_built_speculators(folder, tiny_llama_dir, model)
    read = read_any_head(folder, model.config, str(tiny_llama_dir))
    assert (read.fmt, read.kind.name) == ("speculators", "eagle3")
    cfg = read.config
    # vLLM's values for what the config leaves out: norm_before_residual as written, the other
    # flags off, target_hidden_size the draft's width, head_dim from the heads.
    assert {k: cfg[k] for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")} == {
        "norm_before_fc": False, "fc_norm": False, "norm_before_residual": True, "norm_output": False}
    assert (cfg["aux_layer_ids"], cfg["target_hidden_size"], cfg["head_dim"], cfg["intermediate_size"]) == (
        AUX, 64, 16, INTER)

    _, head, _ = load_for_decoding(folder, model, str(tiny_llama_dir))
    state = head.state_dict()
    for name, value in written["tensors"].items():
        ours = name.replace("layers.0.", "midlayer.")
        if name not in ("embed_tokens.weight", "d2t"):  # the target's; offsets, checked below
            assert torch.equal(state[ours], value.float()), name
    assert torch.equal(head.draft_token_ids(), written["keep"])
    assert torch.equal(head.t2d.nonzero().squeeze(1), written["keep"])  # rebuilt from d2t

    result, _ = evaluated(folder, tmp_path / "eval")
    assert result["lossless"] is True and result["overall"]["drafts"] > 0


def test_a_folder_with_other_embeddings_than_the_target_is_refused(tiny, tiny_llama_dir, tmp_path):
    model = tiny[0]
    other = model.get_input_embeddings().weight.detach().bfloat16() + 1
    folder = tmp_path / "speculator"
    hand_built_speculators(folder, tiny_llama_dir, model, embed=other)
    line = user_error_line(lambda: load_for_decoding(folder, model, str(tiny_llama_dir)))
    assert f"head={str(folder)!r}: its embed_tokens.weight is not the target's input embeddings" in line


def test_a_native_folder_without_the_optional_keys_reads_with_vllm_defaults(exports, tiny, tiny_llama_dir,
                                                                            tmp_path):
    folder = tmp_path / "native"
    shutil.copytree(exports["eagle3"], folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("eagle_config", "eagle_aux_hidden_state_layer_ids", "target_hidden_size", "head_dim",
                "norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"):
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    del weights["input_norm.weight"]  # norm_before_fc is off now, as for a head trained without it
    save_file(weights, folder / "model.safetensors")
    cfg = read_any_head(folder, tiny[0].config, str(tiny_llama_dir)).config
    # vLLM's Llama default (2, N//2, N-3) for the 8-layer target, every flag off.
    assert cfg["aux_layer_ids"] == [2, 4, 5] and cfg["target_hidden_size"] == 64 and cfg["head_dim"] == 16
    assert not any(cfg[k] for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"))


# ---- one line where a folder does not fit --------------------------------------------------------


@pytest.fixture(scope="module")
def narrow_target(tmp_path_factory, smol_tokenizer) -> Path:
    """A tiny Llama half as wide: no head of the 64-wide one fits it."""
    out = tmp_path_factory.mktemp("narrow")
    return build_tiny_target(out, "llama", smol_tokenizer, hidden_size=32, num_attention_heads=2,
                             num_key_value_heads=1)


def test_folders_that_do_not_fit_are_one_line(exports, tiny, tiny_llama_dir, narrow_target, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert user_error_line(lambda: compose_for_any_head(str(empty), [])) == (
        f"error: head={str(empty)!r}: neither draftsmith_head.json (a draftsmith head folder) nor "
        "config.json (an engine's) there")
    native = str(exports["eagle3"])
    assert user_error_line(lambda: compose_for_any_head(native, [])) == (
        f"error: head={native!r}: a 'eagle3' folder does not name its target: add "
        "target.name_or_path=<the model it drafts for>")
    cfg = compose_for_any_head(str(exports["speculators"]), [*QUICK, f"target.name_or_path={narrow_target}"])
    line = user_error_line(lambda: evaluate(cfg, exports["speculators"], tmp_path / "eval"))
    assert line == (f"error: head={str(exports['speculators'])!r}: a head for another target than "
                    f"{str(narrow_target)!r}: hidden_size 64 != 32; target_hidden_size 64 != 32")
    broken = tmp_path / "broken"
    shutil.copytree(exports["speculators"], broken)
    cut_in_half(broken / "model.safetensors")
    unreadable = f"error: export: {broken / 'model.safetensors'} is not a readable safetensors file"
    line = user_error_line(lambda: read_any_head(broken, tiny[0].config, str(tiny_llama_dir)))
    assert line.startswith(unreadable)
    # As typed: one line on stderr before the target loads, exit 2, no traceback.
    code, out, err = run_cli("trainer.evaluate", [f"head={broken}", *QUICK], tmp_path)
    assert code == 2 and out == "" and len(error_lines(err)) == 1, err[-2000:]
    assert error_lines(err)[0].startswith(unreadable)


# ---- head.init_from --------------------------------------------------------------------------------


def init_config(target: Path, folder: Path, *overrides: str, head: str = "eagle3"):
    return compose_root([f"+head={head}", f"target.name_or_path={target}", f"head.init_from={folder}",
                         *overrides])


@pytest.mark.parametrize("source", ["own", "speculators", "eagle3"])
def test_init_from_starts_the_trainee_from_the_folders_weights(source, head_dir, exports, tiny,
                                                               tiny_llama_dir):
    folder = head_dir if source == "own" else exports[source]
    model = tiny[0]
    trainee = build_trainee(init_config(tiny_llama_dir, folder), model, None)
    _, _, trained = load_head(head_dir, "eagle3")
    state = trainee.head.state_dict()
    assert all(torch.equal(state[k], v) for k, v in trained.items())
    # The teacher reads the target's lm_head at the head's own draft ids (not the data's), kept
    # in the training dtype (tests/unit/trainer/test_frozen_tables.py).
    rows = model.get_output_embeddings().weight[torch.arange(512) + trained["d2t"]]
    assert torch.equal(trainee.teacher_weight, rows.float().to(trainee.teacher_weight.dtype))


def test_init_from_a_medusa_export(medusa, tiny, tiny_llama_dir):
    model, own, folder = tiny[0], medusa["own"], medusa["medusa-tgi"]
    shape = [f"head.num_heads={MEDUSA_HEADS}", f"head.num_layers={MEDUSA_LAYERS}"]
    trainee = build_trainee(init_config(tiny_llama_dir, folder, *shape, head="medusa"), model, None)
    _, _, trained = load_head(own, "medusa")
    assert all(torch.equal(trainee.head.state_dict()[k], v) for k, v in trained.items())
    other = init_config(tiny_llama_dir, folder, head="medusa")  # the defaults' 4 heads of 1 layer
    line = user_error_line(lambda: build_trainee(other, model, None))
    assert line == (f"error: head.init_from={str(folder)!r}: its num_heads {MEDUSA_HEADS} != this run's 4: "
                    f"add head.num_heads={MEDUSA_HEADS}")
    assert user_error_line(lambda: check_init_from(other, model.config)) == line  # before any data


def test_init_from_refuses_a_head_of_another_shape_in_one_line(exports, tiny, tiny_llama_dir, narrow_target,
                                                               tmp_path):
    model, folder = tiny[0], exports["speculators"]
    where = f"error: head.init_from={str(folder)!r}"

    def refused(*overrides: str, head: str = "eagle3", target: Path = tiny_llama_dir) -> str:
        cfg = init_config(target, folder, *overrides, head=head)
        return user_error_line(lambda: build_trainee(cfg, model, None))

    assert refused("head.norm_output=false") == (
        f"{where}: its norm_output True != this run's False: add head.norm_output=true")
    assert refused("head.intermediate_size=32") == (
        f"{where}: its intermediate_size 128 != this run's 32: add head.intermediate_size=128")
    assert refused("head.aux_layer_ids=[1,3,5]") == (
        f"{where}: its aux_layer_ids [2, 4, 5] != this run's [1, 3, 5]: add head.aux_layer_ids=[2,4,5]")
    assert refused(head="peagle") == (
        f"{where}: a 'eagle3' head, and this run trains 'peagle': use +head=eagle3 to continue it")
    narrow = load_target(str(narrow_target))[0]
    cfg = init_config(narrow_target, folder)
    assert user_error_line(lambda: build_trainee(cfg, narrow, None)) == (
        f"{where}: a head for another target than {str(narrow_target)!r}: hidden_size 64 != 32; "
        "target_hidden_size 64 != 32")


@pytest.mark.parametrize("overrides, line", [
    (["head.norm_output=false"], "its norm_output True != this run's False: add head.norm_output=true"),
    (["head.intermediate_size=32"],
     "its intermediate_size 128 != this run's 32: add head.intermediate_size=128"),
    (["head.num_attention_heads=2"],
     "its num_attention_heads 4 != this run's 2: add head.num_attention_heads=4"),
    ([], None),  # the head's own shape: nothing refused
])
def test_init_from_mismatches_are_refused_from_the_targets_config_alone(overrides, line, exports,
                                                                         tiny_llama_dir):
    """`trainer.kinds.check_init_from` (what the main job runs before any data stage) refuses
    every field `init_trainee_head` would, from the target's config alone: no weights load."""
    folder = exports["speculators"]
    cfg = init_config(tiny_llama_dir, folder, *overrides)
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    if line is None:
        check_init_from(cfg, config)
        return
    assert user_error_line(lambda: check_init_from(cfg, config)) == (
        f"error: head.init_from={str(folder)!r}: {line}")


def test_a_training_run_starts_from_init_from_and_refuses_a_misfit_before_any_data(
    head_dir, exports, tiny_llama_dir, chat_file, tmp_path, monkeypatch
):
    import trainer.train as train_module

    folder = exports["speculators"]
    run_dir = tmp_path / "refused"
    # The second is a field the target's config alone does not decide: refused before data prep
    # all the same.
    for override, said in [
        ("head.aux_layer_ids=[1,3,5]",
         "its aux_layer_ids [2, 4, 5] != this run's [1, 3, 5]: add head.aux_layer_ids=[2,4,5]"),
        ("head.intermediate_size=32",
         "its intermediate_size 128 != this run's 32: add head.intermediate_size=128"),
    ]:
        cfg = tiny_run_config("eagle3", tiny_llama_dir, chat_file, run_dir, f"head.init_from={folder}",
                              override)
        assert user_error_line(lambda cfg=cfg: run(cfg)) == f"error: head.init_from={str(folder)!r}: {said}"
        assert not (run_dir.parent / "data-cache").exists(), "a data stage ran before the refusal"

    started = {}

    def spy(*args):
        trainee = build_trainee(*args)
        started["state"] = {k: v.clone() for k, v in trainee.head.state_dict().items()}
        return trainee

    monkeypatch.setattr(train_module, "build_trainee", spy)
    done = run(tiny_run_config("eagle3", tiny_llama_dir, chat_file, tmp_path / "run",
                               f"head.init_from={folder}", "optim.max_steps=2"))
    assert done["steps"] == 2
    _, _, trained = load_head(head_dir, "eagle3")
    assert all(torch.equal(started["state"][k], v) for k, v in trained.items())
