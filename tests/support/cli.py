"""Running draftsmith's command lines as users do, for the e2e tests: one at a time, several at
once, killed with SIGKILL mid-run, on a small file system, under a terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

# A config line of an entry point's --help: `  key=default  meaning`.
CONFIG_LINE = re.compile(r"^  (\S+?)=(.*?)\s{2,}(\S.*)$")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run: this interpreter's import path, one thread per process."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now (a server or a torchrun rendezvous binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli(module: str, args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    """`python -m <module> <args>` started in `cwd`, its output piped (read it with `finish`)."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=cli_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    """Wait for `proc`: its exit code, stdout and stderr."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run_cli(module: str, args: list[str], cwd: Path, **env: str) -> tuple[int, str, str]:
    return finish(start_cli(module, args, cwd, **env))


def run_in_terminal(argv: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """`argv` in `cwd` under a pseudo-terminal of 120 x 40, in this environment, as a person runs
    it: progress bars draw as they do on a screen (the evaluator draws one only where it sees a
    terminal). Its exit code and everything it wrote, stdout and stderr interleaved."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, "TERM": "xterm"}, stdin=child, stdout=child,
                            stderr=child, start_new_session=True)
    os.close(child)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.killpg(proc.pid, signal.SIGKILL)
                tail = b"".join(chunks)[-3000:].decode(errors="replace")
                raise AssertionError(f"{argv} ran past {timeout} s: {tail}")
            if select.select([main], [], [], min(left, 5))[0]:
                try:
                    data = os.read(main, 1 << 16)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
    finally:
        os.close(main)
    return proc.wait(), b"".join(chunks).decode(errors="replace")


def error_lines(stderr: str) -> list[str]:
    """The non-blank lines of stderr: a one-line error is exactly one."""
    return [line for line in stderr.splitlines() if line.strip()]


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float = 300) -> None:
    """SIGKILL `proc` as soon as `ready()` holds; fails if it exits first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before the kill: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def summary_folder(stdout: str) -> Path:
    """The data folder a `data_prep.prepare` run's summary line (its last) names."""
    return Path(stdout.strip().splitlines()[-1].rsplit(" -> ", 1)[1])


def run_train_cli(args: list[str], launcher: list[str] | None = None, timeout: int = 600):
    """`python -m trainer.train` (or under `launcher`) as users run it, one thread per process."""
    cmd = (launcher or [sys.executable]) + ["-m", "trainer.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
