"""No module outside a head kind's own branches on the kind's name: every question about a kind
is a field of its record (`heads.kinds.HeadKind`), so the next kind is the record plus its own
modules, not one more branch in every consumer. A comparison with a kind's name, a table indexed
by one or a `.get`/`startswith` on one fails here, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

from heads.kinds import KINDS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["conf", "heads", "data_prep", "trainer", "scripts"]
# The catalogs and the decoder's drafters, which may name every kind.
CATALOGS = {"heads/kinds.py", "trainer/kinds/__init__.py", "trainer/decoding/drafters.py"}


def own_modules(name: str) -> set[str]:
    """A kind's own modules, which may name their kind (and formats that share its name): its
    folder in heads, its trainer module and its decoding drafter where it has one."""
    own = {p.relative_to(ROOT).as_posix() for p in (ROOT / "heads" / name).glob("*.py")}
    return own | {f"trainer/kinds/{name}.py"} | {
        p.relative_to(ROOT).as_posix() for p in (ROOT / "trainer" / "decoding").glob(f"{name}.py")}


OWN = CATALOGS.union(*(own_modules(name) for name in KINDS))
LOOKUPS = ("get", "pop", "startswith", "endswith")


def _kind_name(node: ast.AST, names: set[str]) -> bool:
    """A string literal naming a kind, alone or inside a literal tuple, list or set."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_kind_name(e, names) for e in node.elts)
    return False


def kind_branches(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every comparison with, subscript by, lookup of or `case` on a kind name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Compare) and any(
            _kind_name(n, names) for n in (node.left, *node.comparators)
        ):
            found.append((node.lineno, "compares with a kind name"))
        elif isinstance(node, ast.Subscript) and _kind_name(node.slice, names):
            found.append((node.lineno, "indexes a table by a kind name"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LOOKUPS
            and node.args
            and _kind_name(node.args[0], names)
        ):
            found.append((node.lineno, f".{node.func.attr}() on a kind name"))
        elif isinstance(node, ast.MatchValue) and _kind_name(node.value, names):
            found.append((node.lineno, "matches a kind name"))
    return found


def branches_outside_the_kinds() -> list[str]:
    names = set(KINDS)
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in OWN:
                bad += [f"{rel}:{line} {what}" for line, what in kind_branches(path, names)]
    return bad


def test_no_module_outside_a_kind_branches_on_its_name():
    assert branches_outside_the_kinds() == []


def test_the_own_modules_exist():
    """A kind is a folder in heads and a module in trainer/kinds: a kind laid out otherwise
    (or a renamed catalog) would leave the exemptions stale."""
    assert all((ROOT / rel).is_file() for rel in OWN)
    for name in KINDS:
        assert {f"heads/{name}/__init__.py", f"heads/{name}/model.py", f"trainer/kinds/{name}.py"} <= OWN


def test_the_walk_sees_each_form_of_branch(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f(cfg, kind, table, fmt):\n"
        "    if cfg.head.name == 'eagle3':\n"
        "        return table['medusa']\n"
        "    if kind in ('medusa', 'other'):\n"
        "        return table.get('eagle3')\n"
        "    match kind:\n"
        "        case 'medusa':\n"
        "            return fmt.startswith('medusa')\n"
        "    return 'eagle3' != kind or cfg.x == 'eagle'\n"
    )
    assert sorted(line for line, _ in kind_branches(module, {"eagle3", "medusa"})) == [2, 3, 4, 5, 7, 8, 9]
