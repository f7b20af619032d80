"""The trainer as users run it: the Hydra command line, 2 real CPU processes (DDP and DeepSpeed
ZeRO-2 and ZeRO-3 over gloo), exact resume after SIGKILL, and one-line errors for bad overrides."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.cli import cli_env, free_port, run_train_cli
from tests.support.runs import QUICK, summary, tiny_run_args, train_losses
from trainer.loop import HISTORY


def train_args(target: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return tiny_run_args(
        "eagle3", target, data, run_dir, "data.draft_vocab_size=400", "head.ttt_length=3", *extra
    )


def test_single_process_trains_and_loss_falls(sharp_target, chat_file, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train_cli(train_args(sharp_target, chat_file, run_dir, "optim.max_steps=16"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    assert s["steps"] == 16 and (run_dir / "head" / "model.safetensors").exists()
    assert 0 < s["data_wait_fraction"] < 1 and "% waiting for data)" in proc.stdout
    losses = train_losses(run_dir)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def two_processes() -> list[str]:
    """torchrun starting 2 CPU ranks on a port of their own."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port())]


DIST_SETTINGS = """
import json
import sys
import torch
import torch.distributed as dist
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from conf.schema import DistConfig, OptimConfig
from trainer.distributed import build_accelerator, prepare

class Probe(torch.nn.Module):  # a trained layer beside a head's rotary frequencies
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=32, num_attention_heads=2))

    def forward(self, x):
        self.autocast = str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None
        return self.linear(x).float().sum()

cfg = DistConfig(strategy=sys.argv[1], zero_stage=int(sys.argv[2]), timeout_min=77, mixed_precision="bf16")
acc = build_accelerator(cfg, OptimConfig(), sys.argv[3])
probe = Probe()
model, _ = prepare(acc, cfg, probe, torch.optim.AdamW(probe.parameters()))
model(torch.ones(2, 8, dtype=torch.bfloat16 if cfg.strategy == "deepspeed" else torch.float32))
group = dist.distributed_c10d._get_default_group()
print(json.dumps({"timeout_s": group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
                  "broadcast_buffers": getattr(model, "broadcast_buffers", None),
                  "autocast": probe.autocast, "inv_freq": str(probe.rotary.inv_freq.dtype)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy, stage", [("ddp", 0), ("deepspeed", 2)])
def test_dist_settings_reach_every_rank(tmp_path, strategy, stage):
    """Under DDP and DeepSpeed alike, on every rank:
    - `dist.timeout_min` is the default group's timeout (DeepSpeed starts the group itself): NCCL's
      default 10 minutes aborted jobs in which one rank works alone. gloo here; the same handler
      carries it to NCCL.
    - the step's forward runs under the same bf16 autocast: accelerate enters none under
      DeepSpeed (`trainer.distributed.own_autocast`), and rotary frequencies stay float32.
    - DDP broadcasts no buffer at each forward: every rank holds the same constants."""
    script = tmp_path / "dist_settings.py"
    script.write_text(DIST_SETTINGS)
    cmd = [*two_processes()[:-2], "--master_port", str(free_port()), str(script), strategy, str(stage),
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    # one JSON object per rank; two ranks writing at once may share a line
    ranks = [json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", proc.stdout)]
    assert ranks == 2 * [{"timeout_s": 77 * 60.0, "broadcast_buffers": False if strategy == "ddp" else None,
                          "autocast": "torch.bfloat16", "inv_freq": "torch.float32"}], proc.stdout


@pytest.mark.slow
def test_zero3_trains_resumes_and_evaluates_losslessly(sharp_target, chat_file, tmp_path):
    """ZeRO-3 shards the head only: the frozen target loads whole, outside DeepSpeed's
    partitioning context (under it, its embedding came back an empty placeholder and the first
    forward failed), the kept head's weights are gathered to 16 bits on save, a run resumed from
    its middle checkpoint retraces the uninterrupted one's losses, and rank 0 evaluates."""
    steps = ("dist=zero3", "optim.max_steps=6", "optim.save_every=3", "optim.val_every=3")
    straight = tmp_path / "straight"
    proc = run_train_cli(train_args(sharp_target, chat_file, straight, *steps), launcher=two_processes())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(straight)["world_size"] == 2
    assert (straight / "head" / "model.safetensors").exists()
    # decoded validation's default turns itself off under ZeRO-3, in one line, rank 0's
    off = [x for x in proc.stdout.splitlines() if x.startswith("decoded validation off (rank 0 decodes")]
    assert len(off) == 1 and summary(straight)["select_by"] == "simulated"

    resumed = tmp_path / "resumed"
    kept = resumed / "checkpoints" / "step-0000003"
    shutil.copytree(straight / "checkpoints" / "step-0000003", kept)
    history = json.loads((kept / HISTORY).read_text())
    history[0]["loss"] = 99.0  # a mark: steps up to 3 come from the checkpoint, not trained again
    (kept / HISTORY).write_text(json.dumps(history))
    evaluate = ("pipeline.evaluate=true", *QUICK, "resume=true")
    proc = run_train_cli(train_args(sharp_target, chat_file, resumed, *steps, *evaluate),
                         launcher=two_processes())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_losses(resumed) == [99.0, *train_losses(straight)[1:]]
    assert json.loads((resumed / "eval" / "eval.json").read_text())["lossless"] is True


@pytest.mark.slow
@pytest.mark.parametrize("hidden_states", ["offline", "online"])
def test_resume_after_sigkill_matches_uninterrupted(sharp_target, chat_file, tmp_path, hidden_states):
    steps = ("optim.max_steps=12", "optim.save_every=3", "optim.val_every=100")
    extra = (*steps, f"data.hidden_states={hidden_states}")
    straight = tmp_path / "straight"
    assert run_train_cli(train_args(sharp_target, chat_file, straight, *extra)).returncode == 0

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "trainer.train", *train_args(sharp_target, chat_file, killed, *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step-0000006").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "summary.json").exists(), "the run finished before it could be killed"
    resumed = run_train_cli(train_args(sharp_target, chat_file, killed, *extra, "resume=true"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "lr_scheduler.step()" not in resumed.stderr  # the schedule replay stays quiet

    final = "checkpoints/step-0000012/model.safetensors"
    a, b = load_file(straight / final), load_file(killed / final)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The resumed run's curve holds the steps before the kill too.
    assert train_losses(killed) == train_losses(straight)


@pytest.mark.parametrize(
    "overrides, expected",
    [("optim.no_such_key=1", "optim.no_such_key"), ("resume=true", "resume=true")],
    ids=["composing", "starting"],
)
def test_bad_overrides_are_one_line_before_loading(overrides, expected, tmp_path):
    """A mistake found composing the command line and one found as the run starts, as users see
    them (tests/unit/trainer/test_train.py holds the whole list, in process): one line, exit 2,
    nothing after it (no Hydra hint), nothing touched."""
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    args = ["+head=eagle3", overrides, f"run_dir={run_dir}", "logging.progress=false"]
    env = {**os.environ, "DRAFTSMITH_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", *args], capture_output=True, text=True, env=env, timeout=120
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert proc.stdout == ""
    assert not cache.exists() and not (run_dir / "summary.json").exists()


def saved_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint: accelerate's safetensors file, or under DeepSpeed its
    own model states, with ZeRO's frozen fragments (None where it wrote none)."""
    if (checkpoint / "model.safetensors").exists():
        return load_file(checkpoint / "model.safetensors")
    states = torch.load(checkpoint / "pytorch_model" / "mp_rank_00_model_states.pt", weights_only=False)
    return {**states["module"], "frozen_param_fragments": states.get("frozen_param_fragments")}


@pytest.mark.slow
@pytest.mark.parametrize("dist", ["ddp", "zero2"])
def test_two_cpu_processes_agree_and_resume_exactly(sharp_target, chat_file, tmp_path, dist):
    """Two ranks train one head (their replicas agree, the loss falls). Under DDP accelerate
    writes the wrapped model's state, under DeepSpeed its own model states: neither holds a
    frozen table (nor ZeRO's frozen fragments), and a run resumed from its step-3 checkpoint, its
    frozen tables rebuilt from the target, ends where the whole run did."""
    run_dir = tmp_path / "run"
    launcher = two_processes()
    args = train_args(sharp_target, chat_file, run_dir, f"dist={dist}", "optim.max_steps=6",
                      "optim.save_every=3", "optim.val_every=100")
    proc = run_train_cli(args, launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    assert s["world_size"] == 2
    assert s["select_by"] == "decoded" and s["between_steps"]["decoded_validations"] == 1  # rank 0 decodes
    a, b = s["replica_checksums"]
    assert a == b and a != 0.0
    losses = train_losses(run_dir)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    last = run_dir / "checkpoints" / "step-0000006"
    whole = saved_model(last)
    assert not [k for k in whole if "embed_tokens" in k] and [k for k in whole if "fc.weight" in k]
    assert whole.pop("frozen_param_fragments", None) is None
    shutil.rmtree(last)
    resumed = run_train_cli([*args, "resume=true"], launcher=launcher)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = saved_model(last)
    again.pop("frozen_param_fragments", None)
    assert again.keys() == whole.keys()
    for k, v in whole.items():
        assert torch.equal(again[k], v), k
