"""Online vs offline training speed on the embedded target; prints ONE JSON line.

    python scripts/bench_online.py [+head=eagle3|medusa] [--labelled F] [--reps N] [key=value ...]

One real batch (chat-templated `data.source` conversations, `optim.batch_tokens` tokens, the last
fraction F = 0.5 of each row labelled), collated as the loader collates it, through the loop's own
`train_step` three ways, each its best of N interleaved rounds (a neighbour's load spike then
hurts all alike):
- offline: the hidden states as a data folder stores them (bf16, or fp8 read back as float32);
- capture: the bare capture forward of online mode (`data_prep.states.capture.hidden_states`);
- online: `train_step` with `capture_batch`, the target forward and the storage rounding, inside.
`online_over_offline_plus_capture` is online / (offline + capture): 1.0 means online training
costs the target forward and nothing more.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from functools import partial

import torch
from bench_train import batch_shape, bench_trainee, parse, real_tokens

from conf.errors import exit_on_user_error
from conf.usage import answer_help
from data_prep.prepare import capture_spec
from data_prep.states.capture import capture_batch, hidden_states
from data_prep.target import resolve_target
from heads.kinds import head_kind
from trainer.batching import collate
from trainer.distributed import build_accelerator
from trainer.loop import device_batch, train_step


@exit_on_user_error
def main(argv: list[str]) -> None:
    answer_help(__doc__, argv)
    reps = 3
    if "--reps" in argv:
        i = argv.index("--reps")
        reps, argv = int(argv[i + 1]), argv[:i] + argv[i + 2 :]
    cfg, labelled = parse(argv, labelled=0.5)
    target = resolve_target(cfg)
    model = target.model
    kind = head_kind(cfg.head.name)
    spec = capture_spec(cfg, kind, model.config.get_text_config().num_hidden_layers)
    tokens = real_tokens(target.tokenizer, cfg.data, *batch_shape(cfg), labelled)
    trainee, fields = bench_trainee(cfg, model, kind)
    rows = [{k: v[r] for k, v in tokens.items()} for r in range(len(tokens["input_ids"]))]
    online = collate(rows, trainee.batch_index)  # what the loader hands the loop, on the CPU
    capture = partial(capture_batch, model, spec)
    # The same batch as a data folder holds it: the values online computes, as stored.
    stored = capture(device_batch(online, model.device))
    bf16 = spec.storage_dtype == "bfloat16"
    offline = online | {k: v.cpu().bfloat16() if bf16 else v.cpu() for k, v in stored.items()}

    acc = build_accelerator(cfg.dist, cfg.optim, tempfile.gettempdir())  # saves nothing there
    opt = torch.optim.AdamW(trainee.param_groups(1e-4, 0.0), lr=1e-4)
    trainee, opt = acc.prepare(trainee, opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    clip = cfg.optim.grad_clip
    runs = {
        "offline": lambda: train_step(acc, trainee, opt, params, clip, offline),
        "capture": lambda: hidden_states(model, online["input_ids"].to(model.device), spec),
        "online": lambda: train_step(acc, trainee, opt, params, clip, online, capture),
    }

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(reps + 1):  # the first round warms up
        for name, fn in runs.items():
            took = timed(fn)
            if rep:
                times[name].append(took)
    best = {name: min(t) for name, t in times.items()}
    n = online["input_ids"].numel()
    print(
        json.dumps(
            {
                "head": cfg.head.name,
                "target": cfg.target.name_or_path,
                "device": str(model.device),
                "threads": torch.get_num_threads(),
                **fields,
                "storage_dtype": spec.storage_dtype,
                "batch_shape": list(online["input_ids"].shape),
                "labelled_tokens": int(online["loss_mask"].sum()),
                "offline_train_tokens_per_s": round(n / best["offline"], 1),
                "online_train_tokens_per_s": round(n / best["online"], 1),
                "capture_forward_tokens_per_s": round(n / best["capture"], 1),
                "offline_step_s": round(best["offline"], 4),
                "capture_s": round(best["capture"], 4),
                "online_step_s": round(best["online"], 4),
                "online_over_offline_plus_capture": round(
                    best["online"] / (best["offline"] + best["capture"]), 3
                ),
                "reps": reps,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
