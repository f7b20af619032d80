"""Replace assistant turns with the target's own answers, so the head learns what it will draft.

Generation is the slowest stage on a CPU, so it is batched (left padding, prompts grouped by
length) and resumable: every finished conversation is appended to a JSONL cache, and a rerun
skips the ids already there. Multi-turn conversations are answered turn by turn, each turn seeing
the target's earlier answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conf.schema import RegenerateConfig
from data_prep.sources import Message, Sample
from data_prep.template import prompt_ids


@dataclass
class _Pending:
    sample: Sample
    system: list[Message]
    users: list[Message]
    answers: list[str] = field(default_factory=list)

    def answered(self) -> list[Message]:
        """The conversation so far: system prompt, then each answered user turn and its answer."""
        msgs = list(self.system)
        for user, answer in zip(self.users, self.answers):
            msgs += [user, {"role": "assistant", "content": answer}]
        return msgs

    def prompt(self) -> list[Message]:
        return self.answered() + [self.users[len(self.answers)]]


def read_cache(path: Path) -> dict[str, list[Message]]:
    """Finished conversations by uid; a torn last line (a killed run) is cut off the file."""
    done: dict[str, list[Message]] = {}
    if not path.exists():
        return done
    good = 0
    with open(path, "rb") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            done[row["uid"]] = row["messages"]
            good += len(line)
    if good != path.stat().st_size:
        os.truncate(path, good)
    return done


def generate_batch(model, tok, prompts: list[list[int]], cfg: RegenerateConfig, seed: int) -> list:
    """Left-padded batched generation; returns each prompt's new token ids up to (not incl.) EOS."""
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [tok.eos_token_id])
    sampling = cfg.temperature > 0
    extra = dict(temperature=cfg.temperature, top_p=cfg.top_p) if sampling else {}
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sampling,
        pad_token_id=pad,
        eos_token_id=sorted(eos),
        **extra,
    )
    answers = []
    for row in out[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:end])
    return answers


def regenerate(
    samples: list[Sample],
    model,
    tok,
    cfg: RegenerateConfig,
    max_length: int,
    cache_file: Path,
    stats: Counter,
    progress: Callable | None = None,
) -> list[Sample]:
    """Every sample with target-written answers, in input order; reuses and extends `cache_file`.

    A turn is answered only when its prompt leaves room for `max_new_tokens` within
    `max_length`; later turns of that conversation are dropped (they would be truncated away).
    """
    done = read_cache(cache_file)
    todo = []
    for s in samples:
        if s.uid not in done:
            system = [m for m in s.messages[:1] if m["role"] == "system"]
            todo.append(_Pending(s, system, [m for m in s.messages if m["role"] == "user"]))
    stats["regenerated_from_cache"] += len(samples) - len(todo)
    budget = max_length - cfg.max_new_tokens
    bar = progress(total=None, unit="tok", desc="regenerate") if progress and todo else None
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    started, new_tokens = time.perf_counter(), 0
    with open(cache_file, "a", encoding="utf-8") as out:

        def finish(p: _Pending) -> None:
            if len(p.answers) < len(p.users):
                stats["turns_dropped_too_long"] += len(p.users) - len(p.answers)
            done[p.sample.uid] = p.answered() if p.answers else []
            out.write(json.dumps({"uid": p.sample.uid, "messages": done[p.sample.uid]}) + "\n")
            out.flush()

        while todo:
            ready = []
            for p in todo:
                ids = prompt_ids(tok, p.prompt())
                if len(ids) > budget:
                    finish(p)
                else:
                    ready.append((len(ids), p.sample.uid, ids, p))
            ready.sort(key=lambda r: (r[0], r[1]))
            todo = []
            for i in range(0, len(ready), cfg.batch_size):
                batch = ready[i : i + cfg.batch_size]
                seed = int(hashlib.sha256(batch[0][1].encode()).hexdigest()[:8], 16)
                outs = generate_batch(model, tok, [r[2] for r in batch], cfg, seed)
                for (_, _, _, p), new in zip(batch, outs):
                    p.answers.append(tok.decode(new, skip_special_tokens=True).strip())
                    new_tokens += len(new)
                    stats["answers_cut_at_max_new_tokens"] += len(new) == cfg.max_new_tokens
                    if len(p.answers) < len(p.users):
                        todo.append(p)
                    else:
                        finish(p)
                if bar is not None:
                    bar.update(sum(len(o) for o in outs))
                    bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - started):.1f}")
    if bar is not None:
        bar.close()
    stats["regenerated_tokens"] += new_tokens
    stats["regenerate_seconds"] += round(time.perf_counter() - started, 2)
    stats["skipped_prompt_too_long"] += sum(1 for s in samples if not done[s.uid])
    return [Sample(s.uid, done[s.uid]) for s in samples if done[s.uid]]
