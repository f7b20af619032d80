"""Data prep and target conversion on a full disk, as users run them: one line, exit 2,
nothing half-written (a 1 MB tmpfs; root only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conf.errors import UserError
from data_prep.folders.store import load_manifest
from data_prep.target import resolve_target_path
from tests.support.cli import error_lines, run_cli, summary_folder


def prepare_args(target: Path, source: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "+head=eagle3",
        f"target.name_or_path={target}",
        "target.num_threads=1",
        f"data.source={source}",
        "data.regenerate.enabled=false",
        "data.max_samples=0",
        "data.draft_vocab_size=300",
        f"data.cache_dir={cache}",
        "logging.progress=false",
        *extra,
    ]


@pytest.mark.slow
def test_cli_refuses_offline_capture_on_a_small_disk_and_auto_goes_online(
    tiny_llama_dir, chat_file, tmp_path, small_disk
):
    """64 conversations, ~1.8 MB of EAGLE-3 hidden states, on a 1 MB file system."""
    cache = small_disk.path / "data"
    offline = prepare_args(tiny_llama_dir, chat_file, cache, "data.hidden_states=offline")
    code, out, err = run_cli("data_prep.prepare", offline, tmp_path)
    assert code == 2, err[-3000:]
    [line] = error_lines(err)
    assert line.startswith("error: data.hidden_states=offline: capturing ")
    assert " tokens x 521 bytes needs " in line  # 4 layers x 64 x 2, the top-1 (4), tokens (5)
    assert f"MB more under {cache}, which has " in line and "use data.hidden_states=online" in line
    assert not list(cache.glob("*.partial/*/shard-*"))  # refused before the first shard

    code, out, err = run_cli("data_prep.prepare", prepare_args(tiny_llama_dir, chat_file, cache), tmp_path)
    assert code == 0, err[-3000:]
    assert "data.hidden_states=auto: online (captured hidden states would take 2.1 MB = " in out
    assert load_manifest(summary_folder(out))["hidden_states"] == "online"


@pytest.mark.slow
def test_a_full_disk_while_converting_the_target_is_one_line_and_leaves_nothing(small_disk, monkeypatch):
    """The embedded GGUF's float32 copy (0.5 GB) into a cache on a 1 MB disk."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(small_disk.path))
    targets = small_disk.path / "targets"
    with pytest.raises(UserError) as err:
        resolve_target_path("smollm2-135m-instruct")
    assert str(err.value).startswith(f"{targets}: the disk is full (No space left on device, ")
    assert list(targets.iterdir()) == []  # no half-written copy, no lock
