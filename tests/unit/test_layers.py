"""The packages form layers, each importing only those below it:
conf <- heads <- data_prep <- trainer <- scripts. An upward import (even one inside a function)
is the loop that made `cfg` hard to follow, so it fails here, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["conf", "heads", "data_prep", "trainer", "scripts"]


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) for every import statement in the file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def upward_imports() -> list[str]:
    bad = []
    for rank, layer in enumerate(LAYERS):
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, package in imported_packages(path):
                if package in LAYERS and LAYERS.index(package) > rank:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {package} (a layer above {layer})")
    return bad


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports() == []


def test_the_walk_sees_nested_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from trainer.loop import fit\n    import heads.eagle3\n")
    assert imported_packages(module) == [(1, "os"), (4, "trainer"), (5, "heads")]
