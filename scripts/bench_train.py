"""Training throughput and peak memory of a head on the embedded target; prints one JSON line.

    python scripts/bench_train.py [+head=eagle3|medusa] [--labelled F] [key=value ...]
    (any root-config override, e.g. head.ttt_length=3, or head.joint=true head.lora_rank=16)

Batches are real: chat-templated conversations from `data.source` (ShareGPT by default) through
the real target, captured as training will see them (fp32 on CPU, bf16 autocast on a GPU), at
`optim.batch_tokens` tokens per batch. The last fraction F (default 1.0, the worst case) of each
row is labelled, as an answer after its prompt: the vocabulary projections, and EAGLE-3's later
unroll steps, scale with the labelled tokens. EAGLE-3 is the default head.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import Counter

import torch

from conf.compose import compose_root
from conf.schema import DataConfig, RootConfig
from data_prep.sources import iter_samples
from data_prep.target import load_target_from_config
from heads.eagle3 import Eagle3Head
from trainer.distributed import mixed_precision
from trainer.eagle3_trainee import Eagle3Trainee
from trainer.medusa_trainee import build_medusa_trainee


def real_tokens(
    tok, data_cfg: DataConfig, rows: int, seq_len: int, labelled: float
) -> dict[str, torch.Tensor]:
    """`rows` chat-templated conversations of `data_cfg.source` cut to `seq_len` tokens (CPU
    `input_ids`, `loss_mask`), the last `labelled` fraction of each row labelled."""
    data_cfg.regenerate.enabled = False  # the source's answers as they are: enough for timing
    texts = []
    for sample in iter_samples(data_cfg, Counter()):
        ids = tok.apply_chat_template(sample.messages, tokenize=True, return_dict=True)["input_ids"]
        if len(ids) >= seq_len:
            texts.append(ids[:seq_len])
        if len(texts) == rows:
            break
    ids = torch.tensor(texts)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, : round(seq_len * (1 - labelled))] = False
    return {"input_ids": ids, "loss_mask": mask}


def eagle3_trainee(cfg, model) -> tuple[torch.nn.Module, dict]:
    vocab = model.config.vocab_size
    draft = min(cfg.data.draft_vocab_size, vocab)
    d2t = torch.zeros(draft, dtype=torch.long)  # the lowest ids: cost depends only on the size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft] = True
    head = Eagle3Head.from_target(model, cfg.target.name_or_path, cfg.head, d2t, t2d)
    trainee = Eagle3Trainee(
        head, model.get_output_embeddings().weight, cfg.head.ttt_length, cfg.head.step_weight
    )
    return trainee, {"ttt_length": cfg.head.ttt_length, "draft_vocab_size": draft}


def medusa_trainee(cfg, model) -> tuple[torch.nn.Module, dict]:
    trainee = build_medusa_trainee(cfg, model, None)
    fields = {"num_heads": cfg.head.num_heads, "joint": cfg.head.joint, "lora_rank": cfg.head.lora_rank}
    return trainee, fields


TRAINEES = {"eagle3": eagle3_trainee, "medusa": medusa_trainee}


def parse(argv: list[str], labelled: float = 1.0) -> tuple[RootConfig, float]:
    """(config, labelled fraction) from `[--labelled F] [+head=...] [key=value ...]`; EAGLE-3
    unless a head is named."""
    if "--labelled" in argv:
        i = argv.index("--labelled")
        labelled, argv = float(argv[i + 1]), argv[:i] + argv[i + 2 :]
    if not any(a.startswith("+head=") for a in argv):
        argv = ["+head=eagle3", *argv]
    return compose_root(argv), labelled


def batch_shape(cfg: RootConfig) -> tuple[int, int]:
    """(rows, seq_len) of one `optim.batch_tokens` batch, rows of at most 512 tokens."""
    seq_len = min(512, cfg.optim.batch_tokens)
    return max(1, cfg.optim.batch_tokens // seq_len), seq_len


def main(argv: list[str]) -> None:
    cfg, labelled = parse(argv)
    model, tok = load_target_from_config(cfg.target)
    batch = real_tokens(tok, cfg.data, *batch_shape(cfg), labelled)
    batch = {k: v.to(model.device) for k, v in batch.items()}
    trainee, fields = TRAINEES[cfg.head.name](cfg, model)
    with torch.no_grad():  # captured as training will see them (Medusa-2 reads none)
        hs = model(batch["input_ids"], output_hidden_states=True).hidden_states
    if cfg.head.name == "eagle3":
        batch["aux_hidden"] = torch.cat([hs[i] for i in trainee.head.aux_layer_ids], -1).float()
    batch["final_hidden"] = hs[-1].float()
    trainee.to(model.device)
    batch |= trainee.batch_index(batch)  # what the loader adds on the CPU; here once, untimed
    params = [p for p in trainee.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
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
    tokens, labels = batch["input_ids"].numel(), int(batch["loss_mask"].sum())
    print(
        json.dumps(
            {
                "head": cfg.head.name,
                "target": cfg.target.name_or_path,
                "device": str(model.device),
                "precision": "bf16-autocast" if use_bf16 else "fp32",
                "threads": torch.get_num_threads(),
                **fields,
                "trainable_params": sum(p.numel() for p in params),
                "batch_shape": list(batch["input_ids"].shape),
                "labelled_tokens": labels,
                "train_tokens_per_s": round(n * tokens / elapsed, 1),
                "labelled_tokens_per_s": round(n * labels / elapsed, 1),
                "step_s": round(elapsed / n, 3),
                "peak_memory_mib": round(peak, 1),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
