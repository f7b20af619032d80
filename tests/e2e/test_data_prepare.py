"""`python -m data_prep.prepare` as users run it: bad input is one line and exit 2, and a stage
that fails shows its error as the last line, its progress bar closed before it."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
from tests.support.runs import conversations
from tests.support.targets import build_overflowing_target


@pytest.mark.slow
def test_cli_bad_input_is_one_line_and_exit_2(tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(conversations(1)[0]) + "\n" + '{"conversations": [\n')
    code, _, err = run_cli("data_prep.prepare", [
        "+head=medusa",
        f"target.name_or_path={tiny_llama_dir}",
        "target.num_threads=1",
        f"data.source={bad}",
        "data.regenerate.enabled=false",
        f"data.cache_dir={tmp_path}",
        f"run_dir={tmp_path / 'run'}",
    ], tmp_path)
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert lines == [f"error: {bad}:2: malformed JSON (Expecting value at column 20)"]


@pytest.mark.slow
def test_a_failed_capture_ends_on_its_error_line(smol_tokenizer, chat_file, tmp_path):
    """Capture refuses an overflowing layer mid-bar: the bar is closed before the error line, which
    is the last line shown (an open bar would redraw itself as the process exits)."""
    target = build_overflowing_target(tmp_path / "overflowing", smol_tokenizer, layer=3)
    code, _, err = run_cli("data_prep.prepare", [
        "+head=eagle3",
        f"target.name_or_path={target}",
        "target.num_threads=1",
        f"data.source={chat_file}",
        "data.regenerate.enabled=false",
        "data.max_samples=0",
        "data.draft_vocab_size=400",
        f"data.cache_dir={tmp_path / 'cache'}",
        "logging.progress=true",
    ], tmp_path)
    assert code == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "the target's hidden states overflow: layer 4" in last, err[-3000:]
    assert "capture:" in err and "Traceback" not in err  # the bar was shown, then closed
