"""EAGLE-3 training throughput and peak memory on the embedded target; prints one JSON line.

    python scripts/bench_train.py [key=value ...]   (any root-config override, e.g. head.ttt_length=3)

Batches are real: chat-templated ShareGPT prompts through the real target, captured as training
will see them (fp32 on CPU, bf16 autocast on a GPU), at `optim.batch_tokens` tokens per batch.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

from data_prep.sources import iter_samples
from heads.eagle3 import Eagle3Head
from trainer.cli import compose_root
from trainer.distributed import mixed_precision
from trainer.eagle3_objective import Eagle3Trainee
from trainer.target import load_target_from_config


def real_batch(model, tok, aux_ids: list[int], rows: int, seq_len: int) -> dict[str, torch.Tensor]:
    from collections import Counter

    from data_prep.config import DataConfig

    data_cfg = DataConfig()
    data_cfg.regenerate.enabled = False  # the ShareGPT answers as they are: enough for timing
    texts = []
    for sample in iter_samples(data_cfg, Counter()):
        ids = tok.apply_chat_template(sample.messages, tokenize=True, return_dict=True)["input_ids"]
        if len(ids) >= seq_len:
            texts.append(ids[:seq_len])
        if len(texts) == rows:
            break
    ids = torch.tensor(texts, device=model.device)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    return {
        "input_ids": ids,
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        "aux_hidden": torch.cat([hs[i] for i in aux_ids], -1).float(),
        "final_hidden": hs[-1].float(),
    }


def main(argv: list[str]) -> None:
    cfg = compose_root(["+head=eagle3", *argv])
    model, tok = load_target_from_config(cfg.target)
    vocab = model.config.vocab_size
    draft = min(cfg.head.draft_vocab_size, vocab)
    d2t = torch.zeros(draft, dtype=torch.long)  # the lowest ids: cost depends only on the size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft] = True
    head = Eagle3Head.from_target(model, cfg.target.name_or_path, cfg.head, d2t, t2d)
    trainee = Eagle3Trainee(
        head, model.get_output_embeddings().weight, cfg.head.ttt_length, cfg.head.step_weight
    ).to(model.device)
    seq_len = 512 if cfg.optim.batch_tokens >= 512 else cfg.optim.batch_tokens
    rows = max(1, cfg.optim.batch_tokens // seq_len)
    batch = real_batch(model, tok, head.aux_layer_ids, rows, seq_len)
    opt = torch.optim.AdamW([p for p in trainee.parameters() if p.requires_grad], lr=1e-4)
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
    n = 5
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    elapsed = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "target": cfg.target.name_or_path,
                "device": str(model.device),
                "precision": "bf16-autocast" if use_bf16 else "fp32",
                "threads": torch.get_num_threads(),
                "ttt_length": cfg.head.ttt_length,
                "batch_shape": list(batch["input_ids"].shape),
                "draft_vocab_size": draft,
                "train_tokens_per_s": round(n * batch["input_ids"].numel() / elapsed, 1),
                "step_s": round(elapsed / n, 3),
                "peak_memory_mib": round(peak, 1),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
