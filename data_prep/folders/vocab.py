"""The EAGLE-3 draft vocabulary: the most frequent trained-on target tokens.

A smaller lm_head makes every draft step cheaper; the tokens it drops are ones the target rarely
emits in the training answers. The vocabulary is a product of the data (`data.draft_vocab_size`),
and a head takes its size from the `d2t` it is built with. `d2t`/`t2d` follow the engines' convention
(`target = draft + d2t[draft]`, `t2d[target]` marks kept ids) so export copies them as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conf.errors import UserError
from data_prep.folders.store import MANIFEST, check_file, load_manifest

VOCAB_FILE = "draft_vocab.safetensors"


def count_masked_tokens(samples: Iterable, vocab_size: int) -> torch.Tensor:
    """Frequency [V] of each target id under the loss mask (what the head will have to draft)."""
    # One bincount for all: a [V] count per sample cost as much as tokenising it.
    ids = [t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m]
    return torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]): top `draft_vocab_size` ids by count, ties to the lower id.

    On a small data set many ids are never seen; they fill the remaining slots in id order, which
    for BPE vocabularies is roughly merge (so frequency) order: a better prior for what the target
    will emit at evaluation than leaving the slots out. Sorted ascending so that draft id order
    follows target id order.
    """
    v = counts.numel()
    k = max(1, min(draft_vocab_size, v))
    # Stable sort on descending counts keeps ties in ascending id order.
    order = torch.sort(-counts, stable=True).indices[:k]
    kept = torch.sort(order).values
    d2t = kept - torch.arange(k)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of masked tokens whose target id is in the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


def draft_vocab_bytes(draft_vocab_size: int | None, vocab_size: int) -> int:
    """What `save_draft_vocab` writes, less the file's header: d2t int64 [Vd] and t2d bool [V]
    (0 without a draft vocabulary), for the space a data folder needs."""
    return 8 * min(draft_vocab_size, vocab_size) + vocab_size if draft_vocab_size else 0


def save_draft_vocab(folder: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Only what a head is built from: the counts behind it (8 bytes per target id, 0.4 MB for a
    49k vocabulary) would dominate an online data folder, which keeps ~5 bytes per token."""
    save_file({"d2t": d2t, "t2d": t2d}, str(folder / VOCAB_FILE))


def load_draft_vocab(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a data folder, checked against the manifest's checksum when it has one."""
    path = Path(folder) / VOCAB_FILE
    if not path.exists():
        raise UserError(
            f"data folder {str(folder)!r}: no {VOCAB_FILE} (it is written for EAGLE-3 heads "
            "only; prepare the data with +head=eagle3)"
        )
    if (Path(folder) / MANIFEST).exists():
        check_file(Path(folder), load_manifest(folder).get("draft_vocab") or {})
    tensors = load_file(str(path))
    return tensors["d2t"], tensors["t2d"]
