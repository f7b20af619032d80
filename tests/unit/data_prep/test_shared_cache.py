"""Caches shared by runs started together (a sweep of head variants over one data cache): each
cache entry is built once, under a lock file holding the builder's pid and host; the other runs
wait for it and reuse it, a lock whose holder died is taken over, and every run exits 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conf.files import build_lock, build_once
from data_prep.store import CapturedDataset
from tests.support.cli import cli_env, finish, start_cli, summary_folder

# A process that holds `argv[1]` for `argv[3]` seconds, then writes `argv[2]` and lets go.
HOLDER = r"""
import sys, time
from pathlib import Path
from conf.files import build_lock
lock, built, hold = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
with build_lock(lock, "the test entry"):
    print("holding", flush=True)
    time.sleep(hold)
    built.write_text("built by the holder")
"""


def start_holder(lock: Path, built: Path, hold: float) -> subprocess.Popen:
    """A process holding `lock`, returned once it holds it."""
    cmd = [sys.executable, "-c", HOLDER, str(lock), str(built), str(hold)]
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "holding\n"
    return proc


def never(*_):
    raise AssertionError("built again")


def test_a_waiter_reuses_what_the_holder_built(tmp_path, capsys):
    lock, built = tmp_path / "entry.lock", tmp_path / "entry"
    holder = start_holder(lock, built, hold=1.0)
    find = lambda: built.read_text() if built.exists() else None  # noqa: E731
    assert build_once(lock, "the test entry", find, never) == "built by the holder"
    assert holder.wait(timeout=60) == 0 and not lock.exists()
    waiting = capsys.readouterr().out.splitlines()
    assert len(waiting) == 1 and waiting[0].startswith(
        f"the test entry: pid {holder.pid} on {socket.gethostname()} is building it since "
    )
    assert waiting[0].endswith(f"waiting for it to finish (if that process is gone, delete {lock})")


@pytest.mark.parametrize("how", ["killed", "pid reused"])
def test_the_lock_of_a_dead_holder_is_taken_over(tmp_path, capsys, how):
    """kill -9 (the holder not even reaped yet: a zombie), or a pid that another process now has
    (the lock records when its process started)."""
    lock = tmp_path / "entry.lock"
    if how == "killed":
        holder = start_holder(lock, tmp_path / "entry", hold=1000)
        os.kill(holder.pid, signal.SIGKILL)
        dead = holder.pid
    else:
        dead = os.getpid()
        owner = {"pid": dead, "host": socket.gethostname(), "start": "1", "since": time.time()}
        lock.write_text(json.dumps(owner))
    started = time.monotonic()
    assert build_once(lock, "the test entry", lambda: None, lambda: "mine") == "mine"
    assert time.monotonic() - started < 10 and not lock.exists()
    assert f"{lock}: its holder (pid {dead}) is gone; taking the lock over" in capsys.readouterr().out
    if how == "killed":
        holder.wait()


def test_a_holder_on_another_host_is_waited_for_and_named(tmp_path, capsys):
    """Its pid cannot be checked from here: the waiter waits, and names the file to delete."""
    lock = tmp_path / "entry.lock"
    lock.write_text(json.dumps({"pid": 4242, "host": "node-7", "start": None, "since": time.time()}))
    got = threading.Event()

    def take():
        with build_lock(lock, "the test entry"):
            got.set()

    waiter = threading.Thread(target=take)
    waiter.start()
    time.sleep(0.5)
    assert not got.is_set()
    out = capsys.readouterr().out
    assert "pid 4242 on node-7 is building it" in out and f"delete {lock})" in out
    lock.unlink()
    waiter.join(timeout=10)
    assert got.is_set() and not lock.exists()


def test_lock_overhead_is_microseconds(tmp_path):
    """Taking and giving back a free lock: a create, a write, a read and an unlink."""
    lock, n = tmp_path / "entry.lock", 200
    started = time.perf_counter()
    for _ in range(n):
        with build_lock(lock, "the test entry"):
            pass
    assert (time.perf_counter() - started) / n < 0.01


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
    code = "from data_prep.decode_attention import kernel; assert kernel() is not None"
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
