"""What a person reads when the main job ends: a few plain lines, not the summary's JSON.

The run's record stays whole in summary.json (and eval.json); these lines answer the questions a
user has at that moment: did the head help (τ per task), how far training's teacher-forced τ
was from what decodes (the gap), is it safe (lossless), where is it, and how to serve it. Pure
text from the dicts the run already holds, so a test checks it without a run.
"""

from __future__ import annotations

from pathlib import Path

from trainer.evaluate.report import gap_sentence, validation_gap


def _tau(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def tau_line(report: dict) -> str:
    """τ overall and per task, and how many prompts stand behind it."""
    tasks = report["tasks"]
    per_task = ", ".join(f"{name} {_tau(m['mean_acceptance_length'])}" for name, m in tasks.items())
    counts = sorted({m["prompts"] for m in tasks.values()})
    total = report["overall"]["prompts"]
    prompts = f"{counts[0]} prompts per task" if len(counts) == 1 else f"{total} prompts"
    return f"τ {_tau(report['overall']['mean_acceptance_length'])} overall ({per_task}; {prompts})"


def lossless_line(report: dict, eval_dir: str) -> str:
    if report["lossless"]:
        checked = report["overall"]["checked_against_generate"]
        return (f"lossless: yes, every speculative output equal to greedy decoding ({checked} also to the "
                f"target's generate): {Path(eval_dir) / 'eval.md'}")
    broken = ", ".join(f"{m['task']} #{m['prompt']}" for m in report["mismatches"])
    return f"lossless: NO, outputs differ on {broken}: {Path(eval_dir) / 'eval.md'}"


def serve_line(exports: list[str]) -> str | None:
    """The shortest `vllm serve` command on the exports' model cards (speculators': one argument)."""
    lines = [
        line.strip()
        for folder in exports
        if (Path(folder) / "README.md").exists()
        for line in (Path(folder) / "README.md").read_text(encoding="utf-8").splitlines()
        if line.strip().startswith("vllm serve ")
    ]
    return min(lines, key=len, default=None)


def gap_line(summary: dict, report: dict | None) -> str | None:
    """The simulated (teacher-forced) τ of the kept head against the evaluated one (eval.json's
    `validation_gap`), or against the decoded one where nothing was evaluated; None: no
    simulated figure (no validation kept the head)."""
    gap = report.get("validation_gap") if report else validation_gap(summary.get("kept_validation"), None)
    return None if gap is None else f"τ gap: {gap_sentence(gap)}"


def closing_lines(summary: dict, report: dict | None) -> list[str]:
    """The end of a main job, from its summary (and the evaluation's eval.json, if it ran)."""
    run_dir = Path(summary["run_dir"])
    minutes = summary["wall_time_s"] / 60
    lines = [f"done in {minutes:.1f} min: " + (tau_line(report) if report else "not evaluated")]
    gap = gap_line(summary, report)
    if gap:
        lines.append(gap)
    if report:
        lines.append(lossless_line(report, summary["eval_dir"]))
    exports = summary.get("exports", [])
    lines.append(f"head: {summary['head_dir']}" + (f"; exports: {', '.join(exports)}" if exports else ""))
    serve = serve_line(exports)
    if serve:
        lines.append(f"serve: {serve}")
    lines.append(f"details: {run_dir / 'summary.json'}, {run_dir / 'training.png'}")
    return lines
