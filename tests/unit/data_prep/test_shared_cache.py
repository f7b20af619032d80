"""Caches shared by runs started together (a sweep of head variants over one data cache): each
cache entry is built once, under a lock file holding the builder's pid and host; the other runs
wait for it and reuse it, a lock whose holder died is taken over, and every run exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conf.files import build_lock, build_once
from tests.support.cli import cli_env

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


