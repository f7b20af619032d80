"""Reading back what the trackers wrote (tests/unit/trainer/test_tracker.py, tests/e2e/test_tracker.py):
the offline wandb run's transaction log (run-<id>.wandb, the only file wandb 0.31 writes offline
with the run's data) and TensorBoard's event files. tests/conftest.py keeps wandb offline."""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
from wandb.proto import wandb_internal_pb2

# The overrides that turn both trackers on.
TRACKED = ("logging.wandb=offline", "logging.tensorboard=true")

BLOCK = 32 * 1024  # the .wandb file is LevelDB's log format: 32 KiB blocks of framed chunks
FULL, LAST = 1, 4


def wandb_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The records of an offline run's transaction log: after a 7-byte header (":W&B", a key, a
    version), chunks framed as checksum (4), length (2), type (1: whole, 2-4: first, middle,
    last piece); a block's tail shorter than a frame is padding. (wandb 0.31 ships no reader.)"""
    raw = path.read_bytes()
    assert raw[:4] == b":W&B", path
    pos, pieces = 7, b""
    while pos + 7 <= len(raw):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pieces += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


class WandbRun:
    """One offline-run-* folder, read back: its id, name, config and history by step."""

    def __init__(self, folder: Path):
        (log,) = folder.glob("run-*.wandb")
        self.config: dict = {}
        self.history: dict[int, dict[str, float]] = defaultdict(dict)
        kinds = []
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            kinds.append(kind)
            if kind == "run":
                self.id, self.name = record.run.run_id, record.run.display_name
                self.config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
            elif kind == "history":
                items = record.history.item
                named = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}
                row = {k: v for k, v in named.items() if not k.startswith("_")}  # wandb's own: _step...
                self.history[record.history.step.num].update(row)
        assert kinds[-1:] == ["exit"], f"{log}: {kinds}"  # the whole run, finished

    def keys(self) -> set[str]:
        return {k for row in self.history.values() for k in row}


def wandb_runs(run_dir: Path) -> list[WandbRun]:
    """The offline runs under run_dir, oldest first. wandb's service writes a run's log after
    `finish()` returns (seen: a 7-byte file, header only); shutting the service down flushes it."""
    wandb.teardown()
    return [WandbRun(folder) for folder in sorted((run_dir / "wandb").glob("offline-run-*"))]


def tensorboard(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def tb_hparams(events: EventAccumulator) -> dict[str, object]:
    """The hyperparameters of the run's (last) HParams session start."""
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = HParamsPluginData.FromString(content).session_start_info
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}


def tb_text(events: EventAccumulator, tag: str) -> str:
    (event,) = events.Tensors(f"{tag}/text_summary")[-1:]
    return event.tensor_proto.string_val[0].decode()
