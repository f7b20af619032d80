"""`prepare(cfg)` end to end on a tiny target: what each head gets, caching, refusal, the CLI."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from conf.errors import UserError
from data_prep.folders import build, keys, store
from data_prep.folders.keys import folder_key, regen_cache_file
from data_prep.folders.store import CapturedDataset, load_manifest, sha256_file
from data_prep.folders.vocab import load_draft_vocab
from data_prep.prepare import capture_spec, prepare
from data_prep.states.capture import TOP
from data_prep.target import resolve_target
from heads.eagle3.model import Eagle3Head
from heads.kinds import head_kind
from tests.support.runs import WORDS, conversations, tiny_prep_config
from tests.support.targets import build_tiny_target
from tests.support.templates import TEMPLATES


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in conversations(24)))
    return path


# Regeneration, where a test turns it on, answers in 6 tokens, 4 prompts at a time.
REGENERATE = (
    "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=6", "data.regenerate.batch_size=4"
)


def test_eagle3_folder_manifest_dataset_and_vocab(tiny_model, tiny_llama_dir, source, tmp_path, capsys):
    cfg = tiny_prep_config(tiny_llama_dir, source, tmp_path)
    data = prepare(cfg)
    folder, m = data.path, load_manifest(data.path)
    assert data.manifest == m and data.samples == 24 and data.capture_tokens_per_s > 0
    assert m["layer_convention"] == "hf_hidden_states"
    assert m["aux_layer_ids"] == [2, 4, 5] and m["final_layer_id"] == 8
    assert m["storage_dtype"] == "bfloat16" and m["target_top"]
    assert {k: m["target"][k] for k in ("vocab_size", "hidden_size", "num_hidden_layers")} == {
        "vocab_size": 49152,
        "hidden_size": 64,
        "num_hidden_layers": 8,
    }
    train, val = m["splits"]["train"], m["splits"]["validation"]
    assert train["samples"] + val["samples"] == 24 and val["samples"] > 0
    assert data.splits["train"].masked_tokens == train["masked_tokens"] > 0
    for shard in train["shards"] + val["shards"]:
        assert sha256_file(folder / shard["file"]) == shard["sha256"]
    ds = CapturedDataset(folder, "train")
    assert len(ds) == train["samples"] and ds.lengths == sorted(ds.lengths)
    item = ds[0]
    assert item["aux_hidden"].shape == (ds.lengths[0], 3 * 64)
    assert item["final_hidden"].shape == (ds.lengths[0], 64)
    assert item[TOP].shape == (ds.lengths[0],) and item[TOP].dtype == torch.int32
    assert 0 < int(item["loss_mask"].sum()) < ds.lengths[0]
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("data: 24 samples") and "bytes/token" in summary
    assert "tokens/s" in summary and "coverage 1.0000" in summary

    d2t, t2d = load_draft_vocab(folder)
    assert d2t.numel() == int(t2d.sum()) <= 300  # capped, and only ids the answers contain
    assert m["draft_vocab"]["size"] == d2t.numel()
    model = tiny_model
    head = Eagle3Head.from_target(model, str(tiny_llama_dir), cfg.head, d2t, t2d)
    assert head.aux_layer_ids == m["aux_layer_ids"]

    # A second call reuses the folder without touching it.
    mtime = (folder / "manifest.json").stat().st_mtime_ns
    assert prepare(cfg).path == folder
    assert (folder / "manifest.json").stat().st_mtime_ns == mtime
    assert "reused" in capsys.readouterr().out


def test_a_folder_of_the_previous_format_is_refused_and_built_anew(
    tiny_llama_dir, source, tmp_path, monkeypatch
):
    """Format 3 shards lack the target's top-1: such a folder is refused by its path, in one line,
    and a run with the same config builds the new folder beside it (its key names the format),
    once."""
    cfg = tiny_prep_config(tiny_llama_dir, source, tmp_path)
    with monkeypatch.context() as m:
        for module in (store, build, keys):
            m.setattr(module, "FORMAT_VERSION", 3)
        old = prepare(cfg).path
    with pytest.raises(UserError) as err:
        CapturedDataset(old, "train")
    message = str(err.value)
    assert "\n" not in message and "format_version 3, expected 4; delete the folder" in message
    new = prepare(cfg).path
    assert new != old and new.parent == old.parent and (old / "manifest.json").exists()
    assert load_manifest(new)["format_version"] == 4 and TOP in CapturedDataset(new, "train")[0]
    assert prepare(cfg).path == new  # reused from now on


def test_medusa_final_only_joint_tokens_only_and_fp8(tiny_llama_dir, source, tmp_path):
    final = prepare(tiny_prep_config(tiny_llama_dir, source, tmp_path, head="medusa")).path
    item = CapturedDataset(final, "train")[0]
    assert set(item) == {"input_ids", "loss_mask", "final_hidden"}  # no top-1: Medusa needs none
    assert not load_manifest(final)["target_top"]
    assert not (final / "draft_vocab.safetensors").exists()
    joint = prepare(tiny_prep_config(tiny_llama_dir, source, tmp_path, "head.joint=true", head="medusa")).path
    assert set(CapturedDataset(joint, "train")[0]) == {"input_ids", "loss_mask"}
    assert load_manifest(joint)["final_layer_id"] is None

    bf16 = prepare(tiny_prep_config(tiny_llama_dir, source, tmp_path)).path
    fp8 = prepare(tiny_prep_config(tiny_llama_dir, source, tmp_path, "data.storage_dtype=fp8")).path
    assert len({final, joint, bf16, fp8}) == 4
    a, b = CapturedDataset(bf16, "train")[3], CapturedDataset(fp8, "train")[3]
    scale = a["aux_hidden"].abs().max()
    assert (a["aux_hidden"] - b["aux_hidden"]).abs().max() < 0.1 * scale

    def nbytes(folder):
        return sum(s["bytes"] for s in load_manifest(folder)["splits"]["train"]["shards"])

    assert nbytes(fp8) < 0.6 * nbytes(bf16)


def test_long_samples_truncated_and_counted(tiny_llama_dir, source, tmp_path):
    data = prepare(tiny_prep_config(tiny_llama_dir, source, tmp_path, "data.max_length=46"))
    assert data.stats.truncated == load_manifest(data.path)["stats"]["truncated"] == 24  # 48..56 tokens
    assert max(CapturedDataset(data.path, "train").lengths) == 46


def test_regenerated_answers_are_cached_across_sizes(tiny_llama_dir, tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n" for w in WORDS))
    data = prepare(tiny_prep_config(tiny_llama_dir, src, tmp_path / "c", *REGENERATE, "data.max_samples=6"))
    assert data.stats.regenerated_tokens > 0 and data.regenerate_tokens_per_s > 0
    bigger = prepare(tiny_prep_config(tiny_llama_dir, src, tmp_path / "c", *REGENERATE, "data.max_samples=8"))
    assert bigger.path != data.path and bigger.stats.regenerated_from_cache == 6
    assert bigger.splits["train"].samples > 0


def test_bf16_gemms_key_their_own_answers_and_folders(tiny_llama_dir, source, tmp_path):
    """data.matmul_dtype=bfloat16 writes other answers and hidden states: other cache file and
    folder, both keys naming the precision."""
    own, bf16 = (
        tiny_prep_config(tiny_llama_dir, source, tmp_path, f"data.matmul_dtype={m}")
        for m in ("target", "bfloat16")
    )
    target = resolve_target(own)
    identity, tpl = target.identity, target.chat_template

    def key(cfg):
        return folder_key(cfg, identity, tpl, capture_spec(cfg, head_kind(cfg.head.name), 8), 300)

    assert key(own)["matmul_dtype"] == "torch.float32"
    assert key(bf16)["matmul_dtype"] == "torch.bfloat16"
    assert regen_cache_file(own, identity, tpl) != regen_cache_file(bf16, identity, tpl)
    # A bf16 target (its matmuls its own dtype) answers neither like a float32 one nor like a
    # float32 one with bf16 matmuls: its own keys.
    half = dataclasses.replace(own, target=dataclasses.replace(own.target, dtype="bfloat16"))
    files = {regen_cache_file(c, identity, tpl) for c in (own, bf16, half)}
    assert len(files) == 3 and key(half)["dtype"] == "torch.bfloat16"
    folder = prepare(bf16)
    assert folder.manifest["matmul_dtype"] == "bfloat16" and folder.path != prepare(own).path
    assert prepare(own).manifest["matmul_dtype"] == "float32"


def test_data_from_another_target_is_refused(smol_tokenizer, source, tmp_path):
    target = build_tiny_target(tmp_path / "target", "llama", smol_tokenizer, seed=0)
    cfg = tiny_prep_config(target, source, tmp_path / "cache", head="medusa")
    folder = prepare(cfg).path
    build_tiny_target(target, "llama", smol_tokenizer, seed=1)  # new weights, same path
    with pytest.raises(UserError) as err:
        prepare(cfg)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"data folder {str(folder)!r}: data was captured")
    assert "weights" in msg


MIXTRAL = str(TEMPLATES / "mixtral-8x7b-instruct-v0.1.jinja")


@pytest.mark.skipif(not os.path.exists(MIXTRAL), reason="the shared chat templates are absent")
def test_conversations_the_template_refuses_are_counted_and_most_refused_is_one_line(
    tiny_llama_dir, tmp_path, capsys
):
    """Mixtral's template refuses a system message ("roles must alternate"): such conversations
    are skipped, named once and counted in the manifest; a source where most turns are refused
    stops with one line naming the template and the first bad row."""
    rows = conversations(6)
    for r in rows[:2]:
        r["conversations"].insert(0, {"from": "system", "value": "Be brief."})
    src = tmp_path / "some.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare(tiny_prep_config(tiny_llama_dir, src, tmp_path / "c", f"data.chat_template={MIXTRAL}"))
    stats = data.stats
    assert stats.conversations_refused_by_template == 2 and stats.turns_dropped_refused == 2
    out = capsys.readouterr().out
    assert out.count("refuses") == 1 and f"{src}:1: Conversation roles must alternate" in out
    assert "conversations_refused_by_template=2" in out  # the prepare summary line
    for r in rows[2:5]:
        r["conversations"].insert(0, {"from": "system", "value": "Be brief."})
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    most = r"mixtral.*5 of 6 assistant turns could not be trained \(first at .*some.jsonl:1"
    with pytest.raises(UserError, match=most):
        prepare(tiny_prep_config(tiny_llama_dir, src, tmp_path / "c", f"data.chat_template={MIXTRAL}"))


def test_max_length_past_the_targets_context_is_one_line(tiny_llama_dir, source, tmp_path):
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(tiny_llama_dir).max_position_embeddings
    cfg = tiny_prep_config(tiny_llama_dir, source, tmp_path, f"data.max_length={context + 1}")
    line = rf"^data\.max_length={context + 1}: the target holds {context} positions"
    with pytest.raises(UserError, match=line):
        prepare(cfg)
    assert not list(tmp_path.rglob("manifest.json"))
    assert prepare(tiny_prep_config(tiny_llama_dir, source, tmp_path, f"data.max_length={context}")).samples
