"""Replace assistant turns with the target's own answers, so the head learns what it will draft.

Generation was the slowest stage of data prep, so it runs on `regen_engine` (continuous batching
over a static KV cache) or on vLLM, and it is resumable: every finished conversation is appended
to a JSONL cache, and a rerun skips the ids already there. Multi-turn conversations are answered
turn by turn, each turn seeing the target's earlier answers.
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
from data_prep.regen_engine import generate
from data_prep.sources import Message, Sample, answer_uid
from data_prep.target import eos_token_ids
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


def turn_seed(uid: str, turn: int) -> int:
    """A sampled answer's seed: a function of the sample and its turn only, so that the answer
    does not depend on which other prompts shared its batch or on how often the run was resumed."""
    return int(hashlib.sha256(f"{uid}:{turn}".encode()).hexdigest()[:8], 16)


def answer_all(model, prompts: list[list[int]], cfg: RegenerateConfig, eos: set[int], seeds: list[int],
               on_finish: Callable[[int, list[int]], None], target_path: str | None = None,
               matmul_dtype: torch.dtype | None = None) -> None:
    """Generate every prompt's answer with the configured backend, calling `on_finish(i, ids)`.
    `matmul_dtype` applies to the hf engine; vLLM runs the target's dtype."""
    common = dict(
        max_new_tokens=cfg.max_new_tokens,
        eos_token_ids=eos,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seeds=seeds,
    )
    if cfg.backend == "vllm":
        from data_prep.regen_vllm import vllm_generate

        for i, ids in enumerate(vllm_generate(target_path, prompts, dtype=model.dtype, **common)):
            on_finish(i, ids)
        return
    generate(model, prompts, batch_size=cfg.batch_size, workers=cfg.workers, on_finish=on_finish,
             matmul_dtype=matmul_dtype, **common)


def regenerate(
    samples: list[Sample],
    model,
    tok,
    cfg: RegenerateConfig,
    max_length: int,
    cache_file: Path,
    stats: Counter,
    progress: Callable | None = None,
    target_path: str | None = None,
    matmul_dtype: torch.dtype | None = None,
) -> list[Sample]:
    """Every sample with target-written answers (`cfg.num_samples` per prompt, each its own sample
    with uid `answer_uid(uid, k)`), in input order; reuses and extends `cache_file`.

    A turn is answered only when its prompt leaves room for `max_new_tokens` within
    `max_length`; later turns of that conversation are dropped (they would be truncated away).
    Conversations are written to the cache as they finish, so a killed run loses only the ones
    in flight. `target_path` is the target's folder, for the vLLM backend; `matmul_dtype` the
    precision of the engine's linear layers (`data_prep.linears`).
    """
    done = read_cache(cache_file)
    wanted = [Sample(answer_uid(s.uid, k), s.messages) for s in samples for k in range(cfg.num_samples)]
    todo = []
    for s in wanted:
        if s.uid not in done:
            system = [m for m in s.messages[:1] if m["role"] == "system"]
            todo.append(_Pending(s, system, [m for m in s.messages if m["role"] == "user"]))
    stats["regenerated_from_cache"] += len(wanted) - len(todo)
    budget = max_length - cfg.max_new_tokens
    eos = eos_token_ids(model, tok)
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

        while todo:  # one round per turn: each round answers every conversation's next turn
            ready = []
            for p in todo:
                ids = prompt_ids(tok, p.prompt())
                if len(ids) > budget:
                    finish(p)
                else:
                    ready.append((len(ids), p.sample.uid, ids, p))
            ready.sort(key=lambda r: (r[0], r[1]))  # similar lengths prefill together
            pending, todo = [r[3] for r in ready], []

            def answered(i: int, new: list[int], pending=pending, todo=todo) -> None:
                nonlocal new_tokens
                p = pending[i]
                p.answers.append(tok.decode(new, skip_special_tokens=True).strip())
                new_tokens += len(new)
                stats["answers_cut_at_max_new_tokens"] += len(new) == cfg.max_new_tokens
                if len(p.answers) < len(p.users):
                    todo.append(p)
                else:
                    finish(p)
                if bar is not None:
                    bar.update(len(new))
                    bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - started):.1f}")

            seeds = [turn_seed(p.sample.uid, len(p.answers)) for p in pending]
            answer_all(model, [r[2] for r in ready], cfg, eos, seeds, answered, target_path, matmul_dtype)
    if bar is not None:
        bar.close()
    stats["regenerated_tokens"] += new_tokens
    stats["regenerate_seconds"] += round(time.perf_counter() - started, 2)
    stats["skipped_prompt_too_long"] += sum(1 for s in wanted if not done[s.uid])
    return [Sample(s.uid, done[s.uid]) for s in wanted if done[s.uid]]
