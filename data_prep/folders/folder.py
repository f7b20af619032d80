"""`DataFolder`: what `prepare` returns, a built data folder read back as typed fields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_prep.stats import PrepStats


@dataclass(frozen=True)
class SplitStats:
    samples: int
    tokens: int
    masked_tokens: int  # supervised tokens (the loss mask's)


@dataclass(frozen=True)
class DataFolder:
    """A finished data folder: its path and manifest, each split's size, and the rates measured
    while it was built, which the time budget (`trainer.plan`) scales with the data. A reused
    folder's rates are those of its build."""

    path: Path
    manifest: dict
    splits: dict[str, SplitStats]
    stats: PrepStats  # as the manifest records them; a copy, not the build's counter
    capture_tokens_per_s: float | None  # None: nothing was captured (online, or tokens only)

    @classmethod
    def from_manifest(cls, path: Path, manifest: dict) -> DataFolder:
        splits = {k: SplitStats(s["samples"], s["tokens"], s["masked_tokens"])
                  for k, s in manifest["splits"].items()}
        stats = PrepStats(**manifest["stats"])
        return cls(Path(path), manifest, splits, stats, manifest.get("capture_tokens_per_s"))

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.splits.values())

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.splits.values())

    @property
    def tokens_per_sample(self) -> float:
        return self.tokens / max(self.samples, 1)

    @property
    def hidden_states(self) -> str:
        return self.manifest["hidden_states"]

    @property
    def regenerate_tokens_per_s(self) -> float | None:
        """New tokens a second while answers were written; None when none was (all cached)."""
        s = self.stats
        return s.regenerated_tokens / max(s.regenerate_seconds, 1e-9) if s.regenerated_tokens else None

    def summary(self, reused: bool) -> str:
        """The one line data prep ends with: sizes, mode, rates, the draft vocabulary and the
        counts of what was skipped or cut, then the folder."""
        m = self.manifest
        nbytes = sum(sh["bytes"] for s in m["splits"].values() for sh in s["shards"])
        parts = [
            f"data: {self.samples} samples ("
            + ", ".join(f"{k} {v.samples}" for k, v in self.splits.items())
            + f"), {self.tokens} tokens",
            f"{nbytes / max(self.tokens, 1):.0f} bytes/token",
            f"hidden states {self.hidden_states}",
        ]
        if reused:
            parts.append("reused")
        elif self.capture_tokens_per_s is not None:
            kept = m.get("one_pass_tokens")  # the share regeneration's engine kept (one pass)
            share = f" ({kept / max(self.tokens, 1):.0%} kept by regeneration)" if kept else ""
            parts.append(f"capture {self.capture_tokens_per_s:.0f} tokens/s{share}")
        rate = self.regenerate_tokens_per_s
        if not reused and rate is not None:
            parts.append(f"regenerated {self.stats.regenerated_tokens} tokens at {rate:.1f} tokens/s")
        if vocab := m["draft_vocab"]:
            parts.append(f"draft vocab {vocab['size']} coverage {vocab['coverage']:.4f}")
        if shown := self.stats.shown():
            parts.append(" ".join(f"{k}={v}" for k, v in sorted(shown.items())))
        return ", ".join(parts) + f" -> {self.path}"
