"""The README stays a guide a reader can follow: short table cells, one table of measured figures,
and only `python -m` modules (and scripts) that exist.

Plain text checks in process, no model: a long cell is a paragraph that belongs in a module's
docstring, a second figures table is where figures start to drift apart, and a command that names a
renamed module is a front door that no longer opens.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# The repository root, found from here so that the file works in tests/ or a tier under it.
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README = ROOT / "README.md"
MAX_CELL = 120
# `python -m` modules the README may name that are tools, not this repository's modules.
EXTERNAL = {"pip", "pytest"}


def prose_lines(text: str) -> list[str]:
    """The README's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def tables(text: str) -> list[list[list[str]]]:
    """Each markdown table as rows of cells (the separator row dropped); `\\|` stays inside a cell."""
    found, rows = [], []
    for line in prose_lines(text) + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            found, rows = found + [rows], []
    return found


def long_cells(text: str) -> list[str]:
    return [c for t in tables(text) for row in t for c in row if len(c) > MAX_CELL]


def figure_tables(text: str) -> int:
    """Tables whose header names τ (acceptance length): figures belong in one of them."""
    return sum(any("τ" in c for c in t[0]) for t in tables(text))


def measured_headings(text: str) -> int:
    return sum(bool(re.match(r"#+\s+Measured\b", line)) for line in prose_lines(text))


def missing_modules(text: str) -> list[str]:
    """`python -m X` (and `-m X` after a launcher) naming no module of this repository, and
    `scripts/...` or `tests/...` paths that are not there."""
    missing = []
    for name in sorted(set(re.findall(r"(?:python|torchrun|launch)\b[^\n`|]*?\s-m\s+([\w.]+)", text))):
        if name in EXTERNAL:
            continue
        top = name.split(".")[0]
        spec = importlib.util.find_spec(name) if (ROOT / top).is_dir() else None
        package = spec is not None and spec.submodule_search_locations is not None
        if spec is None or (package and importlib.util.find_spec(f"{name}.__main__") is None):
            missing.append(name)
    for path in sorted(set(re.findall(r"\b(?:scripts|tests)/[\w./-]+\.(?:py|sh)\b", text))):
        if not (ROOT / path).is_file():
            missing.append(path)
    return missing


def test_table_cells_are_short():
    assert long_cells(README.read_text()) == []


def test_one_measured_table():
    text = README.read_text()
    assert figure_tables(text) <= 1
    assert measured_headings(text) <= 1


def test_named_modules_exist():
    assert missing_modules(README.read_text()) == []


def test_checks_catch_what_they_guard():
    bad = (
        "## Measured\n\n| run | τ |\n| --- | --- |\n| `a` | " + "x" * (MAX_CELL + 1) + " |\n\n"
        "## Measured\n\n| other | τ (mtbench) |\n| --- | --- |\n| `b` | 1.0 |\n\n"
        "```bash\npython -m trainer.no_such_module +head=eagle3\nbash scripts/no_such.sh\n```\n"
    )
    assert len(long_cells(bad)) == 1
    assert figure_tables(bad) == 2 and measured_headings(bad) == 2
    assert missing_modules(bad) == ["trainer.no_such_module", "scripts/no_such.sh"]
    good = "| `ce\\|tv` | python -m trainer.train |\n| --- | --- |\n"
    assert long_cells(good) == [] and missing_modules(good) == []
