"""No test module imports another test module (or a conftest): what tests share lives in
tests/support/ or in a conftest fixture. A test file that imports another one runs the other's
module code, ties the two files' moves and splits together and hides which helpers are shared,
so it fails here, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imported_test_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a test module or conftest in the file, nested and
    relative ones included (`from tests.unit import test_x` names `tests.unit.test_x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if is_test_module(module):
                found.append((node.lineno, module))
            found += [
                (node.lineno, f"{module}.{alias.name}".replace("..", "."))
                for alias in node.names
                if is_test_module(alias.name)
            ]
    return found


def test_no_test_module_imports_another():
    bad = [
        f"{path.relative_to(TESTS.parent)}:{line} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in imported_test_modules(path)
    ]
    assert bad == []


def test_the_walk_sees_every_form_of_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import os\nimport tests.unit.test_a\nfrom test_b import x\nfrom tests.e2e import test_c\n"
        "from .test_d import y\nfrom tests.support.runs import summary\n"
        "def f():\n    from tests.conftest import TINY\n"
    )
    assert imported_test_modules(module) == [
        (2, "tests.unit.test_a"),
        (3, "test_b"),
        (4, "tests.e2e.test_c"),
        (5, ".test_d"),
        (8, "tests.conftest"),
    ]
