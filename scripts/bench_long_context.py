"""Peak memory and throughput of one training step against sequence length; prints ONE JSON line.

    python scripts/bench_long_context.py [lengths=512,2048,8192] [steps=2] [+head=eagle3|peagle|dflash]
        [--labelled F] [key=value ...]

Each length runs in a fresh process (a process's peak resident set only grows), on the configured
target (the embedded SmolLM2 by default) and a fresh head of the configured kind, as training
builds them: one row holding one document of that many tokens, the last F of it labelled (default
1.0, the worst case: EAGLE-3's later unroll steps run every labelled position), its target features
random (what a step costs does not depend on their values; capture is not timed). One warm-up
step, then `steps` timed ones (forward, backward, optimizer, as `scripts/bench_train.py` steps).
The line holds, per length: `peak_rss_mib` (of the whole process: the target's weights included,
so the growth between lengths is the step's), `tokens_per_s` and `step_s`. What makes memory grow
linearly rather than quadratically in the length is `heads.eagle3.model.BRANCH_SCORES`; run the script
on an older checkout (PYTHONPATH) for the figures before it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import torch

# A script's own folder leads sys.path: its sibling's pieces, as training builds a step.
from bench_train import bench_trainee, make_step, parse, synthetic_document

from conf.compose import split_args
from conf.errors import UserError, exit_on_user_error
from conf.usage import answer_help
from data_prep.states.capture import TOP
from data_prep.target import resolve_target
from heads.eagle3 import model as eagle3
from heads.kinds import head_kind

OWN_KEYS = ("lengths", "steps", "--one")


def one_length(length: int, steps: int, argv: list[str]) -> dict:
    """The step's figures at `length` tokens, in this process."""
    cfg, labelled = parse(argv)
    target = resolve_target(cfg)
    model = target.model
    trainee, fields = bench_trainee(cfg, model, head_kind(cfg.head.name))
    g = torch.Generator().manual_seed(0)
    doc = synthetic_document(length, model.config.get_text_config().vocab_size, labelled, g)
    batch = {"input_ids": doc["input_ids"][None], "loss_mask": doc["loss_mask"][None],
             "attention_mask": torch.ones(1, length, dtype=torch.long)}
    hidden = model.config.get_text_config().hidden_size
    aux = getattr(trainee.head, "fc", None)
    if aux is not None:
        batch["aux_hidden"] = torch.randn(1, length, aux.in_features, generator=g)
    batch["final_hidden"] = torch.randn(1, length, hidden, generator=g)
    batch[TOP] = torch.randint(model.config.get_text_config().vocab_size, (1, length), generator=g).int()
    batch |= trainee.batch_index(batch)
    step, _ = make_step(trainee, cfg.optim, model.device, bf16=False)
    step(batch)  # warm-up: allocations, kernel choice
    start = time.perf_counter()
    for _ in range(steps):
        step(batch)
    seconds = (time.perf_counter() - start) / steps
    return {
        "head": cfg.head.name,
        "fields": fields,
        "length": length,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "tokens_per_s": round(length / seconds, 1),
        "step_s": round(seconds, 3),
    }


def child(length: int, steps: int, argv: list[str]) -> dict:
    """`one_length` in a fresh interpreter."""
    cmd = [sys.executable, __file__, f"--one={length}", f"steps={steps}", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"length": length, "error": f"rc={done.returncode}: {tail[0]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


@exit_on_user_error
def main(argv: list[str]) -> None:
    answer_help(__doc__, argv)
    own, argv = split_args(argv, OWN_KEYS)
    steps = int(own.get("steps", 2))
    if steps < 1:
        raise UserError(f"steps={steps}: expected at least 1")
    if "--one" in own:
        print(json.dumps(one_length(int(own["--one"]), steps, argv)), flush=True)
        return
    try:
        lengths = [int(n) for n in own.get("lengths", "512,2048,8192").split(",")]
    except ValueError:
        raise UserError(f"lengths={own['lengths']}: expected comma-separated token counts") from None
    if any(n < 16 for n in lengths):
        raise UserError(f"lengths={own['lengths']}: expected token counts >= 16")
    runs = [child(n, steps, argv) for n in lengths]
    done = [r for r in runs if "error" not in r]
    line = {
        "bench": "long_context",
        "head": done[0]["head"] if done else None,
        "fields": done[0]["fields"] if done else None,
        "threads": torch.get_num_threads(),
        "branch_scores": getattr(eagle3, "BRANCH_SCORES", None),
        "lengths": lengths,
        "peak_rss_mib": [r.get("peak_rss_mib") for r in runs],
        "tokens_per_s": [r.get("tokens_per_s") for r in runs],
        "step_s": [r.get("step_s") for r in runs],
        "errors": {r["length"]: r["error"] for r in runs if "error" in r},
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
