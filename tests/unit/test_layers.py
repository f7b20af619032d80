"""The packages form layers, each importing only those below it:
conf <- heads <- data_prep <- trainer <- scripts. An upward import (even one inside a function)
is the loop that made `cfg` hard to follow, so it fails here, naming the file and line; and no
two modules import each other, directly or around a longer loop (function-level imports count:
they hide a cycle, they do not remove it). Inside `data_prep` the stages run one way too, in the
order a conversation goes through them (`DATA_PREP_STAGES`): a stage imports the base modules at
the top of `data_prep` and earlier stages only, a base module no stage, and no stage imports an
entry point (`prepare`, `show`), which runs them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["conf", "heads", "data_prep", "trainer", "scripts"]
DATA_PREP_STAGES = ["conversations", "answers", "states", "folders"]
DATA_PREP_ENTRIES = {"data_prep.prepare", "data_prep.show"}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) for every import statement in the file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:`, which never run: an import a
    type checker alone reads closes no loop."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its text. `from a.b import c` names
    the module a.b.c when there is one, else a.b (a package's `__init__`)."""
    paths = {module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        found = set()
        for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found |= {known(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {known(f"{node.module}.{alias.name}") for alias in node.names}
        graph[name] = found - {None, name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of `graph`: each strongly connected set of two or more modules, sorted."""
    order, low, stack, loops = {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            loop = []
            while not loop or loop[-1] != v:
                loop.append(stack.pop())
            if len(loop) > 1:
                loops.append(sorted(loop))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return loops


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
    module.write_text("import os\n\ndef f():\n    from trainer.loop import fit\n    import heads.parts\n")
    assert imported_packages(module) == [(1, "os"), (4, "trainer"), (5, "heads")]


def test_no_two_modules_import_each_other():
    assert cycles(import_graph()) == []


def test_a_loop_through_a_function_level_import_is_found():
    graph = {"trainer.train": {"trainer.plan"}, "trainer.plan": {"trainer.loop", "trainer.train"},
             "trainer.loop": set(), "conf.schema": set()}
    assert cycles(graph) == [["trainer.plan", "trainer.train"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_for_type_checkers_alone_are_not_followed():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from heads.kinds import K\n"
                     "def f():\n    import trainer.loop\n")
    imported = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
                for n in runtime_nodes(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert imported == ["typing", "trainer.loop"]


def stage_rank(module: str) -> int | None:
    """Where a `data_prep` module stands: 0 a base module at its top, k the k-th stage's modules,
    last the entry points; None outside `data_prep`."""
    parts = module.split(".")
    if parts[0] != "data_prep":
        return None
    if module in DATA_PREP_ENTRIES:
        return len(DATA_PREP_STAGES) + 1
    return DATA_PREP_STAGES.index(parts[1]) + 1 if len(parts) > 1 and parts[1] in DATA_PREP_STAGES else 0


def stage_back_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of `graph` from a `data_prep` module to one that stands later."""
    return [f"{module} imports {name} (a later stage)"
            for module, names in sorted(graph.items()) if stage_rank(module) is not None
            for name in sorted(names) if (stage_rank(name) or 0) > stage_rank(module)]


def test_data_prep_stages_import_only_earlier_stages_and_the_base():
    assert stage_back_imports(import_graph()) == []


def test_every_data_prep_folder_is_a_stage_in_order():
    """A new folder joins the order here, else its modules would count as base modules."""
    folders = {p.parent.name for p in (ROOT / "data_prep").glob("*/__init__.py")}
    assert folders == set(DATA_PREP_STAGES)
    assert {f"data_prep.{p.stem}" for p in (ROOT / "data_prep").glob("*.py")} >= DATA_PREP_ENTRIES


def test_a_planted_back_import_between_stages_is_found():
    """A stage reaching a later one, a base module a stage, a stage an entry point: each is named."""
    graph = import_graph()
    planted = {"data_prep.conversations.rows": "data_prep.answers.regenerate",
               "data_prep.target": "data_prep.states.capture", "data_prep.folders.build": "data_prep.prepare"}
    for module, name in planted.items():
        graph[module] = graph[module] | {name}
    assert stage_back_imports(graph) == [
        "data_prep.conversations.rows imports data_prep.answers.regenerate (a later stage)",
        "data_prep.folders.build imports data_prep.prepare (a later stage)",
        "data_prep.target imports data_prep.states.capture (a later stage)",
    ]
