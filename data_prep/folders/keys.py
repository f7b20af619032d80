"""What names a data folder and a regeneration (answer) cache: keys built by inclusion.

Each key lists every input its contents depend on, field by field, so that a new setting changes
no key until it is named here. Settings absent from both keys, and why they may be:
- `data.cache_dir`: where the folders are, not what they hold.
- `data.regenerate.batch_size`, `data.regenerate.workers`: how many rows and engines decode at
  once. Answers do not depend on them (tests/unit/data_prep/test_regen_engine.py), and a data
  folder's rows are read from the answer cache, which one run at a time extends, so a folder
  holds the cached answer whichever batch wrote it (tests/unit/data_prep/test_data_keys.py).
- `data.regenerate.endpoints`, `in_flight`, `retries`, `timeout_s`, `silence_s`, `api_key_env`:
  which servers answer, how requests reach them and when one is given up. The backend (`server`)
  is keyed, and every endpoint is checked to serve the target before a request
  (`data_prep.answers.regen_server.connect`), so the servers are interchangeable: which one answered a
  prompt is scheduling, as a batch is.
- `data.capture.endpoints`, `dir`, `tensor_parallel_size`, `pipeline_parallel_size`: where the
  serving engine runs and where it writes. The backend is keyed (`CAPTURE_FIELDS`: vLLM's kernels
  are not transformers'); a tensor-parallel split changes a reduction's order as a batch's
  padding does in bf16, within the same noise, and every server is checked to serve the target.
- `data.capture.prefetch_batches`: how far ahead online training asks the servers; the states of
  a batch do not depend on when they were asked for.
- `data.matmul_dtype`, `target.dtype`: keyed as the precision they resolve to (`precision`), so
  `auto` and the dtype it picks share a key.
- `data.chat_template*`: keyed as the digest of the template as it renders (`ChatTemplate`).
- `data.hidden_states`: keyed as the mode the folder was built in (`auto` resolves to one).
Every other data field changes a folder's samples or shards (`SOURCE_FIELDS`, `FOLDER_FIELDS`,
`ANSWER_FIELDS`, `data.draft_vocab_size` as the size it resolves to).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from conf.schema import DataConfig, RootConfig
from conf.sizes import Sizes
from data_prep.conversations.sources import source_fingerprint
from data_prep.folders.store import FORMAT_VERSION
from data_prep.linears import resolve_matmul_dtype
from data_prep.states.capture import CaptureSpec
from data_prep.target import Target, data_base, resolve_device, resolve_dtype
from data_prep.template import ChatTemplate

# `data` fields that name the source: with its content fingerprint (`source_fingerprint`, which
# does not see a `datasets` folder's split) they say which conversations a uid stands for.
SOURCE_FIELDS = ("source", "split")
# Version of the regeneration cache: its lines (2 = token ids per turn) and its key (3 = by
# inclusion, the precision always named).
REGEN_FORMAT = 3

# `data.regenerate` fields that change an answer: its length, its sampling, how many per prompt
# and the engine that decodes it (vLLM's kernels round otherwise than draftsmith's engine).
ANSWER_FIELDS = ("max_new_tokens", "temperature", "top_p", "num_samples", "backend")
# `data.capture` fields that change a folder's states: the engine that computes them (one_pass:
# regeneration's engine for the answers it writes, within bf16 noise of capture's forward).
CAPTURE_FIELDS = ("backend", "one_pass")
# `data` fields that change a folder's rows or shards: which conversations (max_samples, and
# max_turns/max_length shape them), the validation split (val_fraction, seed), the stored bytes
# (storage_dtype), the shard layout (shard_samples) and the capture batches, whose padding can
# change bf16 hidden states (capture_batch_tokens). Each is a data field also in the manifest.
FOLDER_FIELDS = ("max_samples", "max_length", "max_turns", "val_fraction", "seed", "storage_dtype",
                 "shard_samples", "capture_batch_tokens")


def digest(key: dict) -> str:
    """A key's name: 16 hex digits of the SHA-256 of its JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def matmul_dtype(cfg: RootConfig) -> torch.dtype:
    """The precision of the target's linear layers while it writes data (`data.matmul_dtype`)."""
    device = resolve_device(cfg.target.device)
    return resolve_matmul_dtype(cfg.data.matmul_dtype, resolve_dtype(cfg.target.dtype, device), device)


def precision(cfg: RootConfig) -> dict:
    """The precision answers and hidden states are computed in: the target's dtype and its
    matmuls' (a bf16 target's answers are neither a float32 one's nor those of float32 weights
    with bf16 matmuls)."""
    dtype = resolve_dtype(cfg.target.dtype, resolve_device(cfg.target.device))
    return {"dtype": str(dtype), "matmul_dtype": str(matmul_dtype(cfg))}


def _source(d: DataConfig) -> dict:
    return {k: getattr(d, k) for k in SOURCE_FIELDS} | {"fingerprint": source_fingerprint(d)}


def _answer_settings(d: DataConfig) -> dict:
    return {k: getattr(d.regenerate, k) for k in ANSWER_FIELDS}


def answer_key(cfg: RootConfig, identity: dict, tpl: ChatTemplate) -> dict:
    """Every input a regenerated answer depends on: the whole target identity (its weights
    included: the cache is reused without a check), its precision, the source, the template as
    rendered, the conversation shape and the answer's settings. Not `max_samples` (growing the
    set reuses the answers) nor what is captured from them."""
    d = cfg.data
    return {
        "format": REGEN_FORMAT,
        "target": identity,
        **precision(cfg),
        "source": _source(d),
        "chat_template": tpl.digest,
        "max_length": d.max_length,
        "max_turns": d.max_turns,
        "regenerate": _answer_settings(d),
    }


def regen_cache_file(cfg: RootConfig, identity: dict, tpl: ChatTemplate) -> Path:
    """`data_base/regenerated/<answer key>.jsonl`."""
    return data_base(cfg) / "regenerated" / f"{digest(answer_key(cfg, identity, tpl))}.jsonl"


def folder_key(
    cfg: RootConfig, identity: dict, tpl: ChatTemplate, spec: CaptureSpec, vocab: int | None
) -> dict:
    """Every input a data folder depends on but its mode: the target by name (a folder reused
    with other weights is refused, `store.check_target`, not silently rebuilt), its precision,
    the source, the template as rendered, the data fields that change rows, the answers' settings
    when regenerated, what is captured and the draft vocabulary's size."""
    d = cfg.data
    return {
        "format": FORMAT_VERSION,
        "target": {k: identity[k] for k in ("name_or_path", "revision")},
        **precision(cfg),
        "source": _source(d),
        "chat_template": tpl.digest,
        "data": {k: getattr(d, k) for k in FOLDER_FIELDS} | {"max_samples": Sizes.of(cfg).conversations},
        "regenerate": _answer_settings(d) if d.regenerate.enabled else None,
        "capture": dataclasses.asdict(spec) | {k: getattr(d.capture, k) for k in CAPTURE_FIELDS},
        "draft_vocab_size": vocab,
    }


def states_folder(cfg: RootConfig, identity: dict, spec: CaptureSpec) -> Path:
    """`data_base/states/<key>`: the one-pass store (`data_prep.states.onepass`), keyed by what a
    conversation's kept states depend on besides its token ids (its files' names): the whole
    target identity, its precision and what is kept. Every folder of those shares it, so the
    states the planner's probe kept serve the run's folder."""
    key = {"format": FORMAT_VERSION, "target": identity, **precision(cfg),
           "capture": dataclasses.asdict(spec)}
    return data_base(cfg) / "states" / digest(key)


@dataclass(frozen=True)
class FolderKey:
    """A config's data folders, one per mode (`offline`, `online`): one build lock and one spill
    serve every mode, since `auto` decides only once the samples are spilled."""

    cfg: RootConfig
    target: Target
    spec: CaptureSpec
    vocab: int | None

    def _key(self) -> dict:
        t = self.target
        return folder_key(self.cfg, t.identity, t.chat_template, self.spec, self.vocab)

    def folder(self, mode: str) -> Path:
        """`data_base/<key>`: the key and the mode."""
        return data_base(self.cfg) / digest(self._key() | {"hidden_states": mode})

    def sibling(self, suffix: str) -> Path:
        """`<key>.lock`, `<key>.spill`: beside the folders, named by the key without the mode."""
        return data_base(self.cfg) / f"{digest(self._key())}{suffix}"
