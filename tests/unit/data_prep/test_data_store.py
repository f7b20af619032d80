"""The data folder: atomic shards, resume after the last complete shard, manifest checks, Dataset."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from conf.errors import UserError
from data_prep.folders.store import (
    FORMAT_VERSION,
    CapturedDataset,
    check_target,
    finish,
    load_manifest,
    open_partial,
    write_split,
)
from data_prep.states.capture import encode
from trainer.batching import batch_loader

TARGET = {
    "name_or_path": "t",
    "tokenizer_hash": "abc",
    "vocab_size": 100,
    "hidden_size": 4,
    "num_hidden_layers": 2,
    "weights": "w1",
}


def make_shard(chunk: list[int], storage: str = "bfloat16") -> dict[str, torch.Tensor]:
    """A shard of samples of the given lengths, with hidden values that encode their position."""
    total = sum(chunk)
    rows = torch.arange(total, dtype=torch.float32).unsqueeze(1)
    return {
        "input_ids": torch.arange(total, dtype=torch.int32),
        "loss_mask": torch.arange(total) % 2 == 0,
        "offsets": torch.tensor([0] + chunk).cumsum(0),
        **encode("aux_hidden", rows.repeat(1, 12), 3, storage),
        **encode("final_hidden", rows.repeat(1, 4), 1, storage),
    }


def build(tmp_path, chunks, storage="bfloat16", calls=None):
    folder = tmp_path / "data"
    partial = open_partial(folder, {"plan": 1})

    def shard(chunk):
        if calls is not None:
            calls.append(chunk)
        return make_shard(chunk, storage)

    records = write_split(partial, "train", chunks, shard)
    splits = {"train": {"shards": records}}
    finish(partial, folder, {"format_version": FORMAT_VERSION, "target": TARGET, "splits": splits})
    return folder, records


def test_write_split_skips_complete_shards_and_records_checksums(tmp_path):
    partial = open_partial(tmp_path / "data", {"plan": 1})
    first = write_split(partial, "train", [[2, 3]], make_shard)
    (partial / "train" / ".shard-00001.safetensors.tmp-1").write_bytes(b"torn")  # a killed write
    calls = []
    again = open_partial(tmp_path / "data", {"plan": 1})
    records = write_split(again, "train", [[2, 3], [4]], lambda c: calls.append(c) or make_shard(c))
    assert calls == [[4]]  # shard 0 was complete and kept
    assert records[0] == first[0]
    assert [r["samples"] for r in records] == [2, 1] and records[1]["tokens"] == 4
    assert records[0]["masked_tokens"] == 3 and len(records[0]["sha256"]) == 64


def test_partial_folder_with_another_plan_is_started_over(tmp_path):
    partial = open_partial(tmp_path / "data", {"plan": 1})
    write_split(partial, "train", [[2]], make_shard)
    partial = open_partial(tmp_path / "data", {"plan": 2})
    assert not (partial / "train").exists()


@pytest.mark.parametrize("storage", ["bfloat16", "fp8"])
def test_dataset_items_and_lengths(tmp_path, storage):
    folder, _ = build(tmp_path, [[2, 3], [4]], storage)
    assert not (tmp_path / "data.partial").exists()
    ds = CapturedDataset(folder, "train")
    assert len(ds) == 3 and ds.lengths == [2, 3, 4]
    item = ds[1]
    assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == [2, 3, 4]
    assert item["loss_mask"].tolist() == [True, False, True]
    stored = torch.bfloat16 if storage == "bfloat16" else torch.float32  # fp8 is dequantised
    assert item["aux_hidden"].dtype == stored and item["aux_hidden"].shape == (3, 12)
    assert item["final_hidden"].shape == (3, 4)
    assert torch.allclose(item["final_hidden"][:, 0].float(), torch.tensor([2.0, 3.0, 4.0]), rtol=0.07)
    assert ds[2]["input_ids"].tolist() == [0, 1, 2, 3]  # the second shard starts afresh
    # Picklable for DataLoader workers even after handles were opened.
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[0]["aux_hidden"], ds[0]["aux_hidden"])


def test_manifest_checks(tmp_path):
    folder, _ = build(tmp_path, [[2]])
    with pytest.raises(UserError, match="split='test'"):
        CapturedDataset(folder, "test")
    with pytest.raises(UserError, match="no manifest.json"):
        load_manifest(tmp_path)
    manifest = load_manifest(folder)
    check_target(manifest, TARGET, "here")
    other = TARGET | {"name_or_path": "u", "hidden_size": 8, "weights": "w2"}
    with pytest.raises(UserError) as err:
        check_target(manifest, other, "data folder 'x'")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("data folder 'x': data was captured with target 't'")
    assert "hidden_size 4 != 8" in msg and "weights w1 != w2" in msg
    assert "vocab_size" not in msg
    (folder / "manifest.json").write_text(json.dumps({"format_version": 0}))
    with pytest.raises(UserError, match="format_version 0"):
        load_manifest(folder)


def test_loader_workers_give_the_in_process_batches(tmp_path):
    folder, _ = build(tmp_path, [[2, 3], [4]], "bfloat16")
    ds = CapturedDataset(folder, "train")
    order = [[2, 0], [1]]
    here, workers = list(batch_loader(ds, order, 0, False)), list(batch_loader(ds, order, 2, False))
    assert [b["input_ids"].shape for b in here] == [(2, 4), (1, 3)]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(here, workers, strict=True) for k in a)


def flip_last_byte(path) -> None:
    """One byte of the tensor data (the header, at the start, still parses)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_shard_is_caught_once_per_node_in_one_line(tmp_path, monkeypatch):
    """Ranks other than a node's first do not hash the shards (they read the same files); the
    first one does, and names the damaged file in one line."""
    folder, _ = build(tmp_path, [[2, 3], [4]])
    shard = folder / "train" / "shard-00001.safetensors"
    flip_last_byte(shard)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert len(CapturedDataset(folder, "train")) == 3  # not hashed here
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(UserError) as err:
        CapturedDataset(folder, "train")
    line = str(err.value)
    assert "\n" not in line and f"{shard} does not match its checksum in {folder / 'manifest.json'}" in line
    with pytest.raises(UserError, match="does not match its checksum"):
        CapturedDataset(folder, "train", verify=True)
