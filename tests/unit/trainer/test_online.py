"""Online training (`data.hidden_states=online`): the data folder keeps ids and masks, the loop
runs the frozen target per batch, and the objective sees the very batch offline training reads,
so losses match step for step: in one process, in two (DDP) and across two "nodes" (two torchrun
launchers meeting at a c10d rendezvous). Also: `auto`, streaming data prep, no syncs."""

from __future__ import annotations

import shutil
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import data_prep.conversations.rows as rows
import data_prep.prepare as P
from conf.errors import UserError
from conf.schema import (
    DataConfig,
)
from data_prep.conversations.sources import iter_dataset
from data_prep.folders.store import load_manifest
from data_prep.states.capture import TOP, CaptureSpec, capture_batch
from tests.support.runs import (
    assert_online_batch_is_the_offline_batch,
    tiny_prep_config,
)
from tests.support.syncs import assert_steps_never_sync, eagle3, medusa1, samples


def test_schema_refuses_an_unknown_mode():
    expected = r"^data.hidden_states='onlin': expected one of offline, online, auto$"
    with pytest.raises(UserError, match=expected):
        DataConfig(hidden_states="onlin")


def shard_tensors(folder: Path, split: str) -> list[dict[str, torch.Tensor]]:
    return [load_file(folder / s["file"]) for s in load_manifest(folder)["splits"][split]["shards"]]


def test_online_folder_keeps_tokens_only(tiny_llama_dir, chat_file, tmp_path):
    offline = P.prepare(tiny_prep_config(tiny_llama_dir, chat_file, tmp_path)).path
    online_cfg = tiny_prep_config(tiny_llama_dir, chat_file, tmp_path, "data.hidden_states=online")
    online = P.prepare(online_cfg).path
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
@pytest.mark.parametrize("head", ["eagle3", "medusa"])
def test_online_batch_is_the_offline_batch(tiny_model, tiny_llama_dir, chat_file, tmp_path, storage, head):
    model = tiny_model
    folders = {
        mode: P.prepare(
            tiny_prep_config(
                tiny_llama_dir, chat_file, tmp_path, f"data.storage_dtype={storage}",
                f"data.hidden_states={mode}", head=head,
            )
        ).path
        for mode in ("offline", "online")
    }
    assert_online_batch_is_the_offline_batch(folders["offline"], folders["online"], model)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("build", [eagle3, medusa1], ids=["eagle3", "medusa1"])
def test_online_training_steps_never_sync(tiny_model, build, tmp_path):
    """The loop's `train_step` with the target's forward inside it reads nothing back."""
    model = tiny_model
    torch.manual_seed(0)
    trainee, fields = build(model)
    aux = (2, 4, 5) if "aux_hidden" in fields else ()
    spec = CaptureSpec(aux, model.config.num_hidden_layers, target_top=TOP in fields)
    capture = partial(capture_batch, model, spec)
    assert_steps_never_sync(trainee, samples(model, ()), tmp_path, capture)


@pytest.mark.parametrize("free_gib, chosen", [(1e-4, "online"), (1e4, "offline")])
def test_auto_chooses_by_free_disk(
    tiny_llama_dir, chat_file, tmp_path, monkeypatch, capsys, free_gib, chosen
):
    usage = type("Usage", (), {"free": int(free_gib * 2**30)})
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    cfg = tiny_prep_config(tiny_llama_dir, chat_file, tmp_path, "data.hidden_states=auto", head="medusa")
    folder = P.prepare(cfg).path
    assert load_manifest(folder)["hidden_states"] == chosen
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("data.hidden_states=auto")]
    assert len(lines) == 1 and lines[0].startswith(f"data.hidden_states=auto: {chosen} (captured hidden")
    assert "x 128 bytes" in lines[0]  # Medusa-1: the final layer, 64 x 2 bytes per token
    # A built folder is reused as it is, whatever the disk says now.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: type("Usage", (), {"free": 0}))
    assert P.prepare(cfg).path == folder
    assert f"data.hidden_states=auto: {chosen} (its data folder is built already)" in capsys.readouterr().out


def test_prepare_streams_and_tokenises_once(tiny_llama_dir, chat_file, tmp_path, monkeypatch):
    """Each sample is tokenised once, the source is read only as far as `max_samples` takes
    (a broken line after them is never seen), and no spill is left behind."""
    calls = Counter()
    real = rows.conversation_turns

    def counted(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(rows, "conversation_turns", counted)
    source = tmp_path / "chats.jsonl"
    source.write_text(chat_file.read_text() + "{not json\n")
    cfg = tiny_prep_config(
        tiny_llama_dir, source, tmp_path / "cache", "data.max_samples=40", "data.hidden_states=online"
    )
    folder = P.prepare(cfg).path
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


