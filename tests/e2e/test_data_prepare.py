"""`python -m data_prep.prepare` as users run it: bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
from tests.support.runs import conversations


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
