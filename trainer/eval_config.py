"""The `eval` config group: which prompts, how to draft, which baselines."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TreeConfig:
    total_tokens: int = 16  # EAGLE-2 dynamic tree: draft tokens verified per target forward
    depth: int = 4
    topk: int = 4


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=lambda: ["mtbench", "humaneval", "gsm8k"])
    prompts: str | None = None  # a user JSONL: {"task", "prompt"} or {"task", "messages"}
    max_prompts_per_task: int = 3
    max_new_tokens: int = 96
    num_speculative_tokens: int = 3
    mode: str = "chain"  # chain | tree
    tree: TreeConfig = field(default_factory=TreeConfig)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    baselines: list[str] = field(default_factory=lambda: ["greedy"])  # + prompt_lookup
    out_dir: str | None = None  # None: <run_dir>/eval
