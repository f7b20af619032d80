"""A run ends speaking to a person: a few plain lines (the record stays in summary.json) saying τ,
how far the kept head's simulated τ was from what decodes, whether it was lossless, where the head
and exports are and how to serve them. That one run_dir holds one run (a second refused in one
line, `resume=true` continuing it) is tests/e2e/test_run_dir.py's: three main jobs and the command
as typed. A head in its run folder evaluates into that run."""

from __future__ import annotations

import json
import shutil

from trainer.closing import closing_lines
from trainer.evaluate.report import validation_gap

REPORT = {
    "lossless": True,
    "mismatches": [],
    "overall": {"mean_acceptance_length": 1.4361, "prompts": 9, "checked_against_generate": 3},
    "tasks": {
        "mtbench": {"mean_acceptance_length": 1.452, "prompts": 3},
        "humaneval": {"mean_acceptance_length": 1.37, "prompts": 3},
        "gsm8k": {"mean_acceptance_length": None, "prompts": 3},
    },
}


def test_the_closing_lines_say_tau_lossless_where_and_how_to_serve(tmp_path):
    export = tmp_path / "export" / "speculators"
    export.mkdir(parents=True)
    (export / "README.md").write_text(
        "```bash\nvllm serve /x/speculators\n```\n```bash\nvllm serve base --speculative-config '{}'\n```\n"
    )
    summary = {"run_dir": str(tmp_path), "wall_time_s": 1122.0, "eval_dir": str(tmp_path / "eval"),
               "head_dir": str(tmp_path / "head"), "exports": [str(export)]}
    assert closing_lines(summary, REPORT) == [
        "done in 18.7 min: τ 1.436 overall (mtbench 1.452, humaneval 1.370, gsm8k -; 3 prompts per task)",
        f"lossless: yes, every speculative output equal to greedy decoding (3 also to the target's "
        f"generate): {tmp_path / 'eval' / 'eval.md'}",
        f"head: {tmp_path / 'head'}; exports: {export}",
        "serve: vllm serve /x/speculators",
        f"details: {tmp_path / 'summary.json'}, {tmp_path / 'training.png'}",
    ]
    kept = {"step": 40, "simulated": 1.85, "decoded": 1.51}
    gapped = {**REPORT, "validation_gap": validation_gap(kept, 1.4361)}
    assert closing_lines(summary, gapped)[1] == (
        "τ gap: the kept head (step 40): simulated τ 1.850 (teacher-forced), decoded 1.510 on validation "
        "prompts, evaluated 1.436; the simulated τ overstates the evaluated one by +0.414"
    )
    unevaluated = closing_lines({**summary, "kept_validation": kept}, None)
    assert unevaluated[:2] == [
        "done in 18.7 min: not evaluated",
        "τ gap: the kept head (step 40): simulated τ 1.850 (teacher-forced), decoded 1.510 on validation "
        "prompts; the simulated τ overstates the decoded one by +0.340",
    ]
    broken = {**REPORT, "lossless": False, "mismatches": [{"task": "gsm8k", "prompt": 2, "against": "x"}]}
    eval_md = tmp_path / "eval" / "eval.md"
    assert closing_lines(summary, broken)[1] == f"lossless: NO, outputs differ on gsm8k #2: {eval_md}"


def test_a_head_in_its_run_folder_evaluates_into_that_run(tiny_model, tiny_llama_dir, tmp_path):
    """`+head=eagle3.1` trains in outputs/eagle3.1 and its head composes as `+head=eagle3`: the
    head's own run folder is the run_dir (its `eval/` gets the evaluation), unless `run_dir=`
    says otherwise; a head outside any run keeps the kind's default."""
    from heads.folder import compose_for_head
    from tests.support.heads import eagle_head

    run_dir = tmp_path / "outputs" / "eagle3.1"
    head = eagle_head(tiny_model, str(tiny_llama_dir), run_dir / "head")
    (run_dir / "config.json").write_text(json.dumps({"run_dir": str(run_dir), "data": {}}))
    assert compose_for_head(str(head), []).run_dir == str(run_dir)
    assert compose_for_head(str(head), [f"run_dir={tmp_path / 'x'}"]).run_dir == str(tmp_path / "x")
    loose = shutil.copytree(head, tmp_path / "loose" / "head")
    assert compose_for_head(str(loose), []).run_dir == "outputs/eagle3"


def test_the_evaluator_finds_the_gap_of_the_head_its_run_kept(tmp_path):
    """`python -m trainer.evaluate head=<run_dir>/head` reports the kept head's gap again; a head
    its run did not keep (a copy, another folder) has none to report."""
    from trainer.evaluate.__main__ import kept_validation_of

    kept = {"step": 40, "simulated": 1.85, "decoded": 1.51}
    (tmp_path / "head").mkdir()
    record = {"head_dir": str(tmp_path / "head"), "kept_validation": kept}
    (tmp_path / "summary.json").write_text(json.dumps(record))
    assert kept_validation_of(str(tmp_path / "head")) == kept
    assert kept_validation_of(str(tmp_path / "elsewhere")) is None
    assert kept_validation_of(str(tmp_path / "nowhere" / "head")) is None
