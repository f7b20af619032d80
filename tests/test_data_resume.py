"""A prepare run killed with SIGKILL mid-capture resumes to byte-identical shards (real process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_module

from conf.schema import to_root_config
from data_prep.prepare import prepare

# The child slows each shard down (after computing it, before writing it) so that the kill
# reliably lands between shards of a capture that would otherwise finish in a blink.
CHILD = r"""
import sys, time
from hydra import compose, initialize_config_module
import data_prep.prepare as P
from conf.schema import to_root_config
real = P.capture_shard
def slow(*args, **kwargs):
    out = real(*args, **kwargs)
    time.sleep(1.0)
    return out
P.capture_shard = slow
with initialize_config_module(config_module="conf", version_base="1.3"):
    cfg = to_root_config(compose(config_name="config", overrides=sys.argv[1:]))
P.prepare(cfg)
"""


def compose_cfg(overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return to_root_config(compose(config_name="config", overrides=overrides))


def shard_bytes(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))}


@pytest.mark.slow
def test_sigkill_mid_capture_then_resume_gives_identical_shards(tiny_llama_dir, tmp_path):
    source = tmp_path / "chats.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Question {i}: why is the sky blue?"},
                        {"role": "assistant", "content": "Because of Rayleigh scattering. " * (1 + i % 5)},
                    ]
                }
            )
            + "\n"
            for i in range(24)
        )
    )
    common = [
        "+head=eagle3",
        "data.draft_vocab_size=500",
        f"target.name_or_path={tiny_llama_dir}",
        "target.num_threads=1",
        f"data.source={source}",
        "data.regenerate.enabled=false",
        "data.max_samples=0",
        "data.shard_samples=3",
        "data.capture_batch_tokens=128",
        "logging.progress=false",
    ]
    killed_cache, clean_cache = tmp_path / "killed", tmp_path / "clean"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *common, f"data.cache_dir={killed_cache}"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    done = []
    while time.monotonic() < deadline and child.poll() is None:
        done = sorted(killed_cache.glob("*.partial/train/shard-*.safetensors"))
        if len(done) >= 2:
            break
        time.sleep(0.05)
    assert child.poll() is None, child.stderr.read().decode()[-2000:]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    kept = {p.name: os.stat(p).st_ino for p in done}
    assert not list(killed_cache.glob("*/manifest.json"))

    resumed = prepare(compose_cfg(common + [f"data.cache_dir={killed_cache}"]))
    clean = prepare(compose_cfg(common + [f"data.cache_dir={clean_cache}"]))
    assert resumed.name == clean.name and not list(killed_cache.glob("*.partial"))
    # The shards finished before the kill were kept, not rewritten.
    for name, inode in kept.items():
        assert os.stat(resumed / "train" / name).st_ino == inode
    a, b = shard_bytes(resumed), shard_bytes(clean)
    assert len(a) > len(kept) + 2 and a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a)
    manifest_a = json.loads((resumed / "manifest.json").read_text())
    manifest_b = json.loads((clean / "manifest.json").read_text())
    assert manifest_a["splits"] == manifest_b["splits"]
