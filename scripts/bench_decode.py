"""Speculative decoding speed at batch 1 on the embedded target; prints ONE JSON line.

    flock /tmp/draftsmith-heavy.lock python scripts/bench_decode.py head=<path> [reps=2] \
        [eval.max_prompts_per_task=1] [target.num_threads=...] [other overrides]

For each prompt (MT-Bench, HumanEval, GSM8K, first `eval.max_prompts_per_task` of each) it runs
plain greedy, transformers' prompt lookup, chain drafting (`eval.num_speculative_tokens`) and
tree drafting (`eval.tree.*`) `reps` times, interleaved so that a neighbour's load spike hurts
all alike, and keeps each method's fastest run. Speedups are ratios of tokens/s over all prompts.
`lossless` says that chain and tree greedy outputs equalled plain greedy token for token;
`*speedup_at_full_acceptance` is the ceiling the measured step costs allow (every
draft accepted), which tells a weak head from a machine where verifying k+1 tokens is dear.
`greedy_ms_per_token` and `*draft_ms_per_step` / `*verify_ms_per_step` / `*other_ms_per_step`
(acceptance, cache upkeep, the drafter's commit) are the step costs; on CUDA
every step after the prompt replays a CUDA graph (`cuda_graphs`), captured during the warm-up.
"""

from __future__ import annotations

import json
import sys

import torch

from conf.compose import split_args
from conf.errors import UserError, exit_on_user_error
from conf.usage import answer_help
from data_prep.target import eos_token_ids, input_device, resolve_target
from heads.folder import compose_for_head
from trainer.decoding import greedy_generate, prompt_lookup_generate, speculative_generate
from trainer.decoding.graphs import graphs_enabled
from trainer.evaluate.report import Record, task_metrics
from trainer.evaluate.run import (
    draft_shape,
    eval_sampling,
    greedy_verdict,
    load_drafter,
)
from trainer.evaluate.tasks import encode_all, load_prompts


def fastest(runs):
    return min(runs, key=lambda g: g.stats.total_s)


@exit_on_user_error
def main(argv: list[str]) -> None:
    answer_help(__doc__, argv)
    own, overrides = split_args(argv, ("head", "reps"))
    if not any(o.startswith("eval.max_prompts_per_task=") for o in overrides):
        overrides.append("eval.max_prompts_per_task=1")
    cfg = compose_for_head(own.get("head", ""), overrides)
    reps = int(own.get("reps", 2))
    if reps < 1:
        raise UserError(f"reps={reps}: expected an integer >= 1")
    ev = cfg.eval
    prompts = load_prompts(ev)
    target = resolve_target(cfg)
    model, tokenizer = target.model, target.tokenizer
    shapes = {"chain": draft_shape(ev, "chain"), "tree": draft_shape(ev, "tree")}
    drafter, verifier = load_drafter(own["head"], model, cfg.target.name_or_path,
                                     list(shapes.values()))
    eos = eos_token_ids(verifier, tokenizer)
    sampling = eval_sampling(cfg)
    n = ev.max_new_tokens

    methods = {
        "greedy": lambda ids: greedy_generate(verifier, ids, n, eos),
        "prompt_lookup": lambda ids: prompt_lookup_generate(
            verifier, ids, n, eos, ev.prompt_lookup_num_tokens),
        **{
            mode: lambda ids, shape=shape: speculative_generate(
                verifier, drafter, ids, n, shape, sampling, eos)
            for mode, shape in shapes.items()
        },
    }
    encoded = encode_all(tokenizer, prompts, cfg.data)
    for run in methods.values():  # warm-up, not measured
        run(encoded[0][1][:32])
    records: dict[str, list[Record]] = {"chain": [], "tree": []}
    for task, ids in encoded:
        runs = {name: [] for name in methods}
        for _ in range(reps):
            for name, run in methods.items():
                runs[name].append(run(ids))
        best = {name: fastest(r) for name, r in runs.items()}
        for mode in records:
            verdict = greedy_verdict(verifier, ids, best["greedy"].tokens, best[mode].tokens)
            records[mode].append(Record(task, best[mode].stats, best["greedy"].stats,
                                        best["prompt_lookup"].stats, verdict))

    chain, tree = task_metrics(records["chain"]), task_metrics(records["tree"])
    line = {
        "head": own["head"],
        "target": cfg.target.name_or_path,
        "prompts": len(encoded),
        "max_new_tokens": n,
        "reps": reps,
        "threads": torch.get_num_threads(),
        "cuda_graphs": graphs_enabled(input_device(model)),
        "temperature": ev.temperature,
        "num_speculative_tokens": ev.num_speculative_tokens,
        "tree": {"total_tokens": ev.tree.total_tokens, "depth": ev.tree.depth,
                 "topk": ev.tree.topk},
        "greedy_tokens_per_s": chain["greedy_tokens_per_s"],
        "prompt_lookup_tokens_per_s": chain["prompt_lookup_tokens_per_s"],
        "prompt_lookup_tokens_per_forward": chain["prompt_lookup_tokens_per_forward"],
        "greedy_ms_per_token": chain["greedy_ms_per_token"],
    }
    for prefix, m in (("", chain), ("tree_", tree)):
        step_ms = m["draft_ms_per_step"] + m["verify_ms_per_step"] + m["other_ms_per_step"]
        longest = len(m["acceptance_per_position"]) + 1  # tokens per step if all accepted
        line |= {
            f"{prefix}mean_acceptance_length": m["mean_acceptance_length"],
            f"{prefix}acceptance_per_position": m["acceptance_per_position"],
            f"{prefix}tokens_per_s": m["spec_tokens_per_s"],
            f"{prefix}speedup_vs_greedy": m["speedup_vs_greedy"],
            f"{prefix}speedup_vs_prompt_lookup": m["speedup_vs_prompt_lookup"],
            f"{prefix}draft_ms_per_step": m["draft_ms_per_step"],
            f"{prefix}verify_ms_per_step": m["verify_ms_per_step"],
            f"{prefix}other_ms_per_step": m["other_ms_per_step"],
            # What a head accepted at every position would reach with these measured step costs.
            f"{prefix}speedup_at_full_acceptance": round(
                longest * chain["greedy_ms_per_token"] / step_ms, 3
            ),
        }
    line["lossless"] = chain["lossless"] and tree["lossless"] if sampling.greedy else None
    line["numerical_ties"] = chain["numerical_ties"] + tree["numerical_ties"]
    print(json.dumps(line))


if __name__ == "__main__":
    main(sys.argv[1:])
