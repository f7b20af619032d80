"""Capture throughput vs the bare target forward on the same batches; prints ONE JSON line.

    flock /tmp/draftsmith-heavy.lock python scripts/bench_capture.py [--storage fp8]

Samples are ShareGPT conversations with their original answers (no regeneration), tokenized
and sharded exactly as `prepare` does; EAGLE-3 capture (three aux layers + the final one).
`forward_tokens_per_s` times the same model call without hidden states, storage or lm_head;
`full_logits_forward_tokens_per_s` is a plain `model(ids)`, the full-vocabulary lm_head included,
which EAGLE-3's capture also runs once per token for the target's top-1 (`capture.TOP`). Each side takes its
best of `--reps` interleaved rounds, so a neighbour's load spike hurts both alike.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from conf.compose import compose_root
from data_prep.folders.build import sample_rows
from data_prep.folders.keys import matmul_dtype
from data_prep.folders.store import capture_shards, open_partial
from data_prep.linears import DataLinears
from data_prep.prepare import capture_spec
from data_prep.states.capture import bare_forward
from data_prep.stats import PrepStats
from data_prep.target import resolve_target
from heads.kinds import head_kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--storage", default="bfloat16", choices=["bfloat16", "fp8"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    overrides = [
        "+head=eagle3",
        f"data.max_samples={args.samples}",
        "data.regenerate.enabled=false",
        f"data.storage_dtype={args.storage}",
        f"target.num_threads={args.threads}",
    ]
    cfg = compose_root(overrides)
    target = resolve_target(cfg)
    model = target.model
    n_layers = model.config.get_text_config().num_hidden_layers
    spec = capture_spec(cfg, head_kind(cfg.head.name), n_layers)
    d = cfg.data
    rows = sample_rows(cfg, target, PrepStats())
    items = sorted((t for _, t in rows), key=lambda t: len(t.input_ids))
    shards = [items[i : i + d.shard_samples] for i in range(0, len(items), d.shard_samples)]
    tokens = sum(len(t.input_ids) for t in items)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def capture_to_disk() -> list[dict]:
        with tempfile.TemporaryDirectory() as tmp:
            partial = open_partial(Path(tmp) / "data", {})
            return capture_shards(model, spec, shards, partial, d.capture_batch_tokens)

    records: list[dict] = []
    forward, capture = [], []
    with DataLinears(model, matmul_dtype(cfg)):  # the linears as data prep runs them
        for _ in range(args.reps):
            forward.append(timed(lambda: bare_forward(model, shards, d.capture_batch_tokens, False)))
            capture.append(timed(lambda: records.extend(capture_to_disk())))
        full = timed(lambda: bare_forward(model, shards, d.capture_batch_tokens, True))
    nbytes = sum(r["bytes"] for r in records) / args.reps
    hidden = model.config.get_text_config().hidden_size
    print(
        json.dumps(
            {
                "capture_tokens_per_s": round(tokens / min(capture), 1),
                "forward_tokens_per_s": round(tokens / min(forward), 1),
                "ratio": round(min(forward) / min(capture), 3),
                "bytes_per_token": round(nbytes / tokens, 1),
                "hidden_size": hidden,
                "bytes_per_token_over_hidden": round(nbytes / tokens / hidden, 3),
                "full_logits_forward_tokens_per_s": round(tokens / full, 1),
                "storage_dtype": args.storage,
                "matmul_dtype": str(matmul_dtype(cfg)).removeprefix("torch."),
                "samples": len(items),
                "tokens": tokens,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
