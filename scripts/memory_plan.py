"""What one rank holds for a Llama-3.1-8B-shaped EAGLE-3 run, offline and online, before and after
each training rank held only the target's parts: the memory plan (`trainer.plan.memory`), built on
the meta device from a config written here (no download), one JSON line per row, then a table.

    python scripts/memory_plan.py [--world 8] [--device-gb 80] [override ...]

The overrides are the main job's (`+head=`, `dist=`, `optim.batch_tokens=` ...), applied after
GPU-sized defaults: bf16 target and autocast, max_length 2048, draft vocabulary 32000, TTT 7,
16384 tokens per micro-batch, DDP. "after" is the plan of the code as it is; "before" is computed
here from the same pieces: the whole target on every rank, and the trainee's frozen tables
(embeddings, teacher rows) in float32, as they were stored before (under DDP, which keeps them as
built). Activations are an estimate (`activation_bytes_per_token` says how).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import LlamaConfig

from conf.compose import compose_root
from conf.errors import exit_on_user_error
from trainer.plan.memory import FP32, GB, MemoryPlan, build_on_meta, plan_memory

DEFAULTS = [
    "+head=eagle3", "dist=ddp", "dist.mixed_precision=bf16", "target.dtype=bfloat16",
    "data.max_length=2048", "data.draft_vocab_size=32000", "head.ttt_length=7", "optim.batch_tokens=16384",
]
COLUMNS = ("target", "trainable", "frozen", "gradients", "optimizer", "activations", "training_rank", "rank0")


def llama_31_8b() -> LlamaConfig:
    """Llama-3.1-8B's shape (its config.json's sizes; untied embeddings), no weights."""
    return LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
        tie_word_embeddings=False, rms_norm_eps=1e-5, torch_dtype="bfloat16",
    )


def float32_frozen_extra(trainee: torch.nn.Module) -> int:
    """Bytes the trainee's frozen floating tensors would add stored in float32 rather than as
    built (in bf16 under mixed precision: `trainer.trainee.store_frozen_tables`)."""
    frozen = [*(p for p in trainee.parameters() if not p.requires_grad), *trainee.buffers()]
    return sum(t.numel() * (FP32 - t.element_size()) for t in frozen if t.is_floating_point())


def rows(plan: MemoryPlan, frozen_extra: int) -> list[dict]:
    """The plan as it is ("after") and as it was ("before": the whole target on every rank, the
    frozen tables in float32)."""
    after = {k: v for k, v in plan.as_dict().items() if k in COLUMNS}
    before = dict(after, target=plan.target_whole, frozen=plan.frozen + frozen_extra)
    before["training_rank"] = before["rank0"] = sum(before[k] for k in COLUMNS[:6])
    common = {"mode": plan.mode, "strategy": plan.strategy, "world": plan.world, "tokens": plan.tokens}
    return [{**common, "when": "before", **before}, {**common, "when": "after", **after}]


def table(records: list[dict], device_gb: float) -> str:
    head = ["mode", "when", *COLUMNS, f"fits {device_gb:g} GB"]
    lines = [head]
    for r in records:
        gb = [f"{r[k] / GB:.2f}" for k in COLUMNS]
        fits = max(r["training_rank"], r["rank0"]) <= device_gb * GB
        lines.append([r["mode"], r["when"], *gb, "yes" if fits else "no"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


@exit_on_user_error
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"Defaults applied before the overrides: {' '.join(DEFAULTS)}",
    )
    parser.add_argument("--world", type=int, default=8, help="ranks (WORLD_SIZE); default 8")
    parser.add_argument("--device-gb", type=float, default=80.0, help="device memory the fits column checks")
    parser.add_argument("overrides", nargs="*",
                        help="main-job overrides, e.g. dist=zero2 optim.batch_tokens=8192")
    args = parser.parse_args(argv)
    cfg = compose_root([*DEFAULTS, *args.overrides])
    target = llama_31_8b()
    _, trainee = build_on_meta(cfg, target, torch.bfloat16)
    extra = float32_frozen_extra(trainee)
    records = [r for mode in ("offline", "online")
               for r in rows(plan_memory(cfg, target, torch.device("cuda"), args.world, mode), extra)]
    for r in records:
        print(json.dumps(r))
    print(table(records, args.device_gb))


if __name__ == "__main__":
    main(sys.argv[1:])
