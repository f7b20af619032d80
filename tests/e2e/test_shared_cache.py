"""Caches shared by runs started together, as separate processes: the decode-attention kernel
is compiled once, each data folder and the embedded target's conversion built once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from data_prep.folders.store import CapturedDataset
from tests.support.cli import cli_env, finish, start_cli, summary_folder


@pytest.mark.slow
def test_three_runs_compile_the_kernel_once(tmp_path):
    """The decode-attention kernel cache: a compiler slow enough (3 s) that the runs overlap."""
    real = shutil.which("cc")
    if real is None:
        pytest.skip("no C compiler")
    log, cc = tmp_path / "cc.log", tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\necho $$ >> {log}\nsleep 3\nexec {real} "$@"\n')
    cc.chmod(0o755)
    home = tmp_path / "home"
    code = "from data_prep.answers.decode_attention import kernel; assert kernel() is not None"
    env = cli_env(CC=str(cc), DRAFTSMITH_CACHE=str(home))
    runs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [p.wait(timeout=300) for p in runs] == [0, 0, 0]
    assert len(log.read_text().splitlines()) == 1
    assert [p.suffix for p in (home / "kernels").iterdir()] == [".so"]


@pytest.mark.slow
def test_three_prepares_at_once_build_each_folder_once(tiny_llama_dir, chat_file, tmp_path):
    """Two runs with the same config and one with another head and fewer samples, started
    together on one cache: one run builds the shared folder and the other reuses it, the third
    builds its own, the regeneration cache answers each prompt once, nothing is left beside
    the folders."""
    cache = tmp_path / "data"
    common = [
        f"target.name_or_path={tiny_llama_dir}",
        "target.num_threads=1",
        f"data.source={chat_file}",
        "data.max_samples=0",
        "data.regenerate.max_new_tokens=8",
        "data.regenerate.batch_size=8",
        "data.draft_vocab_size=300",
        f"data.cache_dir={cache}",
        "logging.progress=false",
    ]
    configs = {"a": ["+head=eagle3"], "b": ["+head=eagle3"], "c": ["+head=medusa", "data.max_samples=48"]}
    home = str(tmp_path / "home")
    runs = {k: start_cli("data_prep.prepare", [*common, *v], tmp_path, DRAFTSMITH_CACHE=home)
            for k, v in configs.items()}
    done = {k: finish(p) for k, p in runs.items()}
    for k, (code, _, err) in done.items():
        assert code == 0 and "Traceback" not in err, (k, err[-3000:])
    folders = {k: summary_folder(out) for k, (_, out, _) in done.items()}
    assert folders["a"] == folders["b"] != folders["c"]
    assert ["reused" in done[k][1].splitlines()[-1] for k in "ab"].count(False) == 1
    left = sorted(p.name for p in cache.iterdir())
    assert left == sorted([folders["a"].name, folders["c"].name, "regenerated"])
    [answers] = (cache / "regenerated").iterdir()
    uids = [json.loads(line)["uid"] for line in answers.read_text().splitlines()]
    assert len(uids) == len(set(uids)) == 64
    for k in "ac":
        assert len(CapturedDataset(folders[k], "train")) > 0  # every shard matches its checksum


@pytest.mark.slow
def test_three_prepares_at_once_convert_the_embedded_target_once(chat_file, tmp_path):
    """The converted-target cache: the embedded GGUF (a 24 s conversion, 0.5 GB) in a fresh cache,
    three runs at once; online data, so that nothing else loads the target."""
    home = tmp_path / "home"
    args = [
        "+head=eagle3",
        f"data.source={chat_file}",
        "data.max_samples=8",
        "data.regenerate.enabled=false",
        "data.hidden_states=online",
        "logging.progress=false",
    ]
    runs = [start_cli("data_prep.prepare", args, tmp_path, DRAFTSMITH_CACHE=str(home)) for _ in range(3)]
    done = [finish(p) for p in runs]
    assert [code for code, _, _ in done] == [0, 0, 0], [err[-2000:] for _, _, err in done]
    assert sum("Converting and de-quantizing GGUF tensors" in err for _, _, err in done) == 1
    assert len({summary_folder(out) for _, out, _ in done}) == 1
    [converted] = (home / "targets").iterdir()  # no temporary folder, no lock
    assert (converted / "config.json").exists()
