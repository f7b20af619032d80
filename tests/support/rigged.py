"""Heads rigged to be accepted on the engine checks' own prompts.

An engine check (scripts/check_vllm.py, scripts/check_llama_cpp.py) compares the engine with our
decoder on the same weights; it measures no head quality. A head that is rarely accepted would
compare little beyond the first slot, so these heads are trained in process, for a few dozen
steps, on the target's greedy answers to the very prompts the check then decodes (the
evaluator's first MT-Bench, HumanEval and GSM8K prompts, encoded as the check encodes them).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from conf.schema import EvalConfig
from data_prep.capture import TOP, greedy_ids
from data_prep.target import eos_token_ids
from data_prep.vocab import build_draft_vocab
from trainer.batching import collate
from trainer.decoding import greedy_generate
from trainer.evaluate.tasks import encode, load_prompts


def check_prompts(tokenizer, prompts: int, max_tokens: int) -> list[torch.Tensor]:
    """The token ids a check decodes with `--prompts prompts --max-tokens max_tokens`."""
    cfg = EvalConfig(max_prompts_per_task=-(-prompts // 3), max_new_tokens=max_tokens)
    return [encode(tokenizer, p) for ps in load_prompts(cfg).values() for p in ps][:prompts]


def rigged_head(model, tokenizer, name: str, out: Path, head_class, cfg, trainee: Callable,
                prompts: int, max_tokens: int, steps: int = 60, draft_vocab: int = 2048) -> Path:
    """An EAGLE-style head (`head_class.from_target(model, name, cfg, d2t, t2d)`, trained by
    `trainee(head, lm_head_weight)`) over the answers' `draft_vocab` most frequent ids, trained
    `steps` full-batch steps on the answers (the teacher's rows), saved in the project's format."""
    eos = eos_token_ids(model, tokenizer)
    xs = check_prompts(tokenizer, prompts, max_tokens)
    texts = [torch.cat([x, torch.tensor(greedy_generate(model, x, max_tokens, eos).tokens)]) for x in xs]
    d2t, t2d = build_draft_vocab(torch.bincount(torch.cat(texts), minlength=model.config.vocab_size),
                                 draft_vocab)
    torch.manual_seed(0)
    head = head_class.from_target(model, name, cfg, d2t, t2d)
    trained = trainee(head, model.get_output_embeddings().weight)
    samples = []
    with torch.no_grad():
        for x, ids in zip(xs, texts):
            hs = model(ids[None], output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i][0] for i in head.aux_layer_ids], -1)
            answer = torch.arange(ids.numel()) >= x.numel()
            final = hs[-1][0]
            samples.append({"input_ids": ids, "loss_mask": answer, "aux_hidden": aux, "final_hidden": final,
                            TOP: greedy_ids(model.get_output_embeddings(), final)})
    batch = collate(samples, trained.batch_index)
    opt = torch.optim.AdamW(trained.head.parameters(), lr=2e-3)
    for _ in range(steps):
        loss = trained(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().save_pretrained(out)


def check_lines(cmd: list[str], count: int, root: Path, **env: str) -> list[dict]:
    """An engine check run as a user runs it from the checkout `root` (its own side importing
    this checkout's modules, `env` added): its JSON lines, `count` of them or its stderr's end."""
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=1500,
                          env={**os.environ, "PYTHONPATH": str(root), **env})
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == count, f"rc={done.returncode}\n{done.stderr[-4000:]}"
    return lines
