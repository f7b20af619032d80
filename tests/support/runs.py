"""A tiny training run's settings and what it leaves behind: the overrides of a seconds-long run,
its summary, losses and data folders, shared by the in-process and the command-line tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conf.compose import compose_root
from conf.errors import UserError
from conf.schema import (
    RootConfig,
)
from data_prep.folders.store import CapturedDataset, load_manifest, online_capture
from data_prep.states.capture import TOP, decode
from trainer.batching import batch_loader
from trainer.loop import device_batch


def tiny_run_args(head: str, target: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    """`trainer.train` overrides for a seconds-long run of `head` on a tiny target: no
    regeneration, no evaluation or export, small batches; decoded validation on by default, as
    the main job's, its prompts short."""
    return [
        f"+head={head}",
        f"target.name_or_path={target}",
        "target.num_threads=1",
        f"data.source={data}",
        "data.regenerate.enabled=false",
        "data.max_samples=0",
        "data.val_fraction=0.1",
        f"data.cache_dir={run_dir.parent / 'data-cache'}",
        f"run_dir={run_dir}",
        "pipeline.evaluate=false",
        "pipeline.export=false",
        "optim.batch_tokens=512",
        "optim.max_batch_size=4",
        "optim.lr=1e-3",
        "optim.val_decode_tokens=8",
        "logging.log_every=2",
        "logging.progress=false",
        *extra,
    ]


def tiny_run_config(head: str, target: Path, data: Path, run_dir: Path, *extra: str) -> RootConfig:
    """The config `python -m trainer.train <tiny_run_args>` runs with, composed through the same
    Hydra path (`compose_root`), so an in-process test and a command-line test share settings.
    Derive a variant by passing more overrides, never by assigning to the config."""
    return compose_root(tiny_run_args(head, target, data, run_dir, *extra))


def user_error_line(call: Callable[[], object]) -> str:
    """The one line a command prints for the `UserError` that `call` raises (`error: ...`), as
    `conf.errors.exit_on_user_error` prints it."""
    with pytest.raises(UserError) as err:
        call()
    line = f"error: {err.value}"
    assert "\n" not in line, line
    return line


def train_losses(run_dir: Path) -> list[float]:
    return [h["loss"] for h in json.loads((run_dir / "history.json").read_text()) if "loss" in h]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def data_folder(cache: Path) -> Path:
    (folder,) = [p for p in cache.iterdir() if (p / "manifest.json").exists()]
    return folder


def shard_bytes(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))}


def assert_states_close(a: Path, b: Path) -> None:
    """Folders `a` and `b` hold the same shards of the same rows (ids, masks, offsets equal) and
    states equal within bf16 storage rounding (1e-2 of each field's largest value), their top-1
    agreeing on >= 98% of tokens: what two computations of the same states promise (one pass and
    capture's forward; a server and transformers), where only one forward twice is bit-exact."""
    shards = {str(p.relative_to(a)) for p in a.rglob("shard-*.safetensors")}
    assert shards == {str(p.relative_to(b)) for p in b.rglob("shard-*.safetensors")} and shards
    for name in sorted(shards):
        x, y = load_file(a / name), load_file(b / name)
        assert x.keys() == y.keys(), name
        for k in ("input_ids", "loss_mask", "offsets"):
            assert x[k].equal(y[k]), (name, k)
        for k in ("aux_hidden", "final_hidden"):
            if k in x:
                u, v = decode(x, k), decode(y, k)
                assert (u - v).abs().max() <= 1e-2 * v.abs().max(), (name, k)
        if TOP in x:
            assert (x[TOP] == y[TOP]).float().mean() >= 0.98, name


def tiny_prep_config(
    target: Path, source: Path, cache: Path, *extra: str, head: str = "eagle3"
) -> RootConfig:
    """`tiny_run_config` for data prep on its own: shards of 5 samples, a fifth held out, 300
    draft ids, `cache` as the data cache."""
    return tiny_run_config(
        head, target, source, cache / "run", "data.shard_samples=5", "data.val_fraction=0.2",
        "data.draft_vocab_size=300", f"data.cache_dir={cache}", *extra,
    )


def assert_online_batch_is_the_offline_batch(
    offline: Path, online: Path, model, batches: list[list[int]] | None = None
) -> None:
    """The same loader batches (of training sample indices), offline as read from `offline`,
    online through `model`'s forward over `online`'s ids: equal fields, bit for bit (float32 on
    the CPU), rounded through the storage dtype alike. By default other groupings and paddings
    than the capture's batches."""
    capture = online_capture(load_manifest(online), model)
    assert online_capture(load_manifest(offline), model) is None
    batches = batches or [[3, 0, 7, 11], [5, 2]]
    loaded = {
        mode: list(batch_loader(CapturedDataset(folder, "train"), batches, 0, False))
        for mode, folder in (("offline", offline), ("online", online))
    }
    for off, on in zip(loaded["offline"], loaded["online"], strict=True):
        want = device_batch(off, "cpu")
        got = device_batch(on, "cpu", capture)
        assert got.keys() == want.keys() and {"final_hidden"} <= got.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
            assert not got[k].is_inference()  # autograd may save it


WORDS = "apple river stone cloud garden rocket violin tiger paper summer".split()


def conversations(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        w = WORDS[i % len(WORDS)]
        rows.append(
            {
                "conversations": [
                    {"from": "human", "value": f"Tell me about the {w} number {i}."},
                    {"from": "gpt", "value": f"The {w} {i} is " + "very " * (i % 7) + "nice."},
                ]
            }
        )
    return rows


QUICK = ["eval.max_prompts_per_task=1", "eval.max_new_tokens=10", "eval.tasks=[mtbench,gsm8k]"]
