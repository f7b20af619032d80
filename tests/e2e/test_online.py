"""Online hidden states from the command line: one process online trains as offline does, and
two "nodes" (two torchrun launchers at a c10d rendezvous) online as two-process DDP offline."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from data_prep.folders.store import load_manifest
from tests.support.cli import run_train_cli
from tests.support.runs import (
    summary,
    tiny_run_args,
    train_losses,
)


def assert_same_training(offline: Path, online: Path, steps: int) -> None:
    """Per-step losses that agree (every step logged), a falling loss, replicas that agree, and
    the summary naming the mode and the prepared splits' tokens.

    Not bit for bit: capture pads a batch to its longest sample and training groups samples
    otherwise, so the target's float32 attention reduces over differently blocked keys and about
    one stored value in 10^5 rounds to the neighbouring bf16 value (where the paddings agree,
    `test_online_batch_is_the_offline_batch` is bit-exact). The losses then drift apart by ~1e-4
    of their value over 20 steps; a wrong layer, sample or mask differs by orders more."""
    a, b = train_losses(offline), train_losses(online)
    assert len(a) == len(b) == steps
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b)) <= 5e-4, (a, b)
    assert b[-1] < b[0]
    s_off, s_on = summary(offline), summary(online)
    assert (s_off["hidden_states"], s_on["hidden_states"]) == ("offline", "online")
    manifest = load_manifest(s_on["data_dir"])
    tokens = sum(v["tokens"] for v in manifest["splits"].values())
    assert s_off["data_tokens"] == s_on["data_tokens"] == tokens
    # Each run's ranks hold one head (the weights of the two modes differ by that rounding).
    assert len(set(s_on["replica_checksums"])) == len(set(s_off["replica_checksums"])) == 1


HEAD_ARGS = {"eagle3": ("head.ttt_length=3", "data.draft_vocab_size=400"), "medusa": ("head.num_heads=2",)}


STEPS = ("optim.max_steps=20", "optim.val_every=10", "logging.log_every=1")


@pytest.mark.parametrize("head", ["eagle3", pytest.param("medusa", marks=pytest.mark.slow)])
def test_one_process_online_equals_offline(sharp_target, chat_file, tmp_path, head):
    runs = {mode: tmp_path / mode for mode in ("offline", "online")}
    for mode, run_dir in runs.items():
        args = tiny_run_args(head, sharp_target, chat_file, run_dir, *HEAD_ARGS[head], *STEPS)
        proc = run_train_cli([*args, f"data.hidden_states={mode}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_training(runs["offline"], runs["online"], 20)
    # The target is in no checkpoint: the online one holds what the offline one holds.
    final = "checkpoints/step-0000020/model.safetensors"
    assert load_file(runs["online"] / final).keys() == load_file(runs["offline"] / final).keys()


@pytest.mark.slow
def test_two_nodes_online_equal_two_process_ddp_offline(sharp_target, chat_file, tmp_path):
    """DDP over 2 processes: offline from one launcher, online from two launchers that meet as two
    nodes (`--nnodes 2 --node_rank {0,1}`, c10d rendezvous on 127.0.0.1, gloo)."""
    runs = {mode: tmp_path / mode for mode in ("offline", "online")}
    args = {
        mode: tiny_run_args("eagle3", sharp_target, chat_file, run_dir, *HEAD_ARGS["eagle3"], *STEPS,
                            "dist=ddp", f"data.hidden_states={mode}")
        for mode, run_dir in runs.items()
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    port = 29500 + random.randint(0, 400)
    one_node = [*torchrun, "--nproc_per_node", "2", "--master_port", str(port)]
    proc = run_train_cli(args["offline"], launcher=one_node)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [*torchrun, "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port + 1}",
             "-m", "trainer.train", *args["online"]],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        _, err = node.communicate(timeout=600)
        assert node.returncode == 0, err[-3000:]
    assert summary(runs["online"])["world_size"] == summary(runs["offline"])["world_size"] == 2
    assert_same_training(runs["offline"], runs["online"], 20)
