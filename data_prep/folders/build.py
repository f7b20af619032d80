"""Building one data folder, under its lock (`prepare` holds it): spill the samples' rows to disk
(answered by the target where `data.regenerate` is on: `sample_rows`),
choose the mode (`data.hidden_states=auto`), capture the shards into the partial folder (resuming
a killed build's), then write the draft vocabulary and the manifest and move the folder into
place. Offline capture checks the free disk against its known size before it starts."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from conf.errors import UserError
from conf.files import free_bytes, human_bytes
from conf.schema import RootConfig
from data_prep.answers.regenerate import backend_answerer, regenerate_shares
from data_prep.conversations.ranks import SINGLE, Ranks, balanced_owners
from data_prep.conversations.rows import iter_rows, regenerated_rows, select_samples
from data_prep.conversations.sources import held_out, prompt_uid, split_hash
from data_prep.folders.folder import DataFolder
from data_prep.folders.keys import FolderKey, matmul_dtype, regen_cache_file
from data_prep.folders.store import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    TokenSpill,
    check_target,
    finish,
    load_manifest,
    open_partial,
    write_split,
)
from data_prep.folders.vocab import (
    VOCAB_FILE,
    build_draft_vocab,
    count_masked_tokens,
    coverage,
    draft_vocab_bytes,
    save_draft_vocab,
)
from data_prep.linears import DataLinears
from data_prep.states.capture import (
    LAYER_CONVENTION,
    TOKEN_BYTES,
    Capturer,
    CaptureSpec,
    HfCapturer,
    capture_shard,
)
from data_prep.states.onepass import OnePassCapturer, StateStore
from data_prep.stats import PrepStats
from data_prep.target import Target, data_base
from data_prep.template import Tokenized


def progress_bars(cfg: RootConfig) -> Callable | None:
    """A tqdm factory on stderr (`logging.progress`), else None."""
    if not cfg.logging.progress:
        return None
    from tqdm.auto import tqdm

    return lambda **kw: tqdm(file=sys.stderr, dynamic_ncols=True, **kw)


def choose_hidden_states(spec: CaptureSpec, tokens: int, hidden_size: int, base: Path) -> str:
    """`data.hidden_states=auto`: online when the captured shards would take more than half of the
    free disk under the cache (the rest is for checkpoints, exports and other runs). One line
    says which and why."""
    per_token = spec.bytes_per_token(hidden_size)
    need, free = tokens * per_token, free_bytes(base)
    mode = "online" if need > free / 2 else "offline"
    print(
        f"data.hidden_states=auto: {mode} (captured hidden states would take {human_bytes(need)} "
        f"= {tokens} tokens x {per_token} bytes, {'more than' if mode == 'online' else 'within'} "
        f"half of the {human_bytes(free)} free under {base})"
    )
    return mode


def check_space(cfg: RootConfig, spec: CaptureSpec, tokens: int, hidden_size: int, partial: Path,
                fixed: int) -> None:
    """Refuse, before capture starts, a capture whose shards (and `fixed` bytes more: the draft
    vocabulary) cannot fit under the cache: their size is known (tokens x bytes per token), and a
    disk that fills mid-capture wastes the capture so far. Shards a killed run already wrote into
    `partial` count as written."""
    per_token = spec.bytes_per_token(hidden_size) + TOKEN_BYTES
    written = sum(f.stat().st_size for f in partial.rglob("shard-*.safetensors"))
    need, free = tokens * per_token + fixed - written, free_bytes(partial)
    if need > free:
        raise UserError(
            f"data.hidden_states={cfg.data.hidden_states}: capturing {tokens} tokens x {per_token} "
            f"bytes needs {human_bytes(need)} more under {data_base(cfg)}, which has "
            f"{human_bytes(free)} free; free space, set data.cache_dir to a larger disk, or use "
            f"data.hidden_states=online (the target runs in training; {TOKEN_BYTES} bytes per token)"
        )


def built_folder(key: FolderKey, modes: tuple[str, ...], quiet: bool = False) -> DataFolder | None:
    """The finished folder of one of `modes`, checked against the target and announced (unless
    `quiet`: a rank other than 0 that helped build it); None when none is built yet."""
    for mode in modes:
        path = key.folder(mode)
        if (path / MANIFEST).exists():
            manifest = load_manifest(path)
            check_target(manifest, key.target.identity, f"data folder {str(path)!r}")
            if len(modes) > 1 and not quiet:
                print(f"data.hidden_states=auto: {mode} (its data folder is built already)")
            folder = DataFolder.from_manifest(path, manifest)
            if not quiet:
                print(folder.summary(reused=True))
            return folder
    return None


def split_order(spill: TokenSpill, val_fraction: float) -> dict[str, torch.Tensor]:
    """Each split's spill indices, length-sorted: the capture batches of each shard then waste
    little padding."""
    held = held_out(spill.split_hashes(), val_fraction)
    every = torch.arange(len(spill))
    return {"train": spill.by_length(every[~held]), "validation": spill.by_length(every[held])}


class ShardWriter:
    """Writes the splits' shards from the spill: reads each shard's rows back, captures what
    `stored` names (loading the target and converting its linear layers on the first shard that
    needs them), counts the train split's supervised ids for the draft vocabulary, and times the
    forward alone, which is the rate the time budget (`trainer.plan`) scales with the data."""

    def __init__(self, key: FolderKey, stored: CaptureSpec, spill: TokenSpill,
                 order: dict[str, torch.Tensor], states: StateStore | None = None):
        self.cfg, self.target, self.stored, self.states = key.cfg, key.target, stored, states
        self.spill, self.order, self.bar = spill, order, None
        self.vocab, self.vocab_size = key.vocab, key.target.identity["vocab_size"]
        self.counts = torch.zeros(self.vocab_size, dtype=torch.int64)
        self.tokens, self.seconds = 0, 0.0
        self._capture: Capturer | None = None
        self._context: contextlib.AbstractContextManager = contextlib.nullcontext()

    def write(self, partial: Path, progress: Callable | None, ranks: Ranks = SINGLE) -> dict[str, dict]:
        """Each split's manifest record: its sizes and its shards' (with several `ranks`, only the
        shards this rank wrote or found: the records are rank 0's second pass)."""
        desc = "capture" if self.stored.needs_forward else "write"
        owners = self.owners(ranks.world)
        mine = sum(t for t, r in owners.values() if r == ranks.rank)
        self.bar = progress(total=mine, unit="tok", desc=desc) if progress else None
        splits = {}
        for split in SPLITS:
            owned = (lambda i, split=split: owners[split, i][1] == ranks.rank) if ranks.world > 1 else None
            records = write_split(partial, split, self._chunks(split), self._shard, self._written, owned)
            splits[split] = {
                k: sum(r[k] for r in records) for k in ("samples", "tokens", "masked_tokens")
            } | {"shards": records}
        if self.bar is not None:
            self.bar.close()
        return splits

    def owners(self, world: int) -> dict[tuple[str, int], tuple[int, int]]:
        """(tokens, rank that writes it) of each shard, by (split, index): balanced over `world`
        ranks by tokens (`ranks.balanced_owners`), the same on every rank."""
        n, lengths = self.cfg.data.shard_samples, self.spill.lengths
        tokens = {(split, i // n): sum(lengths[j] for j in self.order[split][i : i + n].tolist())
                  for split in SPLITS for i in range(0, len(self.order[split]), n)}
        ranks = balanced_owners(list(tokens.values()), world)
        return {shard: (t, r) for (shard, t), r in zip(tokens.items(), ranks)}

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def _chunks(self, split: str) -> Iterator[list[Tokenized]]:
        """The split's shards, read back from the spill one at a time."""
        indices, n = self.order[split], self.cfg.data.shard_samples
        for i in range(0, len(indices), n):
            chunk = self.spill.read(indices[i : i + n].tolist())
            if split == "train" and self.vocab:
                self.counts.add_(count_masked_tokens(chunk, self.vocab_size))
            yield chunk

    def _shard(self, chunk: list[Tokenized]) -> dict[str, torch.Tensor]:
        # The backend starts once (loading the target and converting its linear layers, or
        # starting vLLM, or checking the servers), before the first shard's clock starts.
        if self.stored.needs_forward and self._capture is None:
            backend = lambda: capture_backend(self.cfg, self.target, self.stored)  # noqa: E731
            if self.states is None:
                self._capture, self._context = backend()
            else:  # what regeneration kept, the rest from the backend (made only if needed)
                self._capture = OnePassCapturer(self.states, backend)
        start = time.perf_counter()
        with self._context:
            tensors = capture_shard(self._capture, chunk, self.stored)
        self.seconds += time.perf_counter() - start
        self.tokens += sum(len(t.input_ids) for t in chunk)
        return tensors

    def _written(self, record: dict) -> None:
        if self.bar is not None:
            self.bar.update(record["tokens"])
            if self.seconds:
                self.bar.set_postfix(tok_s=f"{self.tokens_per_s():.0f}")


def sample_rows(
    cfg: RootConfig,
    target: Target,
    stats: PrepStats,
    progress: Callable | None = None,
    answers: Path | None = None,
    ranks: Ranks = SINGLE,
    states: StateStore | None = None,
) -> Iterator[tuple[str, Tokenized]]:
    """(row uid, Tokenized) of the selected samples, as a data folder holds them: regenerated by
    the target when enabled (its prompts held in memory; `answers` is the answer cache, by
    default the config's own, `regen_cache_file`; `ranks` share the answering and every rank
    gets every row; `states` keeps the new answers' states, `data_prep.states.onepass`), else the
    conversations as they are, streamed.
    The target's weights load only when answers are to be written."""
    d, tpl = cfg.data, target.chat_template
    samples = select_samples(cfg, tpl, stats)
    if not d.regenerate.enabled:
        return iter_rows(samples, tpl, d.max_length, stats)
    samples = list(samples)
    answerer = lambda: backend_answerer(d.regenerate, target, matmul_dtype(cfg), states)  # noqa: E731
    cache = answers or regen_cache_file(cfg, target.identity, tpl)
    answered = regenerate_shares(samples, answerer, tpl, d.regenerate, d.max_length, cache, stats, progress,
                                 ranks)
    return regenerated_rows(answered, d.max_length, stats)


def spill_samples(
    cfg: RootConfig,
    target: Target,
    spill: TokenSpill,
    stats: PrepStats,
    progress: Callable | None,
    ranks: Ranks = SINGLE,
    states: StateStore | None = None,
) -> None:
    """Stream the selected samples' rows into `spill`, each tokenised once (`states`: see
    `sample_rows`)."""
    d = cfg.data
    rows = sample_rows(cfg, target, stats, progress, ranks=ranks, states=states)
    # A context manager, so that a bad row's error starts on a line of its own, not after the bar.
    with progress(unit="sample", desc="tokenize") if progress else contextlib.nullcontext() as bar:
        for uid, t in rows:
            spill.append(uid, t, split_hash(prompt_uid(uid), d.seed))
            if bar is not None:
                bar.update(1)
    spill.close()
    if not len(spill):
        raise UserError(
            f"data.source={d.source!r}: no usable sample (counts: {stats.nonzero()}); expected "
            "conversations with an assistant turn that fits in data.max_length"
        )


def capture_backend(
    cfg: RootConfig, target: Target, spec: CaptureSpec
) -> tuple[Capturer, contextlib.AbstractContextManager]:
    """The configured capture backend (`data.capture.backend`) and the context each shard is
    captured in: the transformers target with its linear layers at `data.matmul_dtype`, or the
    serving engine's (`data_prep.states.capture_engine`), where the target never loads here."""
    if cfg.data.capture.backend == "hf":
        model = target.model
        return HfCapturer(model, spec, cfg.data.capture_batch_tokens), DataLinears(model, matmul_dtype(cfg))
    from data_prep.states.capture_engine import engine_capturer

    return engine_capturer(cfg, target, spec), contextlib.nullcontext()


def write_draft_vocab(partial: Path, counts: torch.Tensor, size: int) -> dict:
    """The draft vocabulary of the `size` ids most often supervised, saved; its manifest record."""
    d2t, t2d = build_draft_vocab(counts, size)
    save_draft_vocab(partial, d2t, t2d)
    return {"file": VOCAB_FILE, "size": d2t.numel(), "coverage": coverage(counts, t2d)}


def base_manifest(cfg: RootConfig, identity: dict, spec: CaptureSpec, mode: str) -> dict:
    """What the manifest says of the folder before its shards are written."""
    return {
        "format_version": FORMAT_VERSION,
        "target": identity,
        "layer_convention": LAYER_CONVENTION,
        "hidden_states": mode,
        "aux_layer_ids": list(spec.aux_layer_ids),
        "final_layer_id": spec.final_layer_id,
        "storage_dtype": spec.storage_dtype,
        "target_top": spec.target_top,
        "matmul_dtype": str(matmul_dtype(cfg)).removeprefix("torch."),
        "max_length": cfg.data.max_length,
        "data": dataclasses.asdict(cfg.data),
        "splits": {},
        "draft_vocab": None,
    }


def build_folder(key: FolderKey, modes: tuple[str, ...], ranks: Ranks = SINGLE,
                 states: StateStore | None = None) -> DataFolder:
    """Build the data folder of `key` in the mode `modes` allows (`prepare` holds its lock): spill
    the samples, choose the mode, capture the shards into the partial folder (resuming a killed
    build's), write the draft vocabulary and the manifest, move the folder into place. Several
    `ranks` build it together (`data_prep.conversations.ranks`): each regenerates and captures its
    share, rank 0 writes the manifest, and every rank returns the finished folder. `states`: where
    regeneration keeps the states of what it answers and capture finds them (`data_prep.states.onepass`)."""
    cfg, spec, identity = key.cfg, key.spec, key.target.identity
    stats, progress = PrepStats(), progress_bars(cfg) if ranks.main else None
    spill_dir = key.sibling(f".spill{ranks.rank}" if ranks.world > 1 else ".spill")
    shutil.rmtree(spill_dir, ignore_errors=True)  # what a killed run left
    try:
        spill = TokenSpill(spill_dir)
        spill_samples(cfg, key.target, spill, stats, progress, ranks, states)
        mode = ranks.from_main(modes[0] if len(modes) == 1 or not ranks.main else choose_hidden_states(
            spec, spill.tokens, identity["hidden_size"], data_base(cfg)
        ))
        path = key.folder(mode)
        # Online shards hold what Medusa-2's do: tokens only.
        stored = spec if mode == "offline" else CaptureSpec((), None, spec.storage_dtype)
        order = split_order(spill, cfg.data.val_fraction)
        plan = {"folder": path.name, "splits": {k: spill.digest(v) for k, v in order.items()}}
        partial = open_partial(path, plan) if ranks.main else None
        if stored.needs_forward and ranks.main:
            fixed = draft_vocab_bytes(key.vocab, identity["vocab_size"])
            check_space(cfg, stored, spill.tokens, identity["hidden_size"], partial, fixed)
        partial = ranks.from_main(partial)
        writer = ShardWriter(key, stored, spill, order, states if stored.needs_forward else None)
        splits = writer.write(partial, progress, ranks)
        # Every rank's capture: tokens summed, the slowest rank's seconds (the stage's rate).
        done = ranks.gather((writer.tokens, writer.seconds, states.served if states else 0))
        one_pass = sum(d[2] for d in done)
        if ranks.world > 1:  # every rank's shards are written: rank 0 reads them all back
            ranks.barrier()
            if not ranks.main:
                ranks.barrier()  # while rank 0 writes the manifest
                return built_folder(key, (mode,), quiet=True)
            writer = ShardWriter(key, stored, spill, order)
            splits = writer.write(partial, None)
            writer.tokens, writer.seconds = sum(d[0] for d in done), max(d[1] for d in done)
        manifest = base_manifest(cfg, identity, spec, mode) | {"splits": splits}
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)
    if key.vocab:
        manifest["draft_vocab"] = write_draft_vocab(partial, writer.counts, key.vocab)
    if stored.needs_forward:
        manifest["capture_tokens_per_s"] = writer.tokens_per_s()
    if states is not None and stored.needs_forward:
        manifest["one_pass_tokens"] = one_pass  # of the tokens captured, those regeneration kept
    manifest["stats"] = stats.as_dict()
    folder = DataFolder.from_manifest(path, finish(partial, path, manifest))
    ranks.barrier()
    print(folder.summary(reused=False))
    return folder
