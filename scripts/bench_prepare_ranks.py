"""Data prep by one process vs by several torchrun ranks on this machine; ONE JSON line.

    python scripts/bench_prepare_ranks.py [conversations=256] [nproc=2] [threads=0] [data prep overrides]

Builds the same data folder twice from nothing, each into its own throw-away cache and as a user
types it: `python -m data_prep.prepare +head=eagle3 data.max_samples=N ...`, then
`torchrun --nproc_per_node P -m data_prep.prepare ...` (torchrun gives each rank one thread).
The single process keeps torch's default, every core (`threads=0`), or `threads=1`: one thread,
as one rank has, which on a CPU stands for what the ranks are for on a node (one process per
GPU, each GPU doing its share). `ratio` = the ranks' wall over the single process's;
`same_rows` whether both manifests list the same shards of the same rows and counts; the stage figures
come from the manifests (regeneration's wall and tokens, the capture's rate) and show where the
time went. Run it alone on the machine: the two builds are timed back to back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conf.compose import split_args
from conf.errors import UserError, exit_on_user_error
from conf.usage import answer_help

ROOT = Path(__file__).resolve().parents[1]


def build(cmd: list[str], cache: Path, env: dict | None = None) -> tuple[float, dict]:
    """The wall seconds of `cmd` building a folder under `cache`, and its manifest."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise UserError(f"{' '.join(cmd[:4])} ... failed: {proc.stderr.strip().splitlines()[-1:]}")
    (manifest,) = cache.glob("*/manifest.json")
    return round(wall, 1), json.loads(manifest.read_text())


def figures(wall: float, m: dict) -> dict:
    s = m["stats"]
    return {"wall_s": wall, "regenerate_s": s["regenerate_seconds"],
            "regenerated_tokens": s["regenerated_tokens"],
            "capture_tokens_per_s": round(m.get("capture_tokens_per_s", 0.0), 1)}


def contents(m: dict) -> dict:
    """What two builds of one folder must share: each shard's samples and tokens, the stats but
    the seconds. Not the shards' bytes: with one pass (`data_prep.states.onepass`) a row's states come
    from the batch that answered it, equal within float noise (tests/e2e/test_prepare_ranks.py)."""
    stats = {k: v for k, v in m["stats"].items() if k != "regenerate_seconds"}
    rows = {split: [(sh["file"], sh["samples"], sh["tokens"], sh["masked_tokens"]) for sh in v["shards"]]
            for split, v in m["splits"].items()}
    return {"rows": rows, "stats": stats}


@exit_on_user_error
def main(argv: list[str]) -> None:
    answer_help(__doc__, argv)
    own, overrides = split_args(argv, ("conversations", "nproc", "threads"))
    defaults = {"conversations": "256", "nproc": "2", "threads": "0"}
    given = {k: own.get(k, d) for k, d in defaults.items()}
    if not all(v.isdigit() for v in given.values()):
        raise UserError(f"{given}: expected whole numbers")
    n, nproc, threads = (int(v) for v in given.values())
    if n < 1 or nproc < 2:
        raise UserError(f"conversations={n} nproc={nproc}: expected conversations >= 1 and nproc >= 2")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    with tempfile.TemporaryDirectory() as tmp:
        one, ranks = Path(tmp) / "one", Path(tmp) / "ranks"
        args = ["-m", "data_prep.prepare", "+head=eagle3", f"data.max_samples={n}", *overrides]
        single = build([sys.executable, *args, f"data.cache_dir={one}"], one, env)
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        shared = build([*run, *args, f"data.cache_dir={ranks}"], ranks)
    print(json.dumps({
        "bench": "prepare_ranks", "conversations": n, "nproc": nproc, "threads": threads or "all",
        "samples": single[1]["splits"]["train"]["samples"] + single[1]["splits"]["validation"]["samples"],
        "one_process": figures(*single), "ranks": figures(*shared),
        "ratio": round(shared[0] / single[0], 3), "same_rows": contents(single[1]) == contents(shared[1]),
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
