"""One run_dir holds one run, and a run ends speaking to a person.

A second run into a run_dir that holds checkpoints is refused before any work with one line
naming the step and the two ways on; nothing of the old run changes; `resume=true` continues it.
The end of a run is a few plain lines (the record stays in summary.json), and training.png
shows its curves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conf.compose import check_command_line
from tests.support.cli import error_lines, run_cli
from tests.support.runs import tiny_run_args, tiny_run_config, user_error_line
from trainer.closing import closing_lines
from trainer.train import run

STEPS = ("optim.max_steps=4", "optim.save_every=2", "optim.val_every=2")


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_reused_run_dir_is_refused_and_resume_continues_it(sharp_target, chat_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = run(tiny_run_config("eagle3", sharp_target, chat_file, run_dir, *STEPS))
    assert first["steps"] == 4
    shown = capsys.readouterr().out.strip().splitlines()
    assert shown[-3:] == [
        shown[-3],
        f"head: {run_dir / 'head'}",
        f"details: {run_dir / 'summary.json'}, {run_dir / 'training.png'}",
    ] and shown[-3].startswith("done in ") and shown[-3].endswith(" min: not evaluated")
    assert (run_dir / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = files(run_dir)

    again = tiny_run_args("eagle3", sharp_target, chat_file, run_dir, *STEPS)
    want = (f"error: run_dir={run_dir} holds a run to step 4: add resume=true to continue it, or "
            "choose another run_dir")
    assert user_error_line(lambda: run(check_command_line(again))) == want
    # As typed: refused before Hydra writes its run_dir/hydra folder.
    code, _, err = run_cli("trainer.train", again, tmp_path)
    assert code == 2 and error_lines(err) == [want]
    assert files(run_dir) == before

    # The history a resumed run continues is the one saved inside its checkpoint, not the
    # run_dir's copy (which a run killed between the two writes left out of step).
    (run_dir / "history.json").write_text('[{"step": 99, "loss": 0.0}]')
    more = run(tiny_run_config("eagle3", sharp_target, chat_file, run_dir, *STEPS, "optim.max_steps=6",
                               "resume=true", "logging.log_every=1"))
    assert more["steps"] == 6
    history = json.loads((run_dir / "history.json").read_text())
    assert [h["step"] for h in history if "val" in h] == [2, 4, 6]
    assert json.loads((run_dir / "checkpoints" / "step-0000004" / "history.json").read_text()) == [
        h for h in history if h["step"] <= 4]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000004", "step-0000006"]

    # A finished run whose checkpoints were cleared still holds its head and summary.
    shutil.rmtree(run_dir / "checkpoints")
    line = user_error_line(lambda: run(tiny_run_config("eagle3", sharp_target, chat_file, run_dir)))
    held = "holds an earlier run's head and summary.json: choose another run_dir"
    assert line == f"error: run_dir={run_dir} {held}"


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
