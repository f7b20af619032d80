"""Target loading: the embedded SmolLM2 alias end to end, and one-line errors for bad values."""

from __future__ import annotations

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
