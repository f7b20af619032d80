"""Heads rigged to be accepted on the engine checks' own prompts.

An engine check (scripts/check_vllm.py, scripts/check_llama_cpp.py) compares the engine with our
decoder on the same weights; it measures no head quality. A head that is rarely accepted would
compare little beyond the first slot, so these heads are trained in process, for a few dozen
steps, on the target's greedy answers to the very prompts the check then decodes (the
evaluator's first MT-Bench, HumanEval and GSM8K prompts, encoded as the check encodes them):
EAGLE-style heads by `rigged_head`, block drafters (DFlash, DSpark) by `rigged_block_head`.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from conf.compose import compose_root
from conf.schema import EvalConfig
from data_prep.folders.vocab import build_draft_vocab
from data_prep.states.capture import TOP, greedy_ids
from data_prep.target import eos_token_ids
from trainer.batching import collate
from trainer.decoding import greedy_generate
from trainer.evaluate.tasks import encode, load_prompts
from trainer.kinds import CATALOG


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


def answered_rows(model, tokenizer, prompts: int, max_tokens: int) -> dict[str, torch.Tensor]:
    """`input_ids`, `loss_mask`, `attention_mask` [N, T]: each check prompt with the target's
    greedy answer, right-padded; the answers are the labels."""
    eos = eos_token_ids(model, tokenizer)
    rows = [(x, torch.tensor(greedy_generate(model, x, max_tokens, eos).tokens))
            for x in check_prompts(tokenizer, prompts, max_tokens)]
    width = max(len(x) + len(a) for x, a in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    loss, attention = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
    for i, (x, a) in enumerate(rows):
        ids[i, : len(x) + len(a)] = torch.cat([x, a])
        loss[i, len(x) : len(x) + len(a)] = True
        attention[i, : len(x) + len(a)] = 1
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attention}


def rigged_block_head(overrides: list[str], model, rows: dict[str, torch.Tensor], out: Path, steps: int = 40,
                      check=None) -> Path:
    """A block drafter of `overrides` (`+head=dflash ...`, its target the configured one, loaded as
    `model`), trained `steps` full-batch steps on `answered_rows`' `rows`, saved in the project's
    format; `check(head)` sees it before it is saved. Callers rigging several heads answer the
    prompts once."""
    cfg = compose_root(overrides)
    trainee = CATALOG[cfg.head.name].trainee(cfg, model, None)
    with torch.no_grad():
        hs = model(rows["input_ids"], attention_mask=rows["attention_mask"],
                   output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in trainee.head.aux_layer_ids], -1)
    batch = {**rows, "aux_hidden": aux, "final_hidden": hs[-1]}
    opt = torch.optim.AdamW([p for p in trainee.head.parameters() if p.requires_grad], lr=2e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        trainee(batch)["loss"].backward()
        opt.step()
    if check is not None:
        check(trainee.head)
    return trainee.save_pretrained(out)


def check_lines(cmd: list[str], count: int, root: Path, **env: str) -> list[dict]:
    """An engine check run as a user runs it from the checkout `root` (its own side importing
    this checkout's modules, `env` added): its JSON lines, `count` of them or its stderr's end."""
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=1500,
                          env={**os.environ, "PYTHONPATH": str(root), **env})
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == count, f"rc={done.returncode}\n{done.stderr[-4000:]}"
    return lines
