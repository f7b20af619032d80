"""Load an exported head in vLLM (CPU) and compare its acceptance with ours; print one JSON line.

    .venv-vllm/bin/python scripts/check_vllm.py <exported dir> [--prompts N] [--max-tokens M]

Runs in the vLLM venv (scripts/setup_vllm_venv.sh). vLLM lacks this project's dependencies, so
the script calls itself once with the main venv's python (`--role ours`) to get, for the same
head folder and target: the target's folder, the prompts (MT-Bench / HumanEval / GSM8K from the
evaluator's task loader, chat template applied, as token ids) and our decoder's figures on the
exported weights. Then vLLM generates those token-id prompts greedily twice, without and with
the head as `speculative_config`, and the script reports:

- vLLM's mean acceptance length, 1 + accepted / drafts from `llm.get_metrics()` counters,
  and ours, pooled the same way over the same prompts (goal: within 10%);
- whether vLLM's greedy text with speculation equals vLLM's without it (goal: identical), and
  how many prompts also match our decoder token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def acceptance(drafts: int, accepted: int, per_pos: list[int]) -> dict:
    """vLLM's definitions: tau = 1 + accepted / drafts; position i rate = per_pos[i] / drafts."""
    if drafts == 0:
        return {"mean_acceptance_length": 1.0, "per_position_acceptance": [0.0] * len(per_pos)}
    return {
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "per_position_acceptance": [round(n / drafts, 4) for n in per_pos],
    }


def relative_gap(ours: float, theirs: float) -> float:
    return abs(theirs - ours) / ours


# ---- role "ours": the main venv -------------------------------------------------------------


def ours(export_dir: str, target: str, n_prompts: int, max_tokens: int, k: int) -> dict:
    import torch

    from conf.schema import EvalConfig
    from data_prep.target import eos_token_ids, load_target, resolve_target_path
    from heads.export import detect_format, load_export
    from heads.folder import TargetSpec
    from trainer.decoding import (
        Chain,
        Eagle3Drafter,
        MedusaDrafter,
        greedy_generate,
        speculative_generate,
    )
    from trainer.evaluate.tasks import encode, load_prompts

    torch.manual_seed(0)
    model, tokenizer = load_target(target, dtype="float32", device="cpu")
    fmt = detect_format(export_dir)
    head = load_export(export_dir, model, target)
    n_layers = TargetSpec.from_model(model, target).num_hidden_layers
    is_medusa = fmt.startswith("medusa")
    drafter = MedusaDrafter(head, n_layers) if is_medusa else Eagle3Drafter(head)
    k = head.num_heads if is_medusa else k
    per_task = -(-n_prompts // 3)
    cfg = EvalConfig(max_prompts_per_task=per_task, max_new_tokens=max_tokens)
    prompts = [p for ps in load_prompts(cfg).values() for p in ps][:n_prompts]
    ids = [encode(tokenizer, p) for p in prompts]
    eos = eos_token_ids(model, tokenizer)
    drafts = accepted = 0
    per_pos = [0] * k
    spec_tokens, greedy_tokens = [], []
    for x in ids:
        run = speculative_generate(model, drafter, x, max_tokens, Chain(k), eos_ids=eos)
        drafts, accepted = drafts + run.stats.drafts, accepted + run.stats.accepted_tokens
        for i, n in enumerate(run.stats.accepted_per_position):
            per_pos[i] += n
        spec_tokens.append(run.tokens)
        greedy_tokens.append(greedy_generate(model, x, max_tokens, eos).tokens)
    return {
        "format": fmt,
        "method": "medusa" if is_medusa else "eagle3",
        "num_speculative_tokens": k,
        "target_dir": resolve_target_path(target),
        "prompt_token_ids": [x.tolist() for x in ids],
        "eos_token_ids": sorted(eos),
        "spec_tokens": spec_tokens,
        "lossless": spec_tokens == greedy_tokens,
        **acceptance(drafts, accepted, per_pos),
    }


# ---- role "vllm": the vLLM venv -------------------------------------------------------------


def spec_counters(llm) -> dict:
    """The cumulative spec-decode counters of this process (take differences between calls)."""
    found = {"per_pos": []}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            found[m.name] = found.get(m.name, 0) + m.value
        elif m.name == PER_POS:
            found["per_pos"] = list(m.values)
    return found


def vllm_generate(target_dir: str, prompt_ids, max_tokens, stop_ids, spec: dict | None):
    """Greedy token ids per prompt, and the spec counters this run added."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=target_dir,
        dtype="float32",
        enforce_eager=True,
        disable_log_stats=False,
        max_model_len=2048,
        seed=0,
        speculative_config=spec,
    )
    before = spec_counters(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_ids)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params)
    after = spec_counters(llm)
    del llm
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    pos_before = before["per_pos"] or [0] * len(after["per_pos"])
    diff["per_pos"] = [a - b for a, b in zip(after["per_pos"], pos_before)]
    return [list(o.outputs[0].token_ids) for o in outs], diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export_dir")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target name or folder")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (EAGLE-3)")
    ap.add_argument("--main-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--role", choices=["vllm", "ours"], default="vllm")
    a = ap.parse_args()
    export_dir = str(Path(a.export_dir).resolve())
    if a.role == "ours":
        print(json.dumps(ours(export_dir, a.target, a.prompts, a.max_tokens, a.k)))
        return

    started = time.perf_counter()
    cmd = [a.main_python, __file__, export_dir, "--role", "ours", "--target", a.target]
    cmd += ["--prompts", str(a.prompts), "--max-tokens", str(a.max_tokens), "--k", str(a.k)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"error: our side failed:\n{done.stderr[-3000:]}")
    ref = json.loads(done.stdout.strip().splitlines()[-1])

    # vLLM logs to stdout; send all of it to stderr so stdout carries only the JSON line.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # In-process engine: two LLMs one after the other in one process, counters read directly.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    k = ref["num_speculative_tokens"]
    spec = {"method": ref["method"], "model": export_dir, "num_speculative_tokens": k}
    args = (ref["target_dir"], ref["prompt_token_ids"], a.max_tokens, ref["eos_token_ids"])
    plain, _ = vllm_generate(*args, None)
    fast, counters = vllm_generate(*args, spec)
    theirs = acceptance(
        counters["vllm:spec_decode_num_drafts"],
        counters["vllm:spec_decode_num_accepted_tokens"],
        counters["per_pos"],
    )
    gap = relative_gap(ref["mean_acceptance_length"], theirs["mean_acceptance_length"])
    print(
        json.dumps(
            {
                "export": export_dir,
                "format": ref["format"],
                "method": ref["method"],
                "num_speculative_tokens": k,
                "prompts": len(ref["prompt_token_ids"]),
                "max_tokens": a.max_tokens,
                "vllm_mean_acceptance_length": round(theirs["mean_acceptance_length"], 4),
                "ours_mean_acceptance_length": round(ref["mean_acceptance_length"], 4),
                "relative_gap": round(gap, 4),
                "within_10pct": gap <= 0.10,
                "vllm_per_position_acceptance": theirs["per_position_acceptance"],
                "ours_per_position_acceptance": ref["per_position_acceptance"],
                "vllm_drafts": counters["vllm:spec_decode_num_drafts"],
                "vllm_accepted_tokens": counters["vllm:spec_decode_num_accepted_tokens"],
                "greedy_text_match": fast == plain,
                "prompts_matching_ours": sum(a == b for a, b in zip(fast, ref["spec_tokens"])),
                "ours_lossless": ref["lossless"],
                "wall_s": round(time.perf_counter() - started, 1),
            }
        ),
        file=json_out,
        flush=True,
    )


if __name__ == "__main__":
    main()
