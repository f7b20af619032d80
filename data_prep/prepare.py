"""`prepare(cfg)`: conversations -> regenerated answers -> captured shards + draft vocabulary.

Also the Hydra app `python -m data_prep.prepare +head=eagle3` (or `+head=medusa`). The head
decides what is captured: EAGLE-3 three auxiliary layers and the final one, Medusa the final
one, Medusa-2 joint training tokens only. With `data.hidden_states=online` nothing is captured:
the shards hold ids and masks and the training loop runs the target. Every stage is cached: the
finished folder (keyed by target, data config, what is captured and the mode), the regenerated
answers (keyed without `max_samples`, so growing the set reuses them) and, inside an unfinished
folder, each shard. Samples stream from the source through tokenisation to a `TokenSpill` on
disk, so memory holds a few dozen bytes per sample, not the source.

Caches are shared by the runs of a sweep: a folder is built under a lock file beside it
(`<key>.lock`, `conf.files.build_lock`), so runs started together build it once and the others
reuse it; the regeneration cache has its own lock. Offline capture checks the free disk against
its known size before it starts, and a disk that still fills is one line; the partial folder
resumes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from conf.compose import hydra_main
from conf.errors import UserError, exit_on_user_error
from conf.files import build_once, disk_full_is_one_line, free_bytes, human_bytes
from conf.schema import TEMPLATE_FIELDS, RootConfig, to_root_config
from data_prep.capture import LAYER_CONVENTION, TOKEN_BYTES, CaptureSpec, capture_shard
from data_prep.linears import DataLinears, resolve_matmul_dtype
from data_prep.regen_vllm import check_vllm_installed
from data_prep.regenerate import regenerate
from data_prep.sources import (
    Sample,
    check_source_exists,
    held_out,
    iter_samples,
    prompt_uid,
    row_uid,
    source_fingerprint,
    split_hash,
)
from data_prep.store import (
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
from data_prep.target import Target, cache_root, resolve_device, resolve_dtype, resolve_target
from data_prep.template import (
    ChatTemplate,
    TemplateError,
    Tokenized,
    build_rows,
    conversation_turns,
    note_refusal,
)
from data_prep.vocab import (
    VOCAB_FILE,
    build_draft_vocab,
    count_masked_tokens,
    coverage,
    draft_vocab_bytes,
    save_draft_vocab,
)
from heads.kinds import head_kind


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def capture_spec(cfg: RootConfig, num_hidden_layers: int) -> CaptureSpec:
    """What the chosen head trains on: the layers its kind captures (`heads.kinds`)."""
    aux, final = head_kind(cfg.head.name).captured_layers(cfg.head, num_hidden_layers)
    return CaptureSpec(aux, final, cfg.data.storage_dtype)


def draft_vocab_size(cfg: RootConfig, vocab_size: int) -> int | None:
    """The draft vocabulary's size, or None for a kind that drafts over the whole vocabulary."""
    return min(cfg.data.draft_vocab_size, vocab_size) if head_kind(cfg.head.name).draft_vocab else None


def check_source(cfg: RootConfig) -> None:
    """The data checks that need the outside world (the schema did the rest), before any model is
    loaded: a missing local source file or chat template, and vLLM missing for
    `data.regenerate.backend=vllm`."""
    check_source_exists(cfg.data)
    template = cfg.data.chat_template
    if template and not Path(template).expanduser().is_file():
        raise UserError(f"data.chat_template={template!r}: no such file (expected a .jinja chat template)")
    if cfg.data.regenerate.enabled and cfg.data.regenerate.backend == "vllm":
        check_vllm_installed()


_SCHEDULING = {"batch_size", "workers"}  # regeneration settings that do not change an answer


def data_base(cfg: RootConfig) -> Path:
    """`data.cache_dir`, or `cache_root()/data`: where data folders are built."""
    return Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else cache_root() / "data"


def matmul_dtype(cfg: RootConfig) -> torch.dtype:
    """The precision of the target's linear layers while it writes data (`data.matmul_dtype`)."""
    device = resolve_device(cfg.target.device)
    return resolve_matmul_dtype(cfg.data.matmul_dtype, resolve_dtype(cfg.target.dtype, device), device)


def _precision(cfg: RootConfig) -> dict:
    """The precision answers and hidden states were computed in: the target's dtype and its
    matmuls'. A float32 target adds {"matmul_dtype": ...} only when its matmuls differ, else {},
    so the keys built before these settings existed stand; any other dtype names both (a bf16
    target's answers are not a float32 one's)."""
    dtype = resolve_dtype(cfg.target.dtype, resolve_device(cfg.target.device))
    mm = matmul_dtype(cfg)
    if dtype != torch.float32:
        return {"dtype": str(dtype), "matmul_dtype": str(mm)}
    return {} if mm == dtype else {"matmul_dtype": str(mm)}


def samples_key(cfg: RootConfig, identity: dict, tpl: ChatTemplate) -> dict:
    """What the tokenised samples depend on: the target, its dtype (regeneration), the source, the
    chat template as rendered and the data config but its cache folder and `hidden_states`
    (which only decides what is stored)."""
    data = asdict(cfg.data)
    for k in ("cache_dir", "hidden_states", "matmul_dtype", *TEMPLATE_FIELDS):  # matmul: `_precision`
        data.pop(k)
    data["regenerate"].pop("workers")  # scheduling only (keys of folders built before it stand)
    return {
        "format": FORMAT_VERSION,
        "target": {k: identity[k] for k in ("name_or_path", "revision")},
        "dtype": str(resolve_dtype(cfg.target.dtype, resolve_device(cfg.target.device))),
        "data": data,
        "source": source_fingerprint(cfg.data),
        "chat_template": tpl.digest,
    } | _precision(cfg)


def data_folder(
    cfg: RootConfig, identity: dict, tpl: ChatTemplate, spec: CaptureSpec, vocab: int | None, mode: str
) -> Path:
    """`data_base/<key>`; the key covers everything the shards depend on. An online folder holds
    no hidden states, so its key differs (offline keys stay those of folders built before the
    mode existed, which are reused)."""
    key = samples_key(cfg, identity, tpl) | {"capture": asdict(spec), "draft_vocab_size": vocab}
    return data_base(cfg) / _hash(key | ({"hidden_states": mode} if mode == "online" else {}))


# Version of the regeneration cache's lines: 2 = token ids per turn (1 held answer text).
REGEN_FORMAT = 2


def regen_cache_file(cfg: RootConfig, identity: dict, tpl: ChatTemplate) -> Path:
    """Keyed by everything an answer depends on, but not by max_samples or capture settings."""
    d = cfg.data
    key = _hash(
        {
            "format": REGEN_FORMAT,
            "chat_template": tpl.digest,
            "target": identity,
            "source": source_fingerprint(d),
            "max_length": d.max_length,
            "max_turns": d.max_turns,
            # Answers do not depend on how many rows or engines decode together
            # (tests/test_regen_engine.py).
            "regenerate": {k: v for k, v in asdict(d.regenerate).items() if k not in _SCHEDULING},
        }
        | _precision(cfg)
    )
    return data_base(cfg) / "regenerated" / f"{key}.jsonl"


def select_samples(cfg: RootConfig, tpl: ChatTemplate, stats: Counter) -> Iterator[Sample]:
    """The first `max_samples` usable samples, lazily (the source is read as far as they take);
    with regeneration, those whose first prompt leaves room for a whole answer within max_length
    (so no generation is wasted on truncated text) and that the template renders."""
    d = cfg.data
    samples = iter_samples(d, stats)
    if d.regenerate.enabled:
        budget = d.max_length - d.regenerate.max_new_tokens

        def fits(s: Sample) -> bool:
            first_user = next(i for i, m in enumerate(s.messages) if m["role"] == "user")
            try:
                ok = len(tpl.prompt_ids(s.messages[: first_user + 1], s.tools)) <= budget
            except TemplateError as err:
                note_refusal(stats, tpl, s.where or s.uid, err)
                return False
            stats["skipped_prompt_too_long"] += not ok
            return ok

        samples = filter(fits, samples)
    return itertools.islice(samples, d.max_samples or None)


def iter_rows(
    samples: Iterable[Sample], tpl: ChatTemplate, max_length: int, stats: Counter
) -> Iterator[tuple[str, Tokenized]]:
    """(row uid, Tokenized) of every row of conversations used as they are (no regeneration),
    each tokenised once; turns and conversations that cannot be trained are counted by reason.
    Raises a UserError when most assistant turns were dropped: a template that does not fit the
    data, which would otherwise train on almost nothing."""
    first_bad = None
    for s in samples:
        turns_in = sum(m["role"] == "assistant" for m in s.messages)
        stats["assistant_turns"] += turns_in
        raw_before = stats["turns_raw_text"]
        try:
            turns = conversation_turns(tpl, s.messages, s.tools, stats)
        except TemplateError as err:
            note_refusal(stats, tpl, s.where or s.uid, err)
            stats["turns_dropped_refused"] += turns_in
            turns = []
        if len(turns) < turns_in:
            first_bad = first_bad or s.where or s.uid
        if stats["turns_raw_text"] and not raw_before:
            print(
                f"data: {tpl.name} drops part of an assistant turn (e.g. its reasoning), first at "
                f"{s.where or s.uid}: such turns train as the generation prompt followed by the "
                "assistant's raw text, as the model emits it"
            )
        for r, t in enumerate(build_rows(turns, max_length)):
            stats["truncated"] += t.truncated
            if not any(t.loss_mask):
                stats["skipped_no_assistant_token"] += 1
                continue
            yield row_uid(s.uid, r), t
    if first_bad and 2 * _dropped_turns(stats) > stats["assistant_turns"]:
        raise UserError(
            f"{tpl.name}: {_dropped_turns(stats)} of {stats['assistant_turns']} assistant turns could not be "
            f"trained (first at {first_bad}; counts: {_drop_counts(stats)}); check data.chat_template and "
            "data.chat_template_kwargs against the data"
        )


_DROPS = ("turns_dropped_unaligned", "turns_dropped_empty", "turns_dropped_refused")


def _drop_counts(stats: Counter) -> dict:
    return {k: stats[k] for k in _DROPS if stats[k]}


def _dropped_turns(stats: Counter) -> int:
    return sum(stats[k] for k in _DROPS)


def _progress(cfg: RootConfig):
    if not cfg.logging.progress:
        return None
    from tqdm.auto import tqdm

    return lambda **kw: tqdm(file=sys.stderr, dynamic_ncols=True, **kw)


def _summary(manifest: dict, folder: Path, reused: bool) -> str:
    splits = manifest["splits"]
    samples = sum(s["samples"] for s in splits.values())
    tokens = sum(s["tokens"] for s in splits.values())
    nbytes = sum(sh["bytes"] for s in splits.values() for sh in s["shards"])
    vocab = manifest.get("draft_vocab")
    mode = manifest.get("hidden_states", "offline")
    parts = [
        f"data: {samples} samples ("
        + ", ".join(f"{k} {v['samples']}" for k, v in splits.items())
        + f"), {tokens} tokens",
        f"{nbytes / max(tokens, 1):.0f} bytes/token",
        f"hidden states {mode}",
    ]
    if reused:
        parts.append("reused")
    elif "capture_tokens_per_s" in manifest:
        parts.append(f"capture {manifest['capture_tokens_per_s']:.0f} tokens/s")
    stats = manifest["stats"]
    if not reused and stats.get("regenerated_tokens"):
        rate = stats["regenerated_tokens"] / max(stats["regenerate_seconds"], 1e-9)
        parts.append(f"regenerated {stats['regenerated_tokens']} tokens at {rate:.1f} tokens/s")
    if vocab:
        parts.append(f"draft vocab {vocab['size']} coverage {vocab['coverage']:.4f}")
    counted = ("skipped", "trunc", "turns", "answers", "conversations")
    skipped = {k: v for k, v in stats.items() if k.startswith(counted)}
    if skipped:
        parts.append(" ".join(f"{k}={v}" for k, v in sorted(skipped.items())))
    return ", ".join(parts) + f" -> {folder}"


def regenerated_rows(
    answered: Iterable[tuple[str, list]], max_length: int, stats: Counter
) -> Iterator[tuple[str, Tokenized]]:
    """(row uid, Tokenized) of regenerated conversations: prompt ids and generated ids."""
    for uid, turns in answered:
        for r, t in enumerate(build_rows(turns, max_length)):
            stats["truncated"] += t.truncated
            yield row_uid(uid, r), t


def sample_rows(
    cfg: RootConfig,
    target: Target,
    target_model: Callable[[], object],
    stats: Counter,
    progress,
) -> Iterator[tuple[str, Tokenized]]:
    """(row uid, Tokenized) of the selected samples: regenerated by the target when enabled (its
    prompts held in memory), else the conversations as they are, streamed."""
    d, tpl = cfg.data, target.chat_template
    samples = select_samples(cfg, tpl, stats)
    if not d.regenerate.enabled:
        return iter_rows(samples, tpl, d.max_length, stats)
    answered = regenerate(
        list(samples),
        target_model(),
        tpl,
        d.regenerate,
        d.max_length,
        regen_cache_file(cfg, target.identity, tpl),
        stats,
        progress,
        target_path=target.path,
        matmul_dtype=matmul_dtype(cfg),
    )
    return regenerated_rows(answered, d.max_length, stats)


def spill_samples(
    cfg: RootConfig,
    target: Target,
    target_model: Callable[[], object],
    spill: TokenSpill,
    stats: Counter,
    progress,
) -> None:
    """Stream the selected samples' rows into `spill`, each tokenised once."""
    d = cfg.data
    rows = sample_rows(cfg, target, target_model, stats, progress)
    # A context manager, so that a bad row's error starts on a line of its own, not after the bar.
    with progress(unit="sample", desc="tokenize") if progress else contextlib.nullcontext() as bar:
        for uid, t in rows:
            spill.append(uid, t, split_hash(prompt_uid(uid), d.seed))
            if bar is not None:
                bar.update(1)
    spill.close()
    if not len(spill):
        raise UserError(
            f"data.source={d.source!r}: no usable sample (counts: {dict(stats)}); expected "
            "conversations with an assistant turn that fits in data.max_length"
        )


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


@dataclass(frozen=True)
class FolderKey:
    """What names this config's data folder, but the mode: one build lock and one spill serve
    every mode, since `auto` decides only once the samples are spilled."""

    cfg: RootConfig
    target: Target
    spec: CaptureSpec
    vocab: int | None

    def folder(self, mode: str) -> Path:
        t = self.target
        return data_folder(self.cfg, t.identity, t.chat_template, self.spec, self.vocab, mode)

    def sibling(self, suffix: str) -> Path:
        """`<key>.lock`, `<key>.spill`: beside the folders, named by the offline folder."""
        return self.folder("offline").with_suffix(suffix)


def built_folder(key: FolderKey, modes: tuple[str, ...]) -> Path | None:
    """The finished folder of one of `modes`, checked against the target and announced; None
    when none is built yet."""
    for mode in modes:
        folder = key.folder(mode)
        if (folder / MANIFEST).exists():
            manifest = load_manifest(folder)
            check_target(manifest, key.target.identity, f"data folder {str(folder)!r}")
            if len(modes) > 1:
                print(f"data.hidden_states=auto: {mode} (its data folder is built already)")
            print(_summary(manifest, folder, reused=True))
            return folder
    return None


# What a full disk during data prep leaves and how to go on.
DISK_FULL_THEN = (
    "free space (or set data.cache_dir to a larger disk, or use data.hidden_states=online) and run "
    "the same command again: it keeps the answers and shards written and resumes after them"
)


def prepare(cfg: RootConfig, target: Target | None = None, model=None) -> Path:
    """Build (or reuse) the data folder for `cfg` and return it.

    `target`: the run's resolved `cfg.target` (`resolve_target`), so that a caller that holds it
    does not resolve it again; None resolves it here. `model`: its weights when the caller has
    them loaded already; otherwise they load only if a stage needs them. Runs that prepare one
    folder at once build it once: the first under its lock, the others wait and reuse it.
    """
    check_source(cfg)
    d = cfg.data
    target = resolve_target(cfg) if target is None else target
    identity = target.identity
    spec = capture_spec(cfg, identity["num_hidden_layers"])
    key = FolderKey(cfg, target, spec, draft_vocab_size(cfg, identity["vocab_size"]))
    # auto reuses a folder of either mode: the choice was made when it was built.
    modes = ("offline", "online") if d.hidden_states == "auto" else (d.hidden_states,)

    def target_model():
        nonlocal model
        if model is None:
            model = target.load_model(cfg.target)
        return model

    def build() -> Path:
        with disk_full_is_one_line(data_base(cfg), DISK_FULL_THEN):
            return build_folder(key, modes, target_model)

    what = f"data folder {key.folder(modes[0])}"
    return build_once(key.sibling(".lock"), what, lambda: built_folder(key, modes), build)


def build_folder(key: FolderKey, modes: tuple[str, ...], target_model: Callable[[], object]) -> Path:
    """Build the data folder of `key` (`prepare` holds its lock): spill the samples, choose the mode,
    capture the shards into the partial folder (resuming a killed build's), move it into place."""
    cfg, target, spec, vocab_k = key.cfg, key.target, key.spec, key.vocab
    identity = target.identity
    d = cfg.data

    @functools.cache
    def capturing() -> DataLinears:
        """The capture's linear layers, made on its first shard."""
        return DataLinears(target_model(), matmul_dtype(cfg))

    stats: Counter = Counter()
    progress = _progress(cfg)
    spill_dir = key.sibling(".spill")
    shutil.rmtree(spill_dir, ignore_errors=True)  # what a killed run left
    try:
        spill = TokenSpill(spill_dir)
        spill_samples(cfg, target, target_model, spill, stats, progress)
        mode = (
            modes[0]
            if len(modes) == 1
            else choose_hidden_states(spec, spill.tokens, identity["hidden_size"], data_base(cfg))
        )
        folder = key.folder(mode)
        # Online shards hold what Medusa-2's do: tokens only.
        stored = spec if mode == "offline" else CaptureSpec((), None, spec.storage_dtype)
        held = held_out(spill.split_hashes(), d.val_fraction)
        every = torch.arange(len(spill))
        # Length-sorted shards: the capture batches of each shard then waste little padding.
        order = {"train": spill.by_length(every[~held]), "validation": spill.by_length(every[held])}
        plan = {"folder": folder.name, "splits": {k: spill.digest(v) for k, v in order.items()}}
        partial = open_partial(folder, plan)
        if stored.needs_forward:
            fixed = draft_vocab_bytes(vocab_k, identity["vocab_size"])
            check_space(cfg, stored, spill.tokens, identity["hidden_size"], partial, fixed)

        manifest: dict = {
            "format_version": FORMAT_VERSION,
            "target": identity,
            "layer_convention": LAYER_CONVENTION,
            "hidden_states": mode,
            "aux_layer_ids": list(spec.aux_layer_ids),
            "final_layer_id": spec.final_layer_id,
            "storage_dtype": spec.storage_dtype,
            "matmul_dtype": str(matmul_dtype(cfg)).removeprefix("torch."),
            "max_length": d.max_length,
            "data": asdict(d),
            "splits": {},
            "draft_vocab": None,
        }
        counts = torch.zeros(identity["vocab_size"], dtype=torch.int64)
        desc = "capture" if stored.needs_forward else "write"
        bar = progress(total=spill.tokens, unit="tok", desc=desc) if progress else None
        timing = {"tokens": 0, "seconds": 0.0}

        def chunks(split: str) -> Iterator[list[Tokenized]]:
            """The split's shards, read back from the spill one at a time."""
            indices = order[split]
            for i in range(0, len(indices), d.shard_samples):
                chunk = spill.read(indices[i : i + d.shard_samples].tolist())
                if split == "train" and vocab_k:
                    counts.add_(count_masked_tokens(chunk, identity["vocab_size"]))
                yield chunk

        def make_shard(chunk: list[Tokenized]):
            # The rate is the forward's alone: loading the target and converting its linear
            # layers happen once, before the first shard's clock starts (the time budget,
            # `trainer.plan`, scales this rate with the data).
            linears = capturing() if stored.needs_forward else contextlib.nullcontext()
            start = time.perf_counter()
            with linears:
                model = target_model() if stored.needs_forward else None
                tensors = capture_shard(model, chunk, stored, d.capture_batch_tokens)
            timing["seconds"] += time.perf_counter() - start
            timing["tokens"] += sum(len(t.input_ids) for t in chunk)
            return tensors

        def on_shard(record: dict) -> None:
            if bar is not None:
                bar.update(record["tokens"])
                if timing["seconds"]:
                    bar.set_postfix(tok_s=f"{timing['tokens'] / timing['seconds']:.0f}")

        for split in SPLITS:
            records = write_split(partial, split, chunks(split), make_shard, on_shard)
            manifest["splits"][split] = {
                "samples": sum(r["samples"] for r in records),
                "tokens": sum(r["tokens"] for r in records),
                "masked_tokens": sum(r["masked_tokens"] for r in records),
                "shards": records,
            }
        if bar is not None:
            bar.close()
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)
    if vocab_k:
        d2t, t2d = build_draft_vocab(counts, vocab_k)
        save_draft_vocab(partial, d2t, t2d)
        manifest["draft_vocab"] = {"file": VOCAB_FILE, "size": d2t.numel(), "coverage": coverage(counts, t2d)}
    if stored.needs_forward:
        manifest["capture_tokens_per_s"] = timing["tokens"] / max(timing["seconds"], 1e-9)
    manifest["stats"] = dict(stats)
    finish(partial, folder, manifest)
    print(_summary(manifest, folder, reused=False))
    return folder


@hydra.main(config_path="pkg://conf", config_name="config", version_base="1.3")
@exit_on_user_error
def main(dict_cfg: DictConfig) -> None:
    prepare(to_root_config(dict_cfg))


if __name__ == "__main__":
    hydra_main(main)
