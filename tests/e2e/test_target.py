"""Targets from the command line and the embedded aliases: a bad target is one line, SmolLM2 and
Qwen2.5-Coder are cached, converted and coherent, and Qwen2.5-Coder's main job runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from data_prep.target import load_target, resolve_target_path
from tests.support.cli import cli_env, free_port
from tests.support.targets import QWEN_CODER


def needs_qwen() -> None:
    """Skip where the second embedded target's six packages are not installed (CI does not
    install them: 0.5 GB)."""
    from conf.files import installed
    from data_prep.target import ALIASES

    missing = [d for d, _ in ALIASES[QWEN_CODER].parts if not installed(d)]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} ({ALIASES[QWEN_CODER].install})")


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


@pytest.mark.slow
def test_qwen_coder_alias_is_joined_converted_and_coherent():
    needs_qwen()
    model, tok = load_target(QWEN_CODER)
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


CONVERT_ON_RANK_1 = """
import os
from data_prep.conversations.ranks import Ranks
from data_prep.target import load_target, resolve_target_path
ranks = Ranks.from_env()
if ranks.rank == 1:  # the rank that holds the conversion lock first, with the process group up
    path = resolve_target_path("smollm2-135m-instruct")
    model, _ = load_target(path)
    print("converted", sorted(os.listdir(path)), model.config.model_type)
ranks.barrier()
ranks.close()
"""


@pytest.mark.slow
def test_a_rank_other_than_0_converts_the_embedded_gguf(tmp_path):
    """Under torchrun whichever rank takes the conversion lock converts the GGUF; transformers
    writes a model's weights from rank 0 alone once a process group exists, and rank 1's folder
    came out without config or weights (the main job's first run from a cold cache failed)."""
    script = tmp_path / "convert.py"
    script.write_text(CONVERT_ON_RANK_1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=cli_env(DRAFTSMITH_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("converted")]
    assert "'config.json'" in line and "'model.safetensors'" in line and line.endswith("llama")
