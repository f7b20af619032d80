"""The captured-data folder: sharded safetensors, a manifest, and the Dataset the trainer reads.

Layout: `<folder>/manifest.json`, `<folder>/<split>/shard-00000.safetensors`, ... Each shard's
header metadata names its samples' uids (`shard_uids`), so a row can be traced to its source.
Samples reach it through a `TokenSpill`, so that a source of any size is sharded from disk. A
folder is built as `<folder>.partial` and renamed when its manifest is written, so a folder
with a manifest is always complete. Inside the partial folder each shard is written to a temp
name and renamed, so every shard file present is complete: a killed run resumes after the last
one, and because shards are a pure function of their samples the result is byte-identical.
`prepare` builds a folder only under its build lock (`conf.files.build_once`), so two runs never
write into one partial folder.

Every shard and the draft vocabulary carry a sha256 in the manifest (hashed as the shard is
written, never read back for it), checked once per node when opened: a damaged file stops the
run in one line naming it and the command that rebuilds it (`rebuild_hint`), instead of training
on it (a head's own weights: `heads.folder`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from array import array
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from conf.errors import UserError
from conf.files import atomic_write, check_sha256, replace_dir, sha256_file
from data_prep.linears import DataLinears
from data_prep.states.capture import TOP, CaptureSpec, HfCapturer, capture_shard, checked_capture, decode
from data_prep.template import Tokenized

# 2: rows are token ids as the template renders them and the target emits them (one row per turn
# where the template rewrites history), shards name their uids; 3: keys by inclusion
# (`data_prep.folders.keys`), every count in the manifest's stats; 4: the target's top-1 id per token
# (`capture.TOP`) where the head's teacher needs it, and `target_top` in the manifest. An older
# folder is refused by its path (`load_manifest`); a run keys its folder by this version, so it
# builds the new folder beside an old one, once.
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
PLAN = "plan.json"
SPLITS = ("train", "validation")
# Bytes hashed and written at a time (`write_hashed`): each block is hashed while it is in cache.
WRITE_BLOCK = 1 << 20
# Fields of the manifest's `target` that must match the target a folder is reused with.
TARGET_FIELDS = ("tokenizer_hash", "vocab_size", "hidden_size", "num_hidden_layers", "weights")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def shard_uids(path: Path) -> list[str]:
    """The uids of a shard's samples, in order ([] for a shard written without them)."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta.get("uids", "[]"))


def open_partial(folder: Path, plan: dict) -> Path:
    """The partial build folder for `folder`, kept only if it was started with the same plan."""
    partial = folder.with_name(folder.name + ".partial")
    plan_file = partial / PLAN
    if partial.exists() and (not plan_file.exists() or json.loads(plan_file.read_text()) != plan):
        shutil.rmtree(partial)
    if not partial.exists():
        partial.mkdir(parents=True)
        atomic_write(plan_file, lambda p: p.write_text(json.dumps(plan, sort_keys=True)))
    return partial


def write_hashed(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
                 ) -> tuple[str, int]:
    """Write `tensors` as a safetensors file at `path` (atomically: `atomic_write`), hashing the
    bytes as they are written: (sha256, size), without reading the file back. `tensors` is
    emptied once serialized (the caller hands it over), so the shard is held once, as bytes."""
    data = memoryview(save(tensors, metadata))
    tensors.clear()
    digest = hashlib.sha256()

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            for at in range(0, len(data), WRITE_BLOCK):
                block = data[at : at + WRITE_BLOCK]
                digest.update(block)
                fh.write(block)

    atomic_write(path, write)
    return digest.hexdigest(), len(data)


def fresh_record(file: str, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
                 ) -> dict:
    """Write a new shard (`write_hashed`) and return its manifest record, counted from the
    tensors written."""
    offsets, masked = tensors["offsets"], int(tensors["loss_mask"].sum())
    sha256, size = write_hashed(path, tensors, metadata)
    return shard_record(file, offsets, masked, size, sha256)


def shard_record(file: str, offsets: torch.Tensor, masked: int, size: int, sha256: str) -> dict:
    return {"file": file, "samples": len(offsets) - 1, "tokens": int(offsets[-1]), "masked_tokens": masked,
            "bytes": size, "sha256": sha256}


def write_split(
    partial: Path,
    split: str,
    chunks: Iterable[list],
    make_shard: Callable[[list], dict[str, torch.Tensor]],
    on_shard: Callable[[dict], None] | None = None,
    owned: Callable[[int], bool] | None = None,
) -> list[dict]:
    """Write one shard per chunk of samples, skipping shards already complete; their records.
    `owned(i)`: whether this process writes shard i (`data_prep.conversations.ranks`); the others' shards are
    left to them and have no record here.

    A new shard is written and hashed on a writer thread while the next one is captured (the
    target's forwards do not wait for the disk); one shard at a time, so the host holds at most
    the shard being written and the one being captured. A write that fails raises here, at the
    next shard or at the end; records and `on_shard` come in shard order."""
    out = partial / split
    out.mkdir(exist_ok=True)
    records: list[dict] = []
    writing: Future | None = None

    def done(record: dict, fresh: bool) -> None:
        records.append(record)
        if on_shard is not None:
            on_shard(record | {"fresh": fresh})

    def settle() -> None:
        nonlocal writing
        if writing is not None:
            record, writing = writing.result(), None
            done(record, True)

    with ThreadPoolExecutor(1, thread_name_prefix="shard-writer") as writer:
        for i, chunk in enumerate(chunks):
            path = out / shard_name(i)
            if owned is not None and not owned(i):
                continue
            file = f"{split}/{path.name}"
            if path.exists():
                settle()
                with safe_open(str(path), "pt") as f:
                    offsets = f.get_tensor("offsets")
                    masked = int(f.get_tensor("loss_mask").sum())
                done(shard_record(file, offsets, masked, path.stat().st_size, sha256_file(path)), False)
                continue
            tensors = make_shard(chunk)
            uids = [s.uid for s in chunk] if chunk and isinstance(chunk[0], Tokenized) else None
            meta = {"uids": json.dumps(uids)} if uids else None
            settle()
            writing = writer.submit(fresh_record, file, path, tensors, meta)
            del tensors
        settle()
    return records


def capture_shards(model, spec: CaptureSpec, shards: list[list[Tokenized]], partial: Path, batch_tokens: int,
                   split: str = "train") -> list[dict]:
    """Offline `hf` capture of `shards` (each a list of samples, sorted by length as `prepare`
    sorts them) into `partial/split` with `model` as it is (the caller sets its linears:
    `DataLinears`), in batches of at most `batch_tokens` padded tokens; the shards' records. What
    `prepare` runs per split, without the spill and the manifest: the unit `bench_capture.py`
    and a GPU check time beside the target's bare forward (`capture.bare_forward`)."""
    capturer = HfCapturer(model, spec, batch_tokens)
    return write_split(partial, split, shards, lambda chunk: capture_shard(capturer, chunk, spec))


class TokenSpill:
    """Tokenized samples spilled to disk as they stream in, to be sharded once all are seen.

    Shards are length-sorted, and the validation split and the draft vocabulary are decided
    over the whole set, so `prepare` sees every sample before it writes a shard; a source of
    any size must still not sit in memory. Ids (int32) and masks (a byte each) go to two flat
    files in arrival order; memory keeps ~100 bytes per sample: where its tokens start, how many,
    its prompt's split hash, a digest of its uid and tokens (for the build plan) and its uid.
    """

    def __init__(self, folder: Path):
        folder.mkdir(parents=True)
        self.files = (folder / "input_ids.bin", folder / "loss_mask.bin")
        self._writers = [open(p, "wb") for p in self.files]
        self.starts, self.lengths = array("q"), array("i")
        self.hashes, self.digests = array("d"), bytearray()
        self.uids: list[str] = []
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.lengths)

    def append(self, uid: str, t: Tokenized, split_hash: float) -> None:
        ids, mask = array("i", t.input_ids).tobytes(), bytes(t.loss_mask)
        for out, data in zip(self._writers, (ids, mask)):
            out.write(data)
        self.digests += hashlib.sha256(uid.encode() + b"\0" + ids + mask).digest()[:16]
        self.uids.append(uid)
        self.starts.append(self.tokens)
        self.lengths.append(len(t.input_ids))
        self.hashes.append(split_hash)
        self.tokens += len(t.input_ids)

    def close(self) -> None:
        """Done appending: flush the files for `read`."""
        for out in self._writers:
            out.close()

    def split_hashes(self) -> torch.Tensor:
        """Float64 [n]: each sample's prompt split hash (`data_prep.conversations.sources.held_out`
        reads them)."""
        return torch.frombuffer(self.hashes, dtype=torch.float64).clone()

    def by_length(self, indices: torch.Tensor) -> torch.Tensor:
        """`indices` sorted by sample length, ties in arrival order: a function of the source
        alone, so a resumed build shards exactly as an uninterrupted one."""
        lengths = torch.frombuffer(self.lengths, dtype=torch.int32)[indices]
        return indices[torch.argsort(lengths, stable=True)]

    def digest(self, indices: torch.Tensor) -> str:
        """Identity of these samples in this order (the build plan of one split)."""
        h = hashlib.sha256()
        for i in indices.tolist():
            h.update(self.digests[16 * i : 16 * i + 16])
        return h.hexdigest()[:16]

    def read(self, indices: list[int]) -> list[Tokenized]:
        out = []
        with open(self.files[0], "rb") as ids_file, open(self.files[1], "rb") as mask_file:
            for i in indices:
                start, n = self.starts[i], self.lengths[i]
                ids_file.seek(4 * start)
                mask_file.seek(start)
                ids = array("i", ids_file.read(4 * n)).tolist()
                out.append(Tokenized(ids, list(map(bool, mask_file.read(n))), False, self.uids[i]))
        return out


def with_vocab_checksum(partial: Path, manifest: dict) -> dict:
    """`manifest` with the sha256 of its draft vocabulary file, the one file `write_split` does not
    record, so that every file a training run reads is checked (`check_file`)."""
    vocab = manifest.get("draft_vocab")
    if not vocab or "sha256" in vocab:
        return manifest
    return manifest | {"draft_vocab": vocab | {"sha256": sha256_file(partial / vocab["file"])}}


def finish(partial: Path, folder: Path, manifest: dict) -> dict:
    """Write the manifest (`with_vocab_checksum`) and move the partial folder into place: the
    folder is now complete. Returns the manifest as written."""
    (partial / PLAN).unlink(missing_ok=True)
    sealed = with_vocab_checksum(partial, manifest)
    atomic_write(partial / MANIFEST, lambda p: p.write_text(json.dumps(sealed, indent=2)))
    replace_dir(partial, folder)
    return sealed


def load_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise UserError(f"data folder {str(folder)!r}: no {MANIFEST} (not a complete data folder)")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{path}: format_version {manifest.get('format_version')!r}, expected "
            f"{FORMAT_VERSION}; delete the folder to rebuild it"
        )
    return manifest


def rebuild_hint(folder: Path) -> str:
    """The command that rebuilds a data folder, for errors about one of its files."""
    return (
        f"delete the folder and build it again: rm -r {folder} && python -m data_prep.prepare "
        "<the run's overrides> (a training run rebuilds a missing folder itself)"
    )


def check_file(folder: Path, record: dict) -> None:
    """A file the manifest lists (a shard, the draft vocabulary: `record` holds its "file" and
    "sha256") against its checksum, once per process: a flipped bit on disk or a bad copy
    would otherwise train on wrong values without a word. Records from before checksums pass."""
    if "sha256" in record:
        path, where = folder / record["file"], f"data folder {str(folder)!r}"
        check_sha256(path, record["sha256"], where, folder / MANIFEST, rebuild_hint(folder))


def check_target(manifest: dict, target: dict, where: str) -> None:
    """Refuse data captured with another target: one line naming every field that differs."""
    diffs = [
        f"{k} {manifest['target'].get(k)} != {target[k]}"
        for k in TARGET_FIELDS
        if manifest["target"].get(k) != target[k]
    ]
    if diffs:
        raise UserError(
            f"{where}: data was captured with target {manifest['target'].get('name_or_path')!r} "
            f"but the given target {target['name_or_path']!r} differs: {'; '.join(diffs)} "
            "(delete the folder or set data.cache_dir to rebuild)"
        )


def manifest_spec(manifest: dict) -> CaptureSpec:
    """What a folder's head trains on, as its manifest records it."""
    m = manifest
    return CaptureSpec(tuple(m["aux_layer_ids"]), m["final_layer_id"], m["storage_dtype"], m["target_top"])


def online_capture(manifest: dict, model) -> Callable[[dict], dict] | None:
    """For a folder prepared with `data.hidden_states=online`: the per-batch capture the training
    loop runs with `model` (the target), computing the hidden states the folder does not hold,
    and where they overflowed (`capture.NONFINITE`). None when the folder holds them, or when
    the head reads none (Medusa-2)."""
    if manifest.get("hidden_states") != "online" or not manifest_spec(manifest).needs_forward:
        return None
    return target_capture(manifest, model)


def target_capture(manifest: dict, model) -> Callable[[dict], dict]:
    """The per-batch capture of the folder's fields by `model` (the target), whatever the folder
    holds: online mode's, and on-policy training's on rows the head drafted
    (`trainer.kinds.eagle3.on_policy_rows`), which no folder can hold."""
    m = manifest
    spec = manifest_spec(manifest)
    # The linear layers compute as they did when the folder was prepared (`data.matmul_dtype`);
    # folders from before that setting ran the target's own dtype.
    linears = DataLinears(model, getattr(torch, m["matmul_dtype"]) if "matmul_dtype" in m else None)

    def capture(batch: dict) -> dict:
        with linears:
            return checked_capture(model, spec, batch)

    return capture


def node_verifies() -> bool:
    """Whether this process checks a data folder's shards for its node: the first process of
    its node (torchrun's LOCAL_RANK 0), or a process started alone."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


class CapturedDataset(torch.utils.data.Dataset):
    """One split of a data folder, read lazily from memory-mapped shards.

    item: input_ids LongTensor[T], loss_mask BoolTensor[T], and when captured aux_hidden [T, 3H]
    and final_hidden [T, H]: bf16 as stored (half the bytes to pad and copy; the trainer widens
    them on the device), float32 when stored as fp8; where kept, `target_top` IntTensor[T]
    (`capture.TOP`). `lengths` serves length-grouped batching. Opening it checks each shard
    against its checksum (`check_file`) before anything is read, where `verify`: by default in
    one process per node (`node_verifies`), not in every rank, since the ranks of a node read
    the same files (terabytes, offline at 8B); a damaged file stops that process, and torchrun
    the others, in one line naming the file.
    """

    def __init__(self, folder: str | Path, split: str, verify: bool | None = None):
        self.folder = Path(folder)
        self.manifest = load_manifest(self.folder)
        if split not in self.manifest["splits"]:
            raise UserError(f"split={split!r}: expected one of {', '.join(self.manifest['splits'])}")
        self.split = split
        records = self.manifest["splits"][split]["shards"]
        self.shards = [self.folder / s["file"] for s in records]
        self._index: list[tuple[int, int, int]] = []
        self.fields: dict[str, list[str]] = {}
        self.top = False
        verify = node_verifies() if verify is None else verify
        for k, (path, record) in enumerate(zip(self.shards, records)):
            if verify:
                check_file(self.folder, record)
            with safe_open(str(path), "pt") as f:
                offsets = f.get_tensor("offsets").tolist()
                names = set(f.keys())
            self.top = TOP in names
            # field -> the tensors that store it (the value, and its fp8 scale if any)
            self.fields = {
                n: [t for t in (n, f"{n}_scale") if t in names]
                for n in ("aux_hidden", "final_hidden")
                if n in names
            }
            self._index += [(k, a, b) for a, b in zip(offsets, offsets[1:])]
        self.lengths: list[int] = [b - a for _, a, b in self._index]
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._index)

    def describe(self, i: int) -> str:
        """Where sample `i` lives, for error messages: split, shard, row and uid when recorded."""
        k = self._index[i][0]
        row = i - next(j for j, (shard, _, _) in enumerate(self._index) if shard == k)
        uids = shard_uids(self.shards[k])
        uid = f", uid {uids[row]!r}" if row < len(uids) else ""
        return f"sample {i} of the {self.split} split ({self.shards[k]} row {row}{uid})"

    def __getstate__(self):  # open handles stay in the process that opened them
        return {**self.__dict__, "_handles": {}}

    def _handle(self, k: int):
        if k not in self._handles:
            self._handles[k] = safe_open(str(self.shards[k]), "pt")
        return self._handles[k]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, a, b = self._index[i]
        f = self._handle(k)
        item = {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b],
        }
        for name, stored in self.fields.items():
            parts = {t: f.get_slice(t)[a:b] for t in stored}
            # fp8 needs its scales applied here; bf16 stays as stored until the device.
            item[name] = decode(parts, name) if f"{name}_scale" in parts else parts[name]
        if self.top:
            item[TOP] = f.get_slice(TOP)[a:b]
        return item
