"""A run ends speaking to a person: a few plain lines (the record stays in summary.json) saying τ,
whether it was lossless, where the head and exports are and how to serve them. That one run_dir
holds one run (a second refused in one line, `resume=true` continuing it) is
tests/e2e/test_run_dir.py's: three main jobs and the command as typed."""

from __future__ import annotations

from trainer.closing import closing_lines

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
    broken = {**REPORT, "lossless": False, "mismatches": [{"task": "gsm8k", "prompt": 2, "against": "x"}]}
    eval_md = tmp_path / "eval" / "eval.md"
    assert closing_lines(summary, broken)[1] == f"lossless: NO, outputs differ on gsm8k #2: {eval_md}"
