"""Regeneration throughput vs the bare target forward over the same conversations; ONE JSON line.

    python scripts/bench_regen.py [prompts=N] [any main-job override, e.g. data.regenerate.batch_size=128]

Takes the first N usable prompts of the configured source (default: twice the regeneration batch,
so finished rows are refilled), regenerates their answers with the configured backend into a
throw-away cache, then runs the capture's bare forward (no hidden states kept, no lm_head) over
the resulting conversations in the same process. `ratio` = regeneration's new tokens/s over the
forward's tokens/s: how close answer writing comes to the speed of reading. With the engine,
`step_cost` is its decode step fitted to its own timed steps (`data_prep.answers.regen_cost`), and
`time_explained_by` the share of its time each part of that cost explains: fixed per step, per
row (GEMMs, lm_head, draw), per context token (attention), prefill. Any backend: with
`data.regenerate.backend=server data.regenerate.endpoints='["http://127.0.0.1:8000/v1"]'` the
answers come from running servers (`vllm serve <target folder>`) and the forward still runs here.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from conf.compose import compose_root, split_args
from conf.errors import UserError, exit_on_user_error
from conf.schema import derive
from conf.usage import answer_help
from data_prep.answers.decode_attention import applies
from data_prep.answers.regen_engine import default_workers
from data_prep.conversations.sources import prompt_uid
from data_prep.folders.build import sample_rows
from data_prep.folders.keys import matmul_dtype
from data_prep.linears import DataLinears
from data_prep.prepare import check_source
from data_prep.states.capture import bare_forward
from data_prep.stats import PrepStats
from data_prep.target import resolve_target


@exit_on_user_error
def main(argv: list[str]) -> None:
    answer_help(__doc__, argv)
    own, overrides = split_args(argv, ("prompts",))
    cfg = compose_root(["+head=eagle3", *overrides])
    regen = cfg.data.regenerate
    prompts = int(own.get("prompts", 2 * regen.batch_size))
    if prompts < 1:
        raise UserError(f"prompts={prompts}: expected an integer >= 1")
    cfg = derive(cfg, {"data.max_samples": prompts})
    check_source(cfg)
    target = resolve_target(cfg)
    model = target.model
    stats = PrepStats()
    with tempfile.TemporaryDirectory() as tmp:  # a throw-away cache: all new
        rows = list(sample_rows(cfg, target, stats, answers=Path(tmp) / "regen.jsonl"))
    cost = stats.regenerate_step_cost  # None: another backend
    regen_s = stats.regenerate_seconds  # the answers' writing alone, as data prep reports it
    items = sorted((t for _, t in rows), key=lambda t: len(t.input_ids))
    shards = [items[i : i + cfg.data.shard_samples] for i in range(0, len(items), cfg.data.shard_samples)]
    tokens = sum(len(t.input_ids) for t in items)
    with DataLinears(model, matmul_dtype(cfg)):  # the capture's forward, as data prep runs it
        start = time.perf_counter()
        bare_forward(model, shards, cfg.data.capture_batch_tokens, full_logits=False)
        forward_s = time.perf_counter() - start
    regen_rate = stats.regenerated_tokens / regen_s
    forward_rate = tokens / forward_s
    print(
        json.dumps(
            {
                "regen_tokens_per_s": round(regen_rate, 1),
                "forward_tokens_per_s": round(forward_rate, 1),
                "ratio": round(regen_rate / forward_rate, 3),
                "batch_size": regen.batch_size,
                "workers": regen.workers or default_workers(model, regen.batch_size),
                "backend": regen.backend,
                "prompts": len({prompt_uid(uid) for uid, _ in rows}),
                "new_tokens": stats.regenerated_tokens,
                "answers_cut_at_max_new_tokens": stats.answers_cut_at_max_new_tokens,
                "max_new_tokens": regen.max_new_tokens,
                "regen_s": round(regen_s, 1),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "device": str(model.device),
                "dtype": str(model.dtype).removeprefix("torch."),
                "matmul_dtype": str(matmul_dtype(cfg)).removeprefix("torch."),
                "decode_attention": "kernel" if regen.backend == "hf" and applies(model) else "torch",
                "threads": torch.get_num_threads(),
                "step_cost": cost,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
