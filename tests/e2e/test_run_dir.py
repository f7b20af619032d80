"""One run_dir holds one run. A second run into a run_dir that holds checkpoints is refused before
any work with one line naming the step and the two ways on (in process and as typed, before Hydra
writes its folder); nothing of the old run changes; `resume=true` continues it from the history
its checkpoint holds; a finished run's folder is refused too. The run's closing lines and its
training.png on the way. Three main jobs and an interpreter: in e2e since #62 (the closing lines'
wording stays in tests/unit/trainer/test_run_dir.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conf.compose import check_command_line
from tests.support.cli import error_lines, run_cli
from tests.support.runs import tiny_run_args, tiny_run_config, user_error_line
from trainer.train import run

STEPS = ("optim.max_steps=4", "optim.save_every=2", "optim.val_every=2")


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_reused_run_dir_is_refused_and_resume_continues_it(sharp_target, chat_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = run(tiny_run_config("eagle3", sharp_target, chat_file, run_dir, *STEPS))
    assert first["steps"] == 4
    shown = capsys.readouterr().out.strip().splitlines()
    assert shown[-4:] == [
        shown[-4],
        shown[-3],
        f"head: {run_dir / 'head'}",
        f"details: {run_dir / 'summary.json'}, {run_dir / 'training.png'}",
    ] and shown[-4].startswith("done in ") and shown[-4].endswith(" min: not evaluated")
    # decoded validation by default: the kept head's simulated τ against its decoded one
    assert shown[-3].startswith(f"τ gap: the kept head (step {first['best_step']}): simulated τ ")
    assert " the simulated τ overstates the decoded one by " in shown[-3]
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
