"""Online training (`data.hidden_states=online`): the data folder keeps ids and masks, the loop
runs the frozen target per batch, and the objective sees the very batch offline training reads,
so losses match step for step: in one process, in two (DDP) and across two "nodes" (two torchrun
launchers meeting at a c10d rendezvous). Also: `auto`, streaming data prep, no syncs."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import data_prep.prepare as P
from conf.errors import UserError
from conf.schema import (
    DataConfig,
    Eagle3Config,
    MedusaConfig,
)
from data_prep.capture import CaptureSpec, capture_batch
from data_prep.sources import iter_dataset
from data_prep.store import load_manifest
from data_prep.target import load_target
from tests.support.cli import run_train_cli
from tests.support.runs import (
    assert_online_batch_is_the_offline_batch,
    cfg_for,
    summary,
    tiny_run_args,
    train_losses,
)
from tests.support.syncs import assert_steps_never_sync, eagle3, medusa1, samples


def test_schema_refuses_an_unknown_mode():
    expected = r"^data.hidden_states='onlin': expected one of offline, online, auto$"
    with pytest.raises(UserError, match=expected):
        DataConfig(hidden_states="onlin")


def shard_tensors(folder: Path, split: str) -> list[dict[str, torch.Tensor]]:
    return [load_file(folder / s["file"]) for s in load_manifest(folder)["splits"][split]["shards"]]


def test_online_folder_keeps_tokens_only(tiny_llama_dir, chat_file, tmp_path):
    offline = P.prepare(cfg_for(tiny_llama_dir, chat_file, tmp_path))
    online = P.prepare(cfg_for(tiny_llama_dir, chat_file, tmp_path, hidden_states="online"))
    assert online != offline and online.parent == offline.parent
    m_off, m_on = load_manifest(offline), load_manifest(online)
    assert (m_off["hidden_states"], m_on["hidden_states"]) == ("offline", "online")
    # What the loop must compute is recorded as offline's is.
    keys = ("aux_layer_ids", "final_layer_id", "storage_dtype", "layer_convention", "draft_vocab")
    assert {k: m_on[k] for k in keys} == {k: m_off[k] for k in keys}
    for split in ("train", "validation"):
        off, on = shard_tensors(offline, split), shard_tensors(online, split)
        assert len(off) == len(on) > 0
        for a, b in zip(off, on):
            assert set(b) == {"input_ids", "loss_mask", "offsets"}
            assert all(torch.equal(a[k], b[k]) for k in b)  # same samples, same order
    tokens = sum(s["tokens"] for s in m_on["splits"].values())
    nbytes = sum(sh["bytes"] for s in m_on["splits"].values() for sh in s["shards"])
    assert nbytes / tokens <= 16
    vocab = "draft_vocab.safetensors"
    assert all(torch.equal(v, load_file(offline / vocab)[k]) for k, v in load_file(online / vocab).items())


@pytest.mark.parametrize("storage", ["bfloat16", "fp8"])
@pytest.mark.parametrize("head", [Eagle3Config(), MedusaConfig()], ids=["eagle3", "medusa"])
def test_online_batch_is_the_offline_batch(tiny_llama_dir, chat_file, tmp_path, storage, head):
    model, _ = load_target(str(tiny_llama_dir), device="cpu", num_threads=1)
    folders = {
        mode: P.prepare(
            cfg_for(tiny_llama_dir, chat_file, tmp_path, head, storage_dtype=storage, hidden_states=mode)
        )
        for mode in ("offline", "online")
    }
    assert_online_batch_is_the_offline_batch(folders["offline"], folders["online"], model)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("build", [eagle3, medusa1], ids=["eagle3", "medusa1"])
def test_online_training_steps_never_sync(tiny_llama_dir, build, tmp_path):
    """The loop's `train_step` with the target's forward inside it reads nothing back."""
    model, _ = load_target(str(tiny_llama_dir), device="cpu")
    torch.manual_seed(0)
    trainee, fields = build(model)
    aux = (2, 4, 5) if "aux_hidden" in fields else ()
    capture = partial(capture_batch, model, CaptureSpec(aux, model.config.num_hidden_layers))
    assert_steps_never_sync(trainee, samples(model, ()), tmp_path, capture)


@pytest.mark.parametrize("free_gib, chosen", [(1e-4, "online"), (1e4, "offline")])
def test_auto_chooses_by_free_disk(
    tiny_llama_dir, chat_file, tmp_path, monkeypatch, capsys, free_gib, chosen
):
    usage = type("Usage", (), {"free": int(free_gib * 2**30)})
    monkeypatch.setattr(P.shutil, "disk_usage", lambda path: usage)
    cfg = cfg_for(tiny_llama_dir, chat_file, tmp_path, MedusaConfig(), hidden_states="auto")
    folder = P.prepare(cfg)
    assert load_manifest(folder)["hidden_states"] == chosen
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("data.hidden_states=auto")]
    assert len(lines) == 1 and lines[0].startswith(f"data.hidden_states=auto: {chosen} (captured hidden")
    assert "x 128 bytes" in lines[0]  # Medusa-1: the final layer, 64 x 2 bytes per token
    # A built folder is reused as it is, whatever the disk says now.
    monkeypatch.setattr(P.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 0}))
    assert P.prepare(cfg) == folder
    assert f"data.hidden_states=auto: {chosen} (its data folder is built already)" in capsys.readouterr().out


def test_prepare_streams_and_tokenises_once(tiny_llama_dir, chat_file, tmp_path, monkeypatch):
    """Each sample is tokenised once, the source is read only as far as `max_samples` takes
    (a broken line after them is never seen), and no spill is left behind."""
    calls = Counter()
    real = P.conversation_turns

    def counted(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(P, "conversation_turns", counted)
    source = tmp_path / "chats.jsonl"
    source.write_text(chat_file.read_text() + "{not json\n")
    cfg = cfg_for(tiny_llama_dir, source, tmp_path / "cache", max_samples=40, hidden_states="online")
    folder = P.prepare(cfg)
    assert calls["n"] == 40
    assert sum(s["samples"] for s in load_manifest(folder)["splits"].values()) == 40
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_datasets_data_folder_is_streamed(chat_file, tmp_path, monkeypatch):
    """A folder of JSONL files read as a `datasets` source yields its rows without building an
    Arrow copy of them in the datasets cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    folder = tmp_path / "convs"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text(chat_file.read_text())
    rows = list(iter_dataset(str(folder), "train"))
    assert len(rows) == 64 and rows[0][0] == "0" and "messages" in rows[0][2]
    assert not list((tmp_path / "hf-cache").rglob("*.arrow"))


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
