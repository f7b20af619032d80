"""`prepare(cfg)`: conversations -> regenerated answers -> captured shards + draft vocabulary.

Also the Hydra app `python -m data_prep.prepare +head=eagle3` (or `+head=medusa`). The head
decides what is captured: EAGLE-3 three auxiliary layers and the final one, Medusa the final
one, Medusa-2 joint training tokens only. Every stage is cached: the finished folder (keyed by
target, data config and what is captured), the regenerated answers (keyed without
`max_samples`, so growing the set reuses them) and, inside an unfinished folder, each shard.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import hydra
from omegaconf import DictConfig

from conf.compose import hydra_main
from conf.errors import UserError, exit_on_user_error
from conf.schema import RootConfig, to_root_config
from data_prep.capture import LAYER_CONVENTION, CaptureSpec, capture_shard
from data_prep.regenerate import regenerate
from data_prep.sources import (
    Sample,
    fingerprint_path,
    iter_samples,
    source_fingerprint,
    source_rows,
    validation_uids,
)
from data_prep.store import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    check_target,
    finish,
    load_manifest,
    open_partial,
    write_split,
)
from data_prep.target import (
    cache_root,
    load_target_from_config,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_target_path,
    tokenizer_hash,
)
from data_prep.template import Tokenized, prompt_ids, tokenize_conversation
from data_prep.vocab import (
    VOCAB_FILE,
    build_draft_vocab,
    count_masked_tokens,
    coverage,
    save_draft_vocab,
)
from heads.eagle3 import resolve_aux_layer_ids


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def target_identity(cfg: RootConfig, tok, model_config) -> dict:
    """What captured data depends on in the target; the last five fields are checked on reuse."""
    t = model_config.get_text_config()
    path = resolve_target_path(cfg.target.name_or_path)
    return {
        "name_or_path": cfg.target.name_or_path,
        "revision": cfg.target.revision,
        "tokenizer_hash": tokenizer_hash(tok),
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "num_hidden_layers": t.num_hidden_layers,
        "weights": fingerprint_path(Path(path)) or f"hub:{path}@{cfg.target.revision}",
    }


def capture_spec(cfg: RootConfig, num_hidden_layers: int) -> CaptureSpec:
    """What the chosen head trains on."""
    head, n = cfg.head, num_hidden_layers
    if head.name == "eagle3":
        aux = resolve_aux_layer_ids(head.aux_layer_ids, n)
        return CaptureSpec(tuple(aux), n, cfg.data.storage_dtype)
    if head.joint:  # Medusa-2 runs the target itself during training
        return CaptureSpec((), None, cfg.data.storage_dtype)
    return CaptureSpec((), n, cfg.data.storage_dtype)


def draft_vocab_size(cfg: RootConfig, vocab_size: int) -> int | None:
    return min(cfg.data.draft_vocab_size, vocab_size) if cfg.head.name == "eagle3" else None


def check_source(cfg: RootConfig) -> None:
    """The one data check that needs the outside world (the schema did the rest): a missing local
    source file is refused here, before any model is loaded."""
    source_rows(cfg.data)


def data_folder(cfg: RootConfig, identity: dict, spec: CaptureSpec, vocab: int | None) -> Path:
    """`<cache_dir or cache_root()/data>/<key>`; the key covers everything the shards depend on."""
    base = Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else cache_root() / "data"
    data = asdict(cfg.data)
    data.pop("cache_dir")
    key = _hash(
        {
            "format": FORMAT_VERSION,
            "target": {k: identity[k] for k in ("name_or_path", "revision")},
            "dtype": str(resolve_dtype(cfg.target.dtype, resolve_device(cfg.target.device))),
            "data": data,
            "source": source_fingerprint(cfg.data),
            "capture": asdict(spec),
            "draft_vocab_size": vocab,
        }
    )
    return base / key


def regen_cache_file(cfg: RootConfig, identity: dict) -> Path:
    """Keyed by everything an answer depends on, but not by max_samples or capture settings."""
    base = Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else cache_root() / "data"
    d = cfg.data
    key = _hash(
        {
            "target": identity,
            "source": source_fingerprint(d),
            "max_length": d.max_length,
            "max_turns": d.max_turns,
            "regenerate": asdict(d.regenerate),
        }
    )
    return base / "regenerated" / f"{key}.jsonl"


def select_samples(cfg: RootConfig, tok, stats: Counter) -> list[Sample]:
    """The first `max_samples` usable samples; with regeneration, whose first prompt leaves room
    for a whole answer within max_length (so no generation is wasted on truncated text)."""
    d = cfg.data
    samples = iter_samples(d, stats)
    if d.regenerate.enabled:
        budget = d.max_length - d.regenerate.max_new_tokens

        def fits(s: Sample) -> bool:
            first_user = next(i for i, m in enumerate(s.messages) if m["role"] == "user")
            ok = len(prompt_ids(tok, s.messages[: first_user + 1])) <= budget
            stats["skipped_prompt_too_long"] += not ok
            return ok

        samples = filter(fits, samples)
    return list(itertools.islice(samples, d.max_samples or None))


def tokenize_all(samples: list[Sample], tok, max_length: int, stats: Counter) -> dict:
    """uid -> Tokenized; samples with nothing to learn (no assistant token left) are dropped."""
    out = {}
    for s in samples:
        t = tokenize_conversation(tok, s.messages, max_length)
        stats["truncated"] += t.truncated
        if not any(t.loss_mask):
            stats["skipped_no_assistant_token"] += 1
            continue
        out[s.uid] = t
    return out


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
    parts = [
        f"data: {samples} samples ("
        + ", ".join(f"{k} {v['samples']}" for k, v in splits.items())
        + f"), {tokens} tokens",
        f"{nbytes / max(tokens, 1):.0f} bytes/token",
        "reused" if reused else f"capture {manifest['capture_tokens_per_s']:.0f} tokens/s",
    ]
    stats = manifest["stats"]
    if not reused and stats.get("regenerated_tokens"):
        rate = stats["regenerated_tokens"] / max(stats["regenerate_seconds"], 1e-9)
        parts.append(f"regenerated {stats['regenerated_tokens']} tokens at {rate:.1f} tokens/s")
    if vocab:
        parts.append(f"draft vocab {vocab['size']} coverage {vocab['coverage']:.4f}")
    counted = ("skipped", "trunc", "turns", "answers")
    skipped = {k: v for k, v in stats.items() if k.startswith(counted)}
    if skipped:
        parts.append(" ".join(f"{k}={v}" for k, v in sorted(skipped.items())))
    return ", ".join(parts) + f" -> {folder}"


def prepare(cfg: RootConfig, target=None) -> Path:
    """Build (or reuse) the data folder for `cfg` and return it.

    `target` may be an already loaded `(model, tokenizer)` pair of `cfg.target`, so a caller that
    holds the target does not load it twice.
    """
    check_source(cfg)
    d = cfg.data
    if target is not None:
        model, tok = target
        model_config = model.config
    else:
        from transformers import AutoConfig

        model = None
        tok = load_tokenizer(cfg.target.name_or_path, cfg.target.revision, cfg.target.trust_remote_code)
        model_config = AutoConfig.from_pretrained(
            resolve_target_path(cfg.target.name_or_path),
            revision=cfg.target.revision,
            trust_remote_code=cfg.target.trust_remote_code,
        )
    identity = target_identity(cfg, tok, model_config)
    spec = capture_spec(cfg, identity["num_hidden_layers"])
    vocab_k = draft_vocab_size(cfg, identity["vocab_size"])
    folder = data_folder(cfg, identity, spec, vocab_k)
    if (folder / MANIFEST).exists():
        manifest = load_manifest(folder)
        check_target(manifest, identity, f"data folder {str(folder)!r}")
        print(_summary(manifest, folder, reused=True))
        return folder

    stats: Counter = Counter()
    samples = select_samples(cfg, tok, stats)
    needs_model = d.regenerate.enabled or spec.needs_forward
    if model is None and needs_model:
        model, _ = load_target_from_config(cfg.target)
    progress = _progress(cfg)
    if d.regenerate.enabled:
        samples = regenerate(
            samples,
            model,
            tok,
            d.regenerate,
            d.max_length,
            regen_cache_file(cfg, identity),
            stats,
            progress,
        )
    tokenized = tokenize_all(samples, tok, d.max_length, stats)
    if not tokenized:
        raise UserError(
            f"data.source={d.source!r}: no usable sample (counts: {dict(stats)}); expected "
            "conversations with an assistant turn that fits in data.max_length"
        )
    val = validation_uids(list(tokenized), d.seed, d.val_fraction)
    splits = {
        "train": [u for u in tokenized if u not in val],
        "validation": [u for u in tokenized if u in val],
    }
    # Length-sorted shards: the capture batches of each shard then waste little padding.
    for uids in splits.values():
        uids.sort(key=lambda u: (len(tokenized[u].input_ids), u))
    plan = {
        "folder": folder.name,
        "splits": {k: _hash([(u, tokenized[u].input_ids) for u in v]) for k, v in splits.items()},
    }
    partial = open_partial(folder, plan)

    manifest: dict = {
        "format_version": FORMAT_VERSION,
        "target": identity,
        "layer_convention": LAYER_CONVENTION,
        "aux_layer_ids": list(spec.aux_layer_ids),
        "final_layer_id": spec.final_layer_id,
        "storage_dtype": spec.storage_dtype,
        "max_length": d.max_length,
        "data": asdict(d),
        "splits": {},
        "draft_vocab": None,
    }
    if vocab_k:
        counts = count_masked_tokens([tokenized[u] for u in splits["train"]], identity["vocab_size"])
        d2t, t2d = build_draft_vocab(counts, vocab_k)
        save_draft_vocab(partial, d2t, t2d, counts)
        manifest["draft_vocab"] = {
            "file": VOCAB_FILE,
            "size": d2t.numel(),
            "coverage": coverage(counts, t2d),
        }

    total_tokens = sum(len(t.input_ids) for t in tokenized.values())
    bar = progress(total=total_tokens, unit="tok", desc="capture") if progress else None
    timing = {"tokens": 0, "seconds": 0.0}

    def make_shard(chunk: list[Tokenized]):
        start = time.perf_counter()
        tensors = capture_shard(model, chunk, spec, d.capture_batch_tokens)
        timing["seconds"] += time.perf_counter() - start
        timing["tokens"] += sum(len(t.input_ids) for t in chunk)
        return tensors

    def on_shard(record: dict) -> None:
        if bar is not None:
            bar.update(record["tokens"])
            if timing["seconds"]:
                bar.set_postfix(tok_s=f"{timing['tokens'] / timing['seconds']:.0f}")

    for split in SPLITS:
        items = [tokenized[u] for u in splits[split]]
        chunks = [items[i : i + d.shard_samples] for i in range(0, len(items), d.shard_samples)]
        records = write_split(partial, split, chunks, make_shard, on_shard)
        manifest["splits"][split] = {
            "samples": sum(r["samples"] for r in records),
            "tokens": sum(r["tokens"] for r in records),
            "masked_tokens": sum(r["masked_tokens"] for r in records),
            "shards": records,
        }
    if bar is not None:
        bar.close()
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
