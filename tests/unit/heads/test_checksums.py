"""Content checks: a data folder's shards and draft vocabulary, and a head's weights, carry a
sha256 that is checked where they are opened; a flipped byte is one line naming the file and the
command that rebuilds it, through the commands a user runs (in process)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conf.errors import UserError
from conf.files import check_sha256, sha256_file
from conf.schema import RootConfig
from heads.export.__main__ import main as export_main
from heads.export.write import export_head
from heads.folder import CHECKSUM, CONFIG_NAME, WEIGHTS_NAME, load_head, save_head
from tests.support.runs import data_folder, tiny_run_config, user_error_line
from trainer.evaluate.__main__ import main as evaluate_main
from trainer.train import run


def eagle3_run(target: Path, data: Path, run_dir: Path, *extra: str) -> RootConfig:
    return tiny_run_config("eagle3", target, data, run_dir, "data.draft_vocab_size=400", *extra)


@pytest.fixture(scope="module")
def trained(sharp_target, chat_file, tmp_path_factory) -> Path:
    """A finished tiny run: its data cache (`data-cache/<key>`) and its head (`run/head`)."""
    base = tmp_path_factory.mktemp("trained")
    run(eagle3_run(sharp_target, chat_file, base / "run", "optim.max_steps=2"))
    return base


def flip_byte(path: Path) -> None:
    """One byte in the middle of the file (inside the tensor data: the file still parses)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_prepare_records_every_file_it_writes(trained):
    folder = data_folder(trained / "data-cache")
    manifest = json.loads((folder / "manifest.json").read_text())
    records = [manifest["draft_vocab"]] + [
        shard for split in manifest["splits"].values() for shard in split["shards"]
    ]
    assert {r["file"] for r in records} >= {"draft_vocab.safetensors", "train/shard-00000.safetensors"}
    for r in records:
        assert sha256_file(folder / r["file"]) == r["sha256"], r["file"]


@pytest.mark.parametrize("name", ["train/shard-00000.safetensors", "draft_vocab.safetensors"])
def test_training_refuses_a_flipped_byte_in_the_data(trained, sharp_target, chat_file, tmp_path, name):
    """The data folder is reused as it is (its key is unchanged), and opening it for training
    finds the damaged file before a step is taken."""
    shutil.copytree(trained / "data-cache", tmp_path / "data-cache")
    folder = data_folder(tmp_path / "data-cache")
    flip_byte(folder / name)
    run_dir = tmp_path / "run"
    line = user_error_line(lambda: run(eagle3_run(sharp_target, chat_file, run_dir, "optim.max_steps=2")))
    assert f"{folder / name} does not match its checksum in {folder / 'manifest.json'}" in line
    assert f"rm -r {folder} && python -m data_prep.prepare" in line
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "head").exists()


def copy_head(trained: Path, to: Path) -> Path:
    shutil.copytree(trained / "run" / "head", to)
    return to


def exit_line(main: Callable[[list[str]], None], argv: list[str], capsys) -> str:
    """The one line a command's `main` prints as it exits 2, in process."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("command", [export_main, evaluate_main], ids=["heads.export", "trainer.evaluate"])
def test_commands_refuse_a_flipped_byte_in_a_head(trained, tmp_path, capsys, command):
    """Refused before any target is looked at (the one given does not exist), nothing written."""
    head = copy_head(trained, tmp_path / "run" / "head")
    flip_byte(head / WEIGHTS_NAME)
    argv = [f"head={head}", f"target.name_or_path={tmp_path / 'none'}"]
    argv += [f"out={tmp_path / 'exported'}"] if command is export_main else []
    line = exit_line(command, argv, capsys)
    assert f"{head / WEIGHTS_NAME} does not match its checksum in {head / CONFIG_NAME}" in line
    assert "python -m trainer.train" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def nan_head(trained: Path, to: Path) -> Path:
    """The trained head with one NaN weight, saved the normal way (a valid checksum)."""
    head = copy_head(trained, to)
    meta = json.loads((head / CONFIG_NAME).read_text())
    _, spec, tensors = load_head(head, "eagle3")
    tensors["fc.weight"][0, 0] = float("nan")
    return save_head(head, "eagle3", meta["config"], spec, tensors)


def test_export_and_push_refuse_a_head_with_non_finite_weights(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    head = nan_head(trained, tmp_path / "run" / "head")
    argv = [f"head={head}", "format=eagle3", f"out={tmp_path / 'exported'}"]
    argv.append("push_to_hub=nobody/never-pushed")
    line = exit_line(export_main, argv, capsys)
    assert f"{head / WEIGHTS_NAME} holds non-finite weights (1 tensor(s), first fc.weight)" in line
    assert "not evaluated, exported or pushed" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_evaluate_refuses_a_head_with_non_finite_weights(trained, tmp_path):
    """In process, through the evaluator's own loader (trainer.train evaluates this way)."""
    from data_prep.target import load_target
    from trainer.evaluate.run import load_drafter

    head = nan_head(trained, tmp_path / "head")
    meta = json.loads((head / CONFIG_NAME).read_text())
    model, _ = load_target(meta["target"]["name_or_path"], num_threads=1)
    with pytest.raises(UserError, match="holds non-finite weights"):
        load_drafter(head, model, meta["target"]["name_or_path"], [])


def test_a_head_saved_before_checksums_still_loads_and_exports(trained, tmp_path):
    head = copy_head(trained, tmp_path / "head")
    meta = json.loads((head / CONFIG_NAME).read_text())
    del meta[CHECKSUM]
    (head / CONFIG_NAME).write_text(json.dumps(meta))
    load_head(head, "eagle3")
    out, report = export_head(head, "eagle3", tmp_path / "exported")
    assert report["outputs_identical"] and (out / "model.safetensors").exists()


def test_a_malformed_checksum_field_is_one_line(trained, tmp_path):
    head = copy_head(trained, tmp_path / "head")
    meta = json.loads((head / CONFIG_NAME).read_text())
    (head / CONFIG_NAME).write_text(json.dumps(meta | {CHECKSUM: 12}))
    with pytest.raises(UserError, match=f"'{CHECKSUM}' must be a sha256 hex digest"):
        load_head(head, "eagle3")


def test_a_file_is_hashed_once_per_process_until_it_changes(tmp_path, monkeypatch):
    import conf.files

    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 1000)
    digest = sha256_file(path)
    calls = []
    monkeypatch.setattr(conf.files, "sha256_file", lambda p: calls.append(p) or digest)
    for _ in range(3):
        check_sha256(path, digest, "here", "record", "fix")
    assert len(calls) == 1
    replaced = tmp_path / "g.bin"  # a copy put in its place (another inode): checked again
    replaced.write_bytes(b"y" * 1000)
    os.replace(replaced, path)
    monkeypatch.setattr(conf.files, "sha256_file", sha256_file)
    with pytest.raises(UserError, match="does not match its checksum in record"):
        check_sha256(path, digest, "here", "record", "fix")
    path.unlink()
    with pytest.raises(UserError, match="does not exist"):
        check_sha256(path, digest, "here", "record", "fix")


def test_head_weights_are_checked_after_they_change_in_process(trained, tmp_path):
    head = copy_head(trained, tmp_path / "head")
    load_head(head, "eagle3")  # checked and remembered
    damaged = bytearray((head / WEIGHTS_NAME).read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (tmp_path / "w").write_bytes(bytes(damaged))
    os.replace(tmp_path / "w", head / WEIGHTS_NAME)
    with pytest.raises(UserError, match="does not match its checksum"):
        load_head(head, "eagle3")
    assert torch.isfinite(load_head(trained / "run" / "head", "eagle3")[2]["fc.weight"]).all()
