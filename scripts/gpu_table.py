"""One table of the figures `scripts/gpu_figures.sh` left in its OUT folder (the last JSON line of
each stage's log, and the main job's summary.json); missing stages show as '-'.

    python scripts/gpu_table.py <OUT>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def last_json(path: Path) -> dict:
    """The last line of a log that parses as a JSON object ({} if none or no log)."""
    if not path.exists():
        return {}
    for line in reversed(path.read_text(encoding="utf-8", errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {}


def rows(out: Path) -> list[tuple[str, object]]:
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    train = last_json(out / "bench_train_eagle3.log")
    main_rate, bench_rate = summary.get("train_tokens_per_s"), train.get("train_tokens_per_s")
    bf16 = last_json(out / "bench_decode_bfloat16.log")
    regen = last_json(out / "bench_regen.log")
    return [
        ("main-job train tokens/s", main_rate),
        ("bench_train EAGLE-3 tokens/s (same head, [32, 512])", bench_rate),
        ("main job / bench_train", main_rate / bench_rate if main_rate and bench_rate else None),
        ("main-job data wait share", summary.get("data_wait_fraction")),
        ("main-job validation sim. acceptance length", summary.get("best_score")),
        ("bench_train Medusa tokens/s", last_json(out / "bench_train_medusa.log").get("train_tokens_per_s")),
        ("greedy ms/token (bf16)", bf16.get("greedy_ms_per_token")),
        ("chain acceptance length / speedup vs greedy", _acceptance(bf16, "")),
        ("tree acceptance length / speedup vs greedy", _acceptance(bf16, "tree_")),
        ("float32 lossless", last_json(out / "bench_decode_float32.log").get("lossless")),
        ("regeneration new tokens/s", regen.get("regen_tokens_per_s")),
        ("regeneration / bare forward", regen.get("ratio")),
    ]


def _acceptance(decode: dict, prefix: str) -> str | None:
    """bench_decode's "<acceptance length> / <speedup>" for the chain ("") or the tree ("tree_")."""
    a, b = f"{prefix}mean_acceptance_length", f"{prefix}speedup_vs_greedy"
    return f"{decode[a]} / {decode[b]}" if a in decode and b in decode else None


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.3f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def main(out: str) -> None:
    print("| figure | value |\n| --- | --- |")
    for name, value in rows(Path(out)):
        print(f"| {name} | {_fmt(value)} |")


if __name__ == "__main__":
    main(sys.argv[1])
