"""One table of the figures `scripts/gpu_figures.sh` left in its OUT folder (the last JSON line of
each stage's log, of each document profile and padding mode for `bench_train.py preset=specforge`,
shown beside SpecForge's own figures, and the main job's summary.json); missing stages show as '-'.

    python scripts/gpu_table.py <OUT>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# SpecForge's EAGLE-3 training step on one H200 (docs/benchmarks/eagle3-sequence-packing.md,
# 2026-10-02) at the shapes of `bench_train.py preset=specforge`, padded then packed, per document
# profile (`docs`): useful tokens/s over the mean step, mean step ms, peak allocated GiB.
SPECFORGE_H200 = {
    "equal": [  # 4 x 1024
        {"useful_tokens_per_s": 46_643, "step_ms": 87.82, "peak_mem_mib": 13.09 * 1024},
        {"useful_tokens_per_s": 53_419, "step_ms": 76.68, "peak_mem_mib": 9.17 * 1024},
    ],
    "spread": [  # 512, 768, 1024, 2048
        {"useful_tokens_per_s": 29_515, "step_ms": 147.45, "peak_mem_mib": 23.98 * 1024},
        {"useful_tokens_per_s": 42_554, "step_ms": 102.27, "peak_mem_mib": 9.60 * 1024},
    ],
}
PRESET_DOCS = {"equal": "4 x 1024", "spread": "512/768/1024/2048", "lognormal": "log-normal lengths"}


def last_json(path: Path, **match) -> dict:
    """The last line of a log that parses as a JSON object with the fields in `match` ({} if none
    or no log)."""
    if not path.exists():
        return {}
    for line in reversed(path.read_text(encoding="utf-8", errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if all(record.get(k) == v for k, v in match.items()):
                return record
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
        ("draft + verify ms per step, chain / tree (bf16)", _step_ms(bf16)),
        ("decode steps on CUDA graphs", bf16.get("cuda_graphs")),
        ("chain acceptance length / speedup vs greedy", _acceptance(bf16, "")),
        ("tree acceptance length / speedup vs greedy", _acceptance(bf16, "tree_")),
        ("float32 lossless", last_json(out / "bench_decode_float32.log").get("lossless")),
        ("regeneration new tokens/s", regen.get("regen_tokens_per_s")),
        ("regeneration / bare forward", regen.get("ratio")),
        *preset_rows(out / "bench_train_specforge.log"),
    ]


def preset_rows(log: Path) -> list[tuple[str, object]]:
    """`bench_train.py preset=specforge`, each document profile padded / packed, beside
    SpecForge's own figures for the same shapes and their ratio."""
    out = []
    for docs, shape in PRESET_DOCS.items():
        runs = [last_json(log, preset="specforge", docs=docs, padding=p) for p in ("padded", "packed")]
        out.append((f"preset=specforge {shape}, padded / packed", _padded_packed(runs)))
        if docs in SPECFORGE_H200:
            ref = SPECFORGE_H200[docs]
            out.append((f"SpecForge, one H200, {shape}", _padded_packed(ref)))
            ratios = [
                f"{r['useful_tokens_per_s'] / s['useful_tokens_per_s']:.2f}" if r else "-"
                for r, s in zip(runs, ref)
            ]
            ratio = " / ".join(ratios) if any(runs) else None
            out.append((f"useful tokens/s over SpecForge's, {shape}", ratio))
    return out


def _padded_packed(runs: list[dict]) -> str | None:
    """ "a / b tok/s, a / b ms, a / b GiB": useful tokens/s, mean step and peak memory of a padded
    and a packed run ('-' for a missing one)."""
    if not any(runs):
        return None

    def pair(key: str, unit: str, scale: float, digits: int) -> str:
        return " / ".join(f"{r[key] * scale:,.{digits}f}" if key in r else "-" for r in runs) + f" {unit}"

    return ", ".join(
        [
            pair("useful_tokens_per_s", "tok/s", 1, 0),
            pair("step_ms", "ms", 1, 1),
            pair("peak_mem_mib", "GiB", 1 / 1024, 2),
        ]
    )


def _acceptance(decode: dict, prefix: str) -> str | None:
    """bench_decode's "<acceptance length> / <speedup>" for the chain ("") or the tree ("tree_")."""
    a, b = f"{prefix}mean_acceptance_length", f"{prefix}speedup_vs_greedy"
    return f"{decode[a]} / {decode[b]}" if a in decode and b in decode else None


def _step_ms(decode: dict) -> str | None:
    """bench_decode's "<draft> + <verify>" ms of one chain step and of one tree step."""
    keys = [(f"{prefix}draft_ms_per_step", f"{prefix}verify_ms_per_step") for prefix in ("", "tree_")]
    if not all(k in decode for pair in keys for k in pair):
        return None
    return " / ".join(f"{decode[d]} + {decode[v]}" for d, v in keys)


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
