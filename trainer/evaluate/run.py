"""How much a head speeds up its target (`python -m trainer.evaluate head=<path> [overrides]`).

For every prompt: plain greedy decoding (the baseline and the reference for the lossless check),
speculative decoding with the head, and optionally transformers' prompt lookup. Both decoders run
on the same static caches, so a fault there would make them wrong alike and still agree: the
greedy baseline is itself held to the target's own `generate` (each task's first prompt, or every
prompt with `eval.reference=generate`). The head is checked against the target before anything
is decoded; `eval.save_outputs` writes every speculative output, so anyone can check it.
A prompt whose outputs differ is named in eval.json and eval.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from conf.errors import UserError
from conf.schema import EvalConfig, RootConfig
from data_prep.linears import DecodeLinears
from data_prep.masks import attention_layout
from data_prep.target import Target, eos_token_ids, input_device, resolve_target, target_context
from heads.formats import folder_kind, load_for_decoding
from heads.kinds import head_kind
from trainer.decoding import (
    GREEDY,
    Chain,
    Sampling,
    Tree,
    greedy_generate,
    prompt_lookup_generate,
    reference_generate,
    speculative_generate,
)
from trainer.decoding.decoder import Step
from trainer.decoding.drafters import Shape
from trainer.decoding.tree import DEFAULT_MEDUSA_CHOICES
from trainer.evaluate.long_context import long_context_prompts
from trainer.evaluate.progress import EvalProgress
from trainer.evaluate.report import Record, summarise, write_outputs, write_report
from trainer.evaluate.settings import MIN_STEPS, StepCost, greedy_ms, measured, predict, step_cost, sweep
from trainer.evaluate.tasks import encode_all, load_prompts
from trainer.kinds import build_drafter


def resolve_mode(mode: str, kind: str) -> str:
    """`auto` -> the shape a head of `kind` is usually served with."""
    if mode != "auto":
        return mode
    return head_kind(kind).served_shape


def draft_shape(cfg: EvalConfig, mode: str) -> Shape:
    """The configured chain or tree for a resolved `mode`."""
    if mode == "chain":
        return Chain(cfg.num_speculative_tokens, cfg.draft_p_min)
    choices = cfg.tree.medusa_choices
    return Tree(
        total_tokens=cfg.tree.total_tokens,
        depth=cfg.tree.depth,
        topk=cfg.tree.topk,
        choices=tuple(map(tuple, choices)) if choices else DEFAULT_MEDUSA_CHOICES,
    )


def eval_sampling(cfg: RootConfig) -> Sampling:
    """The configured sampling, its generator seeded with `cfg.seed` so a sampled run repeats."""
    ev = cfg.eval
    generator = torch.Generator().manual_seed(cfg.seed)
    return Sampling(ev.temperature, ev.top_p, generator, ev.draft_sampling)


def load_drafter(head_path: str | Path, model, target_name: str, shapes: list[Shape]):
    """-> (drafter, the model that verifies). `head_path`: a head folder of any format draftsmith
    reads (`heads.formats`: its own, or an engine's export). Refuses a head built for another
    target (vocab, hidden size, layer count, aux layer ids) or unable to draft `shapes`, with the
    mismatch named, before any decoding. A jointly trained Medusa-2 head verifies with its own
    target."""
    device = input_device(model)
    kind, head, verifier = load_for_decoding(head_path, model, target_name)
    return build_drafter(kind, head.to(device).eval(), model, shapes), verifier


def shipped_drafter(kind, trained, model, target_name: str, shape: Shape):
    """A drafter of the head as the target ships it (`HeadKind.shipped_head`) beside the
    `trained` one, or None where the kind has none."""
    if kind.shipped_head is None:
        return None
    head = kind.shipped_head(model, target_name, trained)
    return build_drafter(kind, head.to(input_device(model)).eval(), model, [shape])


def tie_tolerance(dtype: torch.dtype, top_logit: float) -> float:
    """Logit gap under which two tokens count as tied: a batched verify forward and a one-token
    forward round differently. float32 parts by ~1e-5; half precision by a few units in the last
    place of the logit itself, and bf16 logits near 20 are 0.125 apart: a fixed tolerance below
    that spacing calls rounding a mismatch."""
    if dtype == torch.float32:
        return 1e-3
    return 4 * torch.finfo(dtype).eps * max(1.0, abs(top_logit))


@dataclass(frozen=True)
class Passes:
    """The decodes the evaluator makes for one prompt besides its greedy baseline and its
    speculative run. The loop below runs exactly these, and the time budget (`trainer.plan`)
    costs exactly these, so a new pass cannot make every budget too small without a word."""

    index: int  # the prompt's place within its task
    lookup: bool  # the prompt-lookup baseline (`eval.baselines`)
    reference: bool  # the greedy baseline held to the target's own `generate`
    greedy_check: bool  # a sampled evaluation's second, greedy speculative run (the lossless check)
    # Chain drafting, the first prompt: decodes at k = 1..K (p_min 0) measuring a step's costs,
    # and one at the predicted best setting (`trainer.evaluate.settings`); else 0.
    settings: int = 0


def settings_runs(cfg: EvalConfig) -> int:
    """The speculative runs `trainer.evaluate.settings` adds on the calibration prompt: one per
    k < K at p_min 0 (the evaluation's own run is k = K's when it drafts at p_min 0, else one
    more), and the best setting's."""
    return cfg.num_speculative_tokens - (cfg.draft_p_min == 0) + 1


def pass_schedule(cfg: EvalConfig, tasks: list[str], chain: bool = True) -> list[Passes]:
    """The passes of each prompt, given each prompt's task in order (`chain`: the head drafts
    chains, whose settings the evaluator sweeps). The reference runs on every prompt with
    `eval.reference=generate`, else on each task's first (a fault in the static caches shows on
    any prompt longer than a sliding window)."""
    seen: dict[str, int] = {}
    passes = []
    for i, task in enumerate(tasks):
        seen[task] = index = seen.get(task, -1) + 1
        passes.append(Passes(
            index=index,
            lookup="prompt_lookup" in cfg.baselines,
            reference=cfg.reference == "generate" or index == 0,
            greedy_check=cfg.temperature > 0,
            settings=settings_runs(cfg) if chain and i == 0 else 0,
        ))
    return passes


def slide(drafter, window: int | None, kind: str) -> None:
    """`eval.sliding_window`: the drafter's attention over the last `window` positions, at
    inference only (the target's attention is untouched, so output stays lossless); null keeps the
    head's own (`head.sliding_window`, or none). One line for a kind without draft attention."""
    if window is None:
        return
    if not hasattr(drafter, "window"):
        raise UserError(f"eval.sliding_window={window}: a {kind} head has no attention to slide; "
                        "set eval.sliding_window=null")
    drafter.window = window


def eval_prompts(cfg: RootConfig, target: Target) -> list[tuple[str, torch.Tensor]]:
    """(task, token ids) of every prompt the evaluator decodes, in its order: the configured
    tasks', then the long-context task's buckets (`trainer.evaluate.long_context`)."""
    encoded = encode_all(target.tokenizer, load_prompts(cfg.eval), cfg.data)
    return encoded + long_context_prompts(cfg, target.tokenizer, target_context(target.config))


@torch.no_grad()
def greedy_verdict(model, prompt: torch.Tensor, plain: list[int], spec: list[int]) -> str:
    """"same" when the greedy output `spec` (speculative, or the baseline against `generate`)
    equals the reference `plain`; "tie" when they part where the target's two tokens score within
    rounding of each other (both are its argmax up to float error, so the decoder did nothing
    wrong); else "mismatch"."""
    if plain == spec:
        return "same"
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if i is None:  # one stopped earlier at the same tokens: a real difference
        return "mismatch"
    device = input_device(model)
    seq = torch.cat([prompt.reshape(-1), torch.tensor(plain[:i], dtype=torch.long)]).to(device)
    logits = model(seq[None], logits_to_keep=1).logits[0, -1].float()
    top = float(logits.max())
    behind = top - logits[[plain[i], spec[i]]]
    return "tie" if float(behind.max()) <= tie_tolerance(model.dtype, top) else "mismatch"


def choose_setting(
    steps: list[Step], shape: Chain, costs: dict[int, StepCost], calibration, decode, greedy_decoding: bool
) -> dict:
    """eval.json's `draft_settings` (`trainer.evaluate.settings.sweep`) and its check: the best
    setting (or, where none pays, the fastest) decoded for real on the calibration prompt (a best
    whose real decode is slower than greedy is dropped: the card recommends no slower decode), its
    measured τ and speedup beside the prediction for that prompt's own recorded steps, and
    (`greedy_decoding`) whether its output equals plain greedy. `calibration`: (prompt ids, its greedy and
    speculative generations); `decode(ids, chain)`: a speculative decode."""
    ids, greedy, run = calibration
    base = greedy_ms(greedy.stats)
    thin = [k for k, c in costs.items() if c.steps < MIN_STEPS]
    if thin:
        return {"skipped": f"the calibration prompt's decodes at k={thin} made fewer than {MIN_STEPS} "
                           "steps: too few to measure a step's cost"}
    chosen = sweep(steps, shape.k, shape.p_min, costs, base)
    pick = chosen["best"] or chosen["fastest"]
    real = decode(ids, Chain(pick["k"], pick["p_min"]))
    chosen["check"] = {
        "k": pick["k"],
        "p_min": pick["p_min"],
        "predicted": predict(run.stats.steps, pick["k"], pick["p_min"], costs, base),
        "measured": measured(real.stats, base),
        "decoded": {"k": shape.k, "p_min": shape.p_min, **measured(run.stats, base)},
        "same_as_greedy": real.tokens == greedy.tokens if greedy_decoding else None,
    }
    if chosen["best"] and (chosen["check"]["measured"]["speedup_vs_greedy"] or 0) < 1.0:
        chosen["best"] = None  # predicted to pay, but its real decode did not: recommend nothing
    return chosen


def evaluate(
    cfg: RootConfig, head_path: str | Path, out_dir: str | Path, target: Target | None = None,
    kept: dict | None = None,
) -> dict:
    """Evaluate the head at `head_path` (a head folder of any format draftsmith reads); write
    eval.json/eval.md/acceptance.png to `out_dir`.

    target: the run's resolved `cfg.target` (`data_prep.target.resolve_target`) when the caller
    holds it; None resolves it here. Its weights load after the attention check that needs the
    config alone. kept: the main job's validation figures of this head (`FitReport.
    kept_validation`), reported beside the evaluated τ (`report.validation_gap`). Returns the
    eval.json object.
    """
    cfg.target.one_device("the evaluator's speculative decoder", "evaluate where one device holds it")
    ev = cfg.eval
    load_prompts(ev)  # a bad task list is refused before the target loads
    target = resolve_target(cfg) if target is None else target
    attention_layout(target.config, target.attn_implementation)  # refused before any weights load
    model = target.model
    tokenizer = target.tokenizer
    kind = folder_kind(head_path)
    mode = resolve_mode(ev.mode, kind.name)
    shape = draft_shape(ev, mode)
    drafter, verifier = load_drafter(head_path, model, target.name, [shape])
    slide(drafter, ev.sliding_window, kind.name)
    # The verifier's own stop tokens: a Medusa-2 head verifies with its fine-tuned copy.
    eos = eos_token_ids(verifier, tokenizer)
    sampling = eval_sampling(cfg)
    encoded = eval_prompts(cfg, target)

    def spec(ids, how: Sampling = sampling, max_new_tokens=ev.max_new_tokens, chain: Shape = shape):
        return speculative_generate(verifier, drafter, ids, max_new_tokens, chain, how, eos)

    shipped = shipped_drafter(kind, drafter.head, model, target.name, shape)

    # Every decode runs on the verifier's linears packed once (`DecodeLinears`); the checks
    # against `generate` run on the model as loaded.
    fast = DecodeLinears(verifier)
    with fast:  # warm-up (not measured): first calls pay for allocations and kernel selection
        greedy_generate(verifier, encoded[0][1], 8, eos)
        spec(encoded[0][1], max_new_tokens=8)
    progress = EvalProgress(len(encoded), cfg.logging.progress)
    records, outputs, costs = [], [], {}
    # The settings' decodes draw from their own generator: the evaluation's samples stay as they were.
    aside = replace(sampling, generator=torch.Generator().manual_seed(cfg.seed))
    schedule = pass_schedule(ev, [task for task, _ in encoded], chain=mode == "chain")
    for (task, ids), passes in zip(encoded, schedule):
        with fast:
            greedy = greedy_generate(verifier, ids, ev.max_new_tokens, eos)
            run = spec(ids)
            check = spec(ids, GREEDY) if passes.greedy_check else run
            lookup = None
            if passes.lookup:
                lookup = prompt_lookup_generate(
                    verifier, ids, ev.max_new_tokens, eos, ev.prompt_lookup_num_tokens
                ).stats
            if passes.settings:
                # A step's costs at each k, p_min 0 (this run is k = K's when it drafts so).
                costs = {k: step_cost((run if (k, shape.p_min) == (shape.k, 0) else
                                       spec(ids, aside, chain=Chain(k))).stats)
                         for k in range(1, shape.k + 1)}
                calibration = (ids, greedy, run)
        verdict = greedy_verdict(verifier, ids, greedy.tokens, check.tokens)
        reference = None
        if passes.reference:
            made = reference_generate(verifier, ids, ev.max_new_tokens, eos)
            reference = greedy_verdict(verifier, ids, made, greedy.tokens)
        as_shipped = None
        if shipped is not None:
            with fast:
                as_shipped = speculative_generate(verifier, shipped, ids, ev.max_new_tokens, shape, sampling,
                                                  eos)
        records.append(Record(task, run.stats, greedy.stats, lookup, verdict, reference, passes.index,
                              len(ids), None if as_shipped is None else as_shipped.stats))
        outputs.append({"task": task, "prompt_ids": ids.tolist(), "output_ids": run.tokens})
        progress.show(records)
    progress.close()

    settings = {
        "head": str(head_path),
        "kind": kind.name,
        "target": target.name,
        "mode": mode,
        "num_speculative_tokens": ev.num_speculative_tokens,
        "draft_p_min": ev.draft_p_min,
        "tree": asdict(ev.tree),
        "temperature": ev.temperature,
        "top_p": ev.top_p,
        "draft_sampling": ev.draft_sampling,
        "max_new_tokens": ev.max_new_tokens,
        "max_prompts_per_task": ev.max_prompts_per_task,
        "context_lengths": list(ev.context_lengths),
        "sliding_window": getattr(drafter, "window", None),  # the head's own, or eval's
        "reference": ev.reference,
        "chat_template_kwargs": dict(cfg.data.chat_template_kwargs or {}),
        "seed": cfg.seed,
        "threads": torch.get_num_threads(),
    }
    result = summarise(records, settings, kept)
    if costs:
        with fast:
            result["draft_settings"] = choose_setting(
                [s for r in records for s in r.spec.steps], shape, costs, calibration,
                lambda ids, chain: spec(ids, aside, chain=chain), sampling.greedy)
    write_report(result, out_dir)
    if ev.save_outputs:
        write_outputs(outputs, out_dir)
    return result
