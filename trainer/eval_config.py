"""The `eval` config group: which prompts, how to draft, which baselines."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.errors import UserError

BASELINES = ("greedy", "prompt_lookup")
MODES = ("auto", "chain", "tree")


@dataclass
class TreeConfig:
    # EAGLE heads grow the tree (EAGLE-2): `depth` draft levels, the `topk` best nodes expanded
    # per level, the `total_tokens` best nodes (root excluded) verified per target forward.
    total_tokens: int = 16
    depth: int = 4
    topk: int = 4
    # Medusa heads use a static tree: paths of per-head top-k ranks; null = a 16-node default.
    medusa_choices: list[list[int]] | None = None


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=lambda: ["mtbench", "humaneval", "gsm8k"])
    prompts: str | None = None  # a user JSONL: {"task", "prompt"} or {"task", "messages"}
    max_prompts_per_task: int = 3
    max_new_tokens: int = 96
    num_speculative_tokens: int = 3
    # auto: each head as it is usually served (EAGLE-3 a chain, as vLLM drafts; Medusa its
    # static tree, the shape it was designed for); chain | tree force one.
    mode: str = "auto"
    tree: TreeConfig = field(default_factory=TreeConfig)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    # Sampling only: false = argmax drafts (vLLM's way, so acceptance compares with vLLM's);
    # true = chain drafts sampled from the head's own distribution.
    draft_sampling: bool = False
    baselines: list[str] = field(default_factory=lambda: ["greedy"])  # + prompt_lookup
    prompt_lookup_num_tokens: int = 10
    out_dir: str | None = None  # None: <run_dir>/eval


def check_eval_config(cfg: EvalConfig) -> None:
    """Refuse values the decoder cannot honour, before any model is loaded."""
    positive = {
        "eval.max_prompts_per_task": cfg.max_prompts_per_task,
        "eval.max_new_tokens": cfg.max_new_tokens,
        "eval.num_speculative_tokens": cfg.num_speculative_tokens,
        "eval.tree.total_tokens": cfg.tree.total_tokens,
        "eval.tree.depth": cfg.tree.depth,
        "eval.tree.topk": cfg.tree.topk,
        "eval.prompt_lookup_num_tokens": cfg.prompt_lookup_num_tokens,
    }
    for key, value in positive.items():
        if value < 1:
            raise UserError(f"{key}={value}: expected an integer >= 1")
    if cfg.mode not in MODES:
        raise UserError(f"eval.mode={cfg.mode!r}: expected one of {', '.join(MODES)}")
    if cfg.temperature < 0:
        raise UserError(f"eval.temperature={cfg.temperature}: expected >= 0 (0 = greedy)")
    if not 0 < cfg.top_p <= 1:
        raise UserError(f"eval.top_p={cfg.top_p}: expected a value in (0, 1]")
    unknown = [b for b in cfg.baselines if b not in BASELINES]
    if unknown:
        raise UserError(f"eval.baselines={unknown}: expected a subset of {list(BASELINES)}")
    if cfg.tree.medusa_choices is not None and not cfg.tree.medusa_choices:
        raise UserError("eval.tree.medusa_choices=[]: expected paths like [[0], [1], [0, 0]]")
    for path in cfg.tree.medusa_choices or []:
        if not path or min(path) < 0:
            raise UserError(
                f"eval.tree.medusa_choices: path {path} must list top-k ranks >= 0, one per head"
            )
