"""Hidden states through vLLM against transformers', per target; one JSON line each.

    PYTHONPATH=. .venv-vllm/bin/python scripts/check_capture.py <target> [<target> ...]
        [--head eagle3] [--prompts N] [--prompt-tokens L]

Runs in the vLLM venv (scripts/setup_vllm_venv.sh), where both engines are importable: for each
target (an alias, a folder, a Hub id) it captures N seeded random prompts of L ids twice, with
`data.capture.backend=vllm` (`data_prep.states.capture_engine.VllmCapturer`: vLLM's engine, the
connector's files, the final norm applied) and with `hf` (`capture.HfCapturer`, float32 matmuls),
for the layers the head kind keeps, and reports:
- `loaded` (and `error`: why vLLM refused the target, e.g. a model class without aux states);
- `ids_equal`: the engine's files held exactly the ids sent;
- `max_rel_diff` per field: max |vllm - hf| / max |hf| over every token (float32 noise is ~1e-5
  at the first layers, ~1e-4 after the last, the norm's rescaling included);
- `top1_agree`: the target's top-1 id from both, agreeing tokens / tokens;
- `unnormed_rel_diff`: the final field had the norm not been applied (the trap: large).
Use it before trusting the vllm or server backend with a target family of your own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conf.compose import compose_root  # noqa: E402
from data_prep.prepare import capture_spec  # noqa: E402
from data_prep.states.capture import TOP, HfCapturer  # noqa: E402
from data_prep.states.capture_engine import VllmCapturer  # noqa: E402
from data_prep.target import resolve_target  # noqa: E402
from heads.kinds import head_kind  # noqa: E402


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check(name: str, head: str, prompts: int, length: int) -> dict:
    cfg = compose_root([
        f"+head={head}", f"target.name_or_path={name}", "target.dtype=float32", "data.matmul_dtype=target",
        "data.capture.backend=vllm", "data.max_length=512",
    ])
    target = resolve_target(cfg)
    spec = capture_spec(cfg, head_kind(head), target.config.num_hidden_layers)
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, vocab, (length + 7 * k,), generator=gen).tolist() for k in range(prompts)]
    names = [f"prompt {k}" for k in range(prompts)]
    try:
        capturer = VllmCapturer(cfg, target, spec)
        raw = capturer.raw(samples)
    except Exception as err:  # vLLM refusing a model class is a finding, reported, not a crash
        return {"target": name, "loaded": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    ours = [capturer.states.fields(states, n) for states, n in zip(raw, names)]
    hf = list(HfCapturer(target.model, spec, 4096)(samples, names))
    row: dict = {"target": name, "loaded": True, "ids_equal": True, "prompts": prompts,  # read_states checks
                 "tokens": sum(map(len, samples))}
    for field in ours[0]:
        if field == TOP:
            agree = sum(int((o[TOP] == h[TOP]).sum()) for o, h in zip(ours, hf))
            row["top1_agree"] = [agree, row["tokens"]]
        else:
            diff = max(rel_diff(o[field], h[field]) for o, h in zip(ours, hf))
            row.setdefault("max_rel_diff", {})[field] = diff
    if spec.final_layer_id is not None:  # the trap: the engine's last layer as it comes, unnormed
        at = capturer.states.position[spec.final_layer_id]
        row["unnormed_rel_diff"] = max(rel_diff(r[:, at].float(), h["final_hidden"]) for r, h in zip(raw, hf))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="+")
    parser.add_argument("--head", default="eagle3")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    args = parser.parse_args()
    for name in args.targets:
        print(json.dumps(check(name, args.head, args.prompts, args.prompt_tokens)), flush=True)


if __name__ == "__main__":
    main()
