"""Turn per-prompt decoding records into eval.json, eval.md, a per-position acceptance plot and,
for the long-context task, acceptance by context length.

Aggregates are ratios of sums (as vLLM reports them), never means of per-prompt ratios, so a
short answer does not weigh as much as a long one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from conf.files import atomic_write, atomic_write_text
from heads.export.card import PICTURE
from heads.kinds import head_kind
from trainer.decoding import DecodeStats, pooled_per_position
from trainer.decoding.tree import DEFAULT_MEDUSA_CHOICES
from trainer.evaluate.long_context import TASK, bucket_of, buckets, label

CONTEXT_PICTURE = "context.png"


@dataclass
class Record:
    """One prompt, the `prompt`-th of its task: the speculative run, the plain greedy run,
    optionally prompt lookup, `verdict`, how greedy speculative output compared with plain greedy
    (`run.greedy_verdict`: "same", "tie" when it parted only at a float-rounding tie of the
    target's top tokens, or "mismatch"), `reference`, how plain greedy compared with the
    target's own `generate` (None: not checked on this prompt), and the prompt's length."""

    task: str
    spec: DecodeStats
    greedy: DecodeStats
    prompt_lookup: DecodeStats | None
    verdict: str
    reference: str | None = None
    prompt: int = 0
    context: int = 0  # the prompt's tokens
    shipped: DecodeStats | None = None  # the head as the target ships it (`HeadKind.shipped_head`)

    @property
    def mismatches(self) -> list[str]:
        """What this prompt's output failed to equal: "greedy" (the speculative output parted
        from plain greedy), "generate" (plain greedy parted from the target's `generate`)."""
        checks = (("greedy", self.verdict), ("generate", self.reference))
        return [against for against, verdict in checks if verdict == "mismatch"]

    @property
    def lossless(self) -> bool:
        return not self.mismatches

    @property
    def tie(self) -> bool:
        return "tie" in (self.verdict, self.reference)


def _rate(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def task_metrics(records: list[Record]) -> dict:
    spec = [r.spec for r in records]
    drafts = sum(s.drafts for s in spec)
    accepted = sum(s.accepted_tokens for s in spec)
    per_pos = pooled_per_position(spec)
    greedy = [r.greedy for r in records]
    spec_tps = _rate(sum(s.new_tokens for s in spec), sum(s.total_s for s in spec))
    greedy_tps = _rate(sum(g.new_tokens for g in greedy), sum(g.total_s for g in greedy))
    out = {
        "prompts": len(records),
        "new_tokens": sum(s.new_tokens for s in spec),
        "target_forwards": sum(s.target_forwards for s in spec),
        "drafts": drafts,
        "drafted_tokens": sum(s.drafted_tokens for s in spec),
        "accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        "acceptance_per_position": [_rate(c, drafts) for c in per_pos],
        "draft_time_s": round(sum(s.draft_s for s in spec), 4),
        "verify_time_s": round(sum(s.verify_s for s in spec), 4),
        "prefill_time_s": round(sum(s.prefill_s for s in spec), 4),
        # Per speculative step (the draft's forwards, the verify forward, the rest) vs one plain
        # greedy step: the cost side of the speedup, which acceptance alone does not show.
        "draft_ms_per_step": _rate(1000 * sum(s.draft_s for s in spec), drafts),
        "verify_ms_per_step": _rate(1000 * sum(s.verify_s for s in spec), drafts),
        "other_ms_per_step": _rate(1000 * sum(s.other_s for s in spec), drafts),
        "greedy_ms_per_token": _rate(
            1000 * sum(g.verify_s for g in greedy), sum(g.target_forwards - 1 for g in greedy)
        ),
        "spec_tokens_per_s": spec_tps,
        "greedy_tokens_per_s": greedy_tps,
        **shipped_metrics(records),
        "speedup_vs_greedy": _rate(spec_tps or 0, greedy_tps or 0),
        "lossless": all(r.lossless for r in records),
        "mismatched_prompts": sum(not r.lossless for r in records),
        "numerical_ties": sum(r.tie for r in records),
        "checked_against_generate": sum(r.reference is not None for r in records),
    }
    lookup = [r.prompt_lookup for r in records if r.prompt_lookup is not None]
    if lookup:
        pl_tps = _rate(sum(p.new_tokens for p in lookup), sum(p.total_s for p in lookup))
        out["prompt_lookup_tokens_per_s"] = pl_tps
        # generate() runs one forward for the prefill and one per step.
        steps = sum(p.target_forwards - 1 for p in lookup)
        made = sum(p.new_tokens - 1 for p in lookup)
        out["prompt_lookup_tokens_per_forward"] = _rate(made, steps)
        out["speedup_vs_prompt_lookup"] = _rate(spec_tps or 0, pl_tps or 0)
    return out


def by_context(records: list[Record], uppers: list[int]) -> dict:
    """The long-context task's figures per bucket of `eval.context_lengths`, named as eval.md
    shows them: the `task_metrics` of its prompts there, and their mean and largest length."""
    out = {}
    for b, (lower, upper) in enumerate(buckets(uppers)):
        rs = [r for r in records if r.task == TASK and bucket_of(r.context, uppers) == b]
        if rs:
            out[label(lower, upper)] = {
                "mean_context_tokens": round(sum(r.context for r in rs) / len(rs)),
                "max_context_tokens": max(r.context for r in rs),
                **task_metrics(rs),
            }
    return out


def validation_gap(kept: dict | None, evaluated: float | None) -> dict | None:
    """The kept head's validation figures (`trainer.selection.kept_validation`: its step, the
    simulated τ, teacher-forced, and the decoded τ on validation prompts) beside the `evaluated`
    τ, with the gap between the simulated figure and the best measure of what decodes: the
    evaluated τ, else the decoded one. None: no simulated figure to compare."""
    if not kept or kept.get("simulated") is None:
        return None
    served = evaluated if evaluated is not None else kept.get("decoded")
    gap = None if served is None else round(kept["simulated"] - served, 4)
    return {**kept, "evaluated": evaluated, "gap": gap,
            "gap_against": None if served is None else "evaluated" if evaluated is not None else "decoded"}


def gap_sentence(g: dict) -> str:
    """`validation_gap`'s figures as eval.md and the closing lines say them."""
    figures = [f"simulated τ {fmt(g['simulated'])} (teacher-forced)"]
    if g.get("decoded") is not None:
        figures.append(f"decoded {fmt(g['decoded'])} on validation prompts")
    if g.get("evaluated") is not None:
        figures.append(f"evaluated {fmt(g['evaluated'])}")
    said = f"the kept head (step {g['step']}): " + ", ".join(figures)
    if g["gap"] is None:
        return said
    return said + f"; the simulated τ overstates the {g['gap_against']} one by {g['gap']:+.3f}"


def shipped_metrics(records: list[Record]) -> dict:
    """The shipped head's acceptance on the same prompts (`Record.shipped`), where it ran."""
    shipped = [r.shipped for r in records if r.shipped is not None]
    if not shipped:
        return {}
    drafts = sum(s.drafts for s in shipped)
    accepted = sum(s.accepted_tokens for s in shipped)
    return {"shipped_mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None}


def summarise(records: list[Record], settings: dict, kept: dict | None = None) -> dict:
    """The eval.json object: settings, overall, per task, the lossless verdict, each prompt that
    broke it (task, index in the task, what its output failed to equal), with `context_lengths`
    the long-context task by bucket (`by_context`) and, for a head a run just kept (`kept`:
    its validation figures), the gap between its simulated τ and what decodes
    (`validation_gap`)."""
    tasks: dict[str, list[Record]] = {}
    for r in records:
        tasks.setdefault(r.task, []).append(r)
    per_task = {name: task_metrics(rs) for name, rs in tasks.items()}
    overall = task_metrics(records)
    uppers = settings.get("context_lengths") or []
    gap = validation_gap(kept, overall["mean_acceptance_length"])
    return {
        "settings": settings,
        "lossless": all(r.lossless for r in records),
        "mismatches": [
            {"task": r.task, "prompt": r.prompt, "against": against}
            for r in records
            for against in r.mismatches
        ],
        "overall": overall,
        "tasks": per_task,
        **({"by_context": by_context(records, uppers)} if uppers else {}),
        **({"validation_gap": gap} if gap else {}),
    }


def fmt(value) -> str:
    """A figure as eval.md and the progress lines show it; None (no drafts, no time) is "-"."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _drafting(s: dict) -> str:
    window = s.get("sliding_window")
    return _shape(s) + (f", the draft attending to the last {window} positions" if window else "")


def _shape(s: dict) -> str:
    if s["mode"] == "chain":
        cut = f", p_min {s['draft_p_min']}" if s.get("draft_p_min") else ""
        return f"chain drafting (k={s['num_speculative_tokens']}{cut})"
    t = s["tree"]
    if head_kind(s["kind"]).static_tree:
        nodes = len(t["medusa_choices"] or DEFAULT_MEDUSA_CHOICES)
        return f"static tree drafting ({nodes} nodes)"
    return (
        f"dynamic tree drafting (total_tokens={t['total_tokens']}, depth={t['depth']}, "
        f"topk={t['topk']})"
    )


def _mismatch_lines(mismatches: list[dict]) -> list[str]:
    """eval.md's list of the prompts that broke losslessness, if any."""
    if not mismatches:
        return []
    named = {"greedy": "speculative != plain greedy", "generate": "plain greedy != generate"}
    shown = ", ".join(f"{m['task']} #{m['prompt']} ({named[m['against']]})" for m in mismatches)
    return ["", f"Mismatched prompts: {shown}."]


def _table(first: str, rows: dict[str, dict], extra: tuple[str, ...] = ()) -> list[str]:
    """A markdown table of `task_metrics` rows, named in the column `first`, with the `extra`
    fields of each row after its prompt count."""
    depth = max(len(m["acceptance_per_position"]) for m in rows.values())
    lookup = any("prompt_lookup_tokens_per_s" in m for m in rows.values())
    cols = [first, "prompts", *(e.replace("_", " ") for e in extra), "mean acceptance length"]
    cols += [f"acc@{j + 1}" for j in range(depth)]
    cols += ["spec tok/s", "greedy tok/s", "speedup"]
    cols += ["prompt lookup tok/s", "speedup vs lookup"] if lookup else []
    cols += ["lossless"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, m in rows.items():
        acc = m["acceptance_per_position"] + [None] * (depth - len(m["acceptance_per_position"]))
        cells = [name, m["prompts"], *(m[e] for e in extra), m["mean_acceptance_length"], *acc]
        cells += [m["spec_tokens_per_s"], m["greedy_tokens_per_s"], m["speedup_vs_greedy"]]
        if lookup:
            cells += [m.get("prompt_lookup_tokens_per_s"), m.get("speedup_vs_prompt_lookup")]
        cells += [m["lossless"]]
        lines.append("| " + " | ".join(fmt(c) for c in cells) + " |")
    return lines


def _step_lines(result: dict) -> list[str]:
    """eval.md's "where a step's time goes": per task, a speculative step's draft, verify and
    other milliseconds beside a greedy token's, and the acceptance length that breaks even."""
    rows = {**result["tasks"], "overall": result["overall"]}
    lines = ["", "## Where a step's time goes", "",
             "Milliseconds per speculative step (the draft's forwards; the target's forward over the "
             "root and the drafts; the rest: acceptance, cache upkeep, the drafter's commit) against "
             "one greedy token. A step pays only when it yields more tokens than its time in greedy "
             "tokens (break-even τ).", "",
             "| task | draft ms | verify ms | other ms | step ms | greedy ms/token | break-even τ | τ |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in rows.items():
        parts = [m.get("draft_ms_per_step"), m.get("verify_ms_per_step"), m.get("other_ms_per_step")]
        step = round(sum(parts), 4) if None not in parts else None
        greedy = m.get("greedy_ms_per_token")
        even = _rate(step, greedy) if step is not None and greedy else None
        cells = [name, *parts, step, greedy, even, m["mean_acceptance_length"]]
        lines.append("| " + " | ".join(fmt(c) for c in cells) + " |")
    return lines


def settings_lines(sweep: dict | None) -> list[str]:
    """eval.md's table of chain lengths and p_min (`trainer.evaluate.settings`): the step costs
    per k it rests on, each setting's predicted τ and speedup, and the best decoded for real."""
    if not sweep:
        return []
    head = ["", "## Draft length and p_min", ""]
    if "skipped" in sweep:
        return [*head, f"Not swept: {sweep['skipped']}."]
    lines = [*head,
             "Each k's step, measured on the first prompt at p_min 0 (greedy: "
             f"{fmt(sweep['greedy_ms_per_token'])} ms a token):", "",
             "| k | draft ms | verify ms | other ms | break-even τ | steps |", "|---|---|---|---|---|---|"]
    for k, c in sweep["step_costs"].items():
        fields = ("draft_ms", "verify_ms", "other_ms", "break_even_acceptance_length", "steps")
        cells = [k, *(c[f] for f in fields)]
        lines.append("| " + " | ".join(fmt(x) for x in cells) + " |")
    lines += ["", "Every setting, predicted from those costs and the drafts this evaluation recorded "
              "(what a shorter chain or a higher p_min would have drafted and kept at each step):", "",
              "| k | p_min | drafted/step | τ | speedup |", "|---|---|---|---|---|"]
    for r in sweep["rows"]:
        fields = ("k", "p_min", "drafted_per_step", "mean_acceptance_length", "speedup_vs_greedy")
        cells = [r[f] for f in fields]
        lines.append("| " + " | ".join(fmt(x) for x in cells) + " |")
    best, fastest, check = sweep["best"], sweep["fastest"], sweep.get("check")
    unconfirmed = fastest is not None and fastest["speedup_vs_greedy"] >= 1.0
    lines.append("")
    if best:
        lines.append(f"**Best: k={best['k']}, p_min {fmt(best['p_min'])}**, predicted τ "
                     f"{fmt(best['mean_acceptance_length'])}, {fmt(best['speedup_vs_greedy'])}x greedy; "
                     "the model card's serve lines carry it.")
    elif fastest:
        lines.append(f"**No setting is faster than greedy decoding here** (the fastest predicted, "
                     f"k={fastest['k']}, p_min {fmt(fastest['p_min'])}: {fmt(fastest['speedup_vs_greedy'])}x"
                     + (", not confirmed by its real decode below" if unconfirmed else "")
                     + "); the model card says so.")
    if check:
        p, m, d = check["predicted"], check["measured"], check["decoded"]
        same = check["same_as_greedy"]
        lines += ["", f"Checked by a real decode of the first prompt at k={check['k']}, p_min "
                  f"{fmt(check['p_min'])}: τ {fmt(m['mean_acceptance_length'])} and "
                  f"{fmt(m['speedup_vs_greedy'])}x measured, {fmt(p['mean_acceptance_length'])} and "
                  f"{fmt(p['speedup_vs_greedy'])}x predicted (the evaluation's own k={d['k']}, p_min "
                  f"{fmt(d['p_min'])} there: τ {fmt(d['mean_acceptance_length'])}, "
                  f"{fmt(d['speedup_vs_greedy'])}x)"
                  + ("" if same is None else f"; output identical to greedy: {fmt(same)}") + ". "
                  "Speedups here leave the prefill out."]
    return lines


def _gap_lines(g: dict | None) -> list[str]:
    """eval.md's paragraph on the train-versus-serve gap, for a head a run just kept."""
    if g is None:
        return []
    return [f"Validation in training against decoding: {gap_sentence(g)}. The simulated τ reads the "
            "true prefix at every draft step; decoding reads the head's own drafts, as serving does.", ""]


def _shipped_lines(overall: dict) -> list[str]:
    if "shipped_mean_acceptance_length" not in overall:
        return []
    return ["", f"Mean acceptance length of the head as the target ships it, on the same prompts: "
            f"{fmt(overall['shipped_mean_acceptance_length'])} (trained: "
            f"{fmt(overall['mean_acceptance_length'])})."]


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# Evaluation of `{s['head']}` ({s['kind']})",
        "",
        f"Target `{s['target']}`, {_drafting(s)}, temperature {s['temperature']}, "
        f"top_p {s['top_p']}, "
        f"max {s['max_new_tokens']} new tokens. Lossless (greedy speculative output == plain "
        f"greedy == the target's own `generate`, checked on "
        f"{result['overall']['checked_against_generate']} prompts): **{fmt(result['lossless'])}**.",
        *_mismatch_lines(result["mismatches"]),
        *_shipped_lines(result["overall"]),
        "",
        *_table("task", {**result["tasks"], "overall": result["overall"]}),
        *_step_lines(result),
        *settings_lines(result.get("draft_settings")),
        "",
        *_gap_lines(result.get("validation_gap")),
        "The tokens/s are this evaluator's (PyTorch, one prompt at a time, on the machine that ran "
        "it): what the head costs and saves in our decoder, not in an engine. An engine's own "
        "figures, on the same prompts and weights: `scripts/check_vllm.py` (vLLM), "
        "`scripts/check_llama_cpp.py` (llama.cpp, the engine of CPUs and laptops).",
        "",
        f"![Per-position acceptance]({PICTURE})",
    ]
    if result.get("by_context"):
        lines += [
            "", "## By context length", "",
            f"The {TASK} task's prompts by their length in tokens (`eval.context_lengths`).", "",
            *_table("context", result["by_context"], ("mean_context_tokens",)),
            "", f"![Acceptance by context length]({CONTEXT_PICTURE})",
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    depth = len(result["overall"]["acceptance_per_position"])
    ax.set_xticks(range(1, depth + 1))
    for name, m in {**result["tasks"], "overall": result["overall"]}.items():
        rates = [r or 0.0 for r in m["acceptance_per_position"]]
        style = "k--" if name == "overall" else "-"
        ax.plot(range(1, len(rates) + 1), rates, style, marker="o", label=name)
    ax.set_xlabel("draft position (tree depth)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"Per-position acceptance ({result['settings']['kind']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def plot_context(result: dict, path: Path) -> None:
    """Mean acceptance length against the prompts' mean length, one point per bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["by_context"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [m["mean_context_tokens"] for m in rows.values()]
    ax.plot(xs, [m["mean_acceptance_length"] or 1.0 for m in rows.values()], "o-")
    for x, (name, m) in zip(xs, rows.items()):
        ax.annotate(f"{name} ({m['prompts']})", (x, m["mean_acceptance_length"] or 1.0),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("mean acceptance length")
    ax.set_title(f"Acceptance by context length ({result['settings']['kind']})")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def write_outputs(outputs: list[dict], out_dir: str | Path) -> Path:
    """outputs.jsonl under out_dir: one line per prompt, {"task", "prompt_ids", "output_ids"} (the
    speculative output), so that anyone can run the target on the prompts and compare."""
    path = Path(out_dir) / "outputs.jsonl"
    atomic_write_text(path, "".join(json.dumps(o) + "\n" for o in outputs))
    return path


def write_report(result: dict, out_dir: str | Path) -> Path:
    """eval.json, eval.md, acceptance.png and, with `by_context`, context.png (both shown in
    eval.md) under out_dir, each written to a temp name first."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "eval.json", lambda p: p.write_text(json.dumps(result, indent=2) + "\n"))
    atomic_write(out / "eval.md", lambda p: p.write_text(markdown(result)))
    atomic_write(out / PICTURE, lambda p: plot(result, p))
    if result.get("by_context"):
        atomic_write(out / CONTEXT_PICTURE, lambda p: plot_context(result, p))
    return out
