"""Padding share of the training batches, padded vs packed (`optim.packing`); prints ONE JSON line.

    python scripts/bench_packing.py [+head=eagle3|medusa] [--epochs N] [key=value ...]

Batches are computed from sample lengths alone, as the loop computes them (no model runs): the
train split of the data folder `data_prep.prepare` reuses for the config, or prepares first as
`python -m data_prep.prepare` would (the main job's default folder is reused in seconds). The
padding share is pad tokens / all tokens of the collated batches over `--epochs` epochs (3, the
default run's); EAGLE-3 unless a head is named.
"""

from __future__ import annotations

import contextlib
import json
import sys

from conf.compose import compose_root
from conf.usage import answer_help
from data_prep.folders.store import CapturedDataset
from data_prep.prepare import prepare
from trainer.batching import length_grouped_batches, packed_batches, padding_share


def main(argv: list[str]) -> None:
    answer_help(__doc__, argv)
    epochs = 3
    if "--epochs" in argv:
        i = argv.index("--epochs")
        epochs, argv = int(argv[i + 1]), argv[:i] + argv[i + 2 :]
    if not any(a.startswith("+head=") for a in argv):
        argv = ["+head=eagle3", *argv]
    cfg = compose_root(argv)
    with contextlib.redirect_stdout(sys.stderr):  # prepare's summary line; stdout is the JSON
        folder = prepare(cfg).path
    lengths = CapturedDataset(folder, "train").lengths
    o = cfg.optim
    padded, packed = [], []
    for epoch in range(epochs):
        padded += [
            [[i] for i in b]
            for b in length_grouped_batches(lengths, o.batch_tokens, o.max_batch_size, cfg.seed, epoch)
        ]
        packed += packed_batches(lengths, o.batch_tokens, o.max_batch_size, cfg.seed, epoch)
    print(
        json.dumps(
            {
                "data_dir": str(folder),
                "samples": len(lengths),
                "tokens": sum(lengths),
                "longest": max(lengths),
                "batch_tokens": o.batch_tokens,
                "max_batch_size": o.max_batch_size,
                "epochs": epochs,
                "padding_share_padded": round(padding_share(lengths, padded), 4),
                "padding_share_packed": round(padding_share(lengths, packed), 4),
                "batches_per_epoch_padded": round(len(padded) / epochs, 1),
                "batches_per_epoch_packed": round(len(packed) / epochs, 1),
                "rows_per_batch_packed": round(sum(map(len, packed)) / len(packed), 2),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
