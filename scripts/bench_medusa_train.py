"""Medusa training throughput and peak memory on the embedded target; prints one JSON line.

    flock /tmp/draftsmith-heavy.lock \
        python scripts/bench_medusa_train.py [--labelled F] [key=value ...]
    (any root-config override, e.g. head.num_heads=2 or head.joint=true head.lora_rank=16)

Batches are real chat-templated ShareGPT conversations through the real target, as
`scripts/bench_train.py` builds them for EAGLE-3; Medusa-1 reads their final hidden states,
Medusa-2 (`head.joint=true`) runs the target itself. The last fraction F (default 1.0, the worst
case) of each row is labelled, as an answer after its prompt: the full-vocabulary losses, which
dominate, scale with the labelled tokens.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch
from bench_train import real_batch

from trainer.cli import compose_root
from trainer.distributed import mixed_precision
from trainer.medusa_objective import build_medusa_trainee
from trainer.target import load_target_from_config


def main(argv: list[str]) -> None:
    labelled = 1.0
    if argv[:1] == ["--labelled"]:
        labelled, argv = float(argv[1]), argv[2:]
    cfg = compose_root(["+head=medusa", *argv])
    model, tok = load_target_from_config(cfg.target)
    trainee = build_medusa_trainee(cfg, model, None).to(model.device)
    seq_len = min(512, cfg.optim.batch_tokens)
    rows = max(1, cfg.optim.batch_tokens // seq_len)
    batch = real_batch(model, tok, [0], rows, seq_len)
    del batch["aux_hidden"]  # EAGLE-3's input: Medusa reads final_hidden only
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["loss_mask"][:, : round(seq_len * (1 - labelled))] = False
    groups = trainee.param_groups(1e-4, 0.0)
    opt = torch.optim.AdamW(groups)
    use_bf16 = mixed_precision(cfg.dist) == "bf16"

    def step() -> None:
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = trainee(batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up
    if model.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    n = 3
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    elapsed = time.perf_counter() - t0
    trainable = sum(p.numel() for g in groups for p in g["params"])
    print(
        json.dumps(
            {
                "target": cfg.target.name_or_path,
                "device": str(model.device),
                "precision": "bf16-autocast" if use_bf16 else "fp32",
                "threads": torch.get_num_threads(),
                "num_heads": cfg.head.num_heads,
                "joint": cfg.head.joint,
                "lora_rank": cfg.head.lora_rank,
                "trainable_params": trainable,
                "batch_shape": list(batch["input_ids"].shape),
                "labelled_tokens": int(batch["loss_mask"].sum()),
                "train_tokens_per_s": round(n * batch["input_ids"].numel() / elapsed, 1),
                "labelled_tokens_per_s": round(n * int(batch["loss_mask"].sum()) / elapsed, 1),
                "step_s": round(elapsed / n, 3),
                "peak_memory_mib": round(peak, 1),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
