"""A prepare run killed with SIGKILL mid-capture resumes to byte-identical shards, and one killed
mid-regeneration resumes to every prompt answered once, as an uninterrupted run answers it (real
processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conf.compose import compose_root
from data_prep.folders.store import load_manifest
from data_prep.prepare import prepare
from tests.support.cli import kill_when, run_cli, start_cli, summary_folder
from tests.support.runs import shard_bytes

# The child slows each shard down (after computing it, before writing it) so that the kill
# reliably lands between shards of a capture that would otherwise finish in a blink.
CHILD = r"""
import sys, time
import data_prep.folders.build as B
import data_prep.prepare as P
from conf.compose import compose_root
real = B.capture_shard
def slow(*args, **kwargs):
    out = real(*args, **kwargs)
    time.sleep(1.0)
    return out
B.capture_shard = slow
P.prepare(compose_root(sys.argv[1:]))
"""


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

    resumed = prepare(compose_root(common + [f"data.cache_dir={killed_cache}"])).path
    clean = prepare(compose_root(common + [f"data.cache_dir={clean_cache}"])).path
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


def answers_file(cache):
    """The regeneration cache of a data cache (one config: one file), None before it exists."""
    return next((cache / "regenerated").glob("*.jsonl"), None)


def answered(cache) -> list[dict]:
    """The regeneration cache's complete lines (a kill may tear the last)."""
    path = answers_file(cache)
    lines = path.read_text().split("\n")[:-1] if path else []
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_sigkill_mid_regeneration_then_resume_answers_each_prompt_once(tiny_llama_dir, chat_file, tmp_path):
    """`python -m data_prep.prepare` killed once 8 of 64 conversations are answered, a torn line
    appended as a kill mid-write leaves one, then run again: each prompt is in the cache once and
    its answer, the shards and the manifest's splits are an uninterrupted run's. float32 GEMMs
    (`data.matmul_dtype=target`): the resumed run decodes its prompts in other batches, which
    changes no float32 answer; bf16 GEMMs may break a near-tie the other way in another batch.
    Two passes (`data.capture.one_pass=false`): with one pass each answer's states come from the
    forwards of the batch that wrote it, equal to capture's within float noise, not bit for bit
    (tests/unit/data_prep/test_onepass.py)."""
    common = [
        "+head=eagle3",
        "data.draft_vocab_size=300",
        f"target.name_or_path={tiny_llama_dir}",
        "target.num_threads=1",
        f"data.source={chat_file}",
        "data.max_samples=0",
        "data.matmul_dtype=target",
        "data.regenerate.max_new_tokens=32",
        "data.regenerate.batch_size=4",
        "data.regenerate.workers=1",
        "data.capture.one_pass=false",
        "logging.progress=false",
    ]
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    run = start_cli("data_prep.prepare", [*common, f"data.cache_dir={killed}"], tmp_path)
    kill_when(run, lambda: len(answered(killed)) >= 8)
    before = len(answered(killed))
    assert before < 64, "the run finished regenerating before it could be killed"
    with open(answers_file(killed), "a") as fh:
        fh.write('{"uid": "3", "turns": [{"prompt_ids": [1, 2')

    code, out, err = run_cli("data_prep.prepare", [*common, f"data.cache_dir={killed}"], tmp_path)
    assert code == 0, err[-3000:]
    code, clean_out, err = run_cli("data_prep.prepare", [*common, f"data.cache_dir={clean}"], tmp_path)
    assert code == 0, err[-3000:]
    resumed, straight = answered(killed), answered(clean)
    assert len(resumed) == len({row["uid"] for row in resumed}) == 64
    assert {r["uid"]: r["turns"] for r in resumed} == {r["uid"]: r["turns"] for r in straight}
    a, b = summary_folder(out), summary_folder(clean_out)
    assert load_manifest(a)["stats"]["regenerated_from_cache"] == before
    assert shard_bytes(a) == shard_bytes(b) and load_manifest(a)["splits"] == load_manifest(b)["splits"]
