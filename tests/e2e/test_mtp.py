"""`python -m trainer.train +head=mtp` as users run it: refused in one line on a target without MTP
layers (the default SmolLM2), and the whole main job on a tiny DeepSeek-V3 target with its MTP
layer: data prep, training, the lossless evaluation beside the shipped layer, both exports."""

from __future__ import annotations

import json

import pytest

from heads.mtp.export import stitched_differences
from scripts.build_mtp_target import MTP
from tests.support.cli import run_train_cli
from tests.support.runs import tiny_run_args


def test_mtp_on_a_target_without_mtp_layers_is_one_line_before_anything_loads(tmp_path):
    proc = run_train_cli(["+head=mtp", f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: +head=mtp: the target (llama) has no multi-token-prediction layers to train; targets with "
        "them: deepseek_v3, glm4_moe (trained here), qwen3_next, qwen3_5, mimo (not yet); choose another "
        "head kind for this target"
    ]
    assert not (tmp_path / "cache").exists()  # no data stage ran


@pytest.mark.slow
def test_the_main_job_trains_evaluates_and_exports_an_mtp_layer(tiny_mtp_dir, chat_file, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_run_args("mtp", tiny_mtp_dir, chat_file, run_dir, "optim.max_steps=6",
                         "pipeline.evaluate=true", "pipeline.export=true", "eval.max_prompts_per_task=1",
                         "eval.max_new_tokens=24", "export.dtype=float32")
    proc = run_train_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert report["lossless"]
    assert report["overall"]["shipped_mean_acceptance_length"] >= 1.0
    stitched = run_dir / "export" / "mtp-stitched"
    diff = stitched_differences(tiny_mtp_dir, stitched)
    n = json.loads((tiny_mtp_dir / "config.json").read_text())["num_hidden_layers"]
    assert diff["missing"] == [] and diff["changed"]
    assert all(name.startswith(f"model.layers.{n}.") for name in diff["changed"])
    assert MTP not in diff["linked"] and "config.json" in diff["linked"]
    assert (run_dir / "export" / "mtp-speculators" / "model.safetensors").exists()
    assert '"method": "mtp"' in (stitched / "README.md").read_text()
