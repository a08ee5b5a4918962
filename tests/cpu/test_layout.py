"""The package layout rule of docs/design.md ("Layout of an op family"): no import cycle inside
``paddle_fa4``, planners that import neither the CuTe glue nor the reference, the old module paths
gone, and a ``dir(paddle_fa4)`` that lists the API only.

The import graph is read from the source with ``ast``: every ``import`` / ``from ... import`` anywhere
in a module (module level and inside functions, so lazy imports count) and every string constant
that is exactly a module name of the package (``importlib.import_module(_GLUE_MODULE)``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "paddle_fa4"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def _modules() -> dict:
    """module name -> source path of every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """Absolute name of ``from <level dots><target>`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph(modules: dict | None = None) -> dict:
    """module -> set of package modules it imports (at any level of its code)."""
    modules = _modules() if modules is None else modules
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()

        def add(target: str) -> None:
            # the deepest package module named by ``target`` (``a.b.c`` -> ``a.b`` if c is a function)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != PACKAGE:
                edges.add(target)

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(sub if sub in modules else base)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
                add(node.value)
        graph[name] = edges
    return graph


def find_cycle(graph: dict) -> list | None:
    """One cycle ``[m0, m1, ..., m0]`` of ``graph``, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in paddle_fa4: " + " -> ".join(cycle)


def test_cycle_finder_sees_lazy_and_string_imports(tmp_path):
    """The graph builder catches a cycle made of a function-level import and a module-name string."""
    pkg = tmp_path / PACKAGE
    (pkg / "_cute").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_cute" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from ._cute.b import g\n")
    (pkg / "_cute" / "b.py").write_text("import importlib\nM = 'paddle_fa4.a'\n")
    (pkg / "c.py").write_text("from . import a\n")
    modules = {"paddle_fa4": pkg / "__init__.py", "paddle_fa4._cute": pkg / "_cute" / "__init__.py",
               "paddle_fa4.a": pkg / "a.py", "paddle_fa4._cute.b": pkg / "_cute" / "b.py",
               "paddle_fa4.c": pkg / "c.py"}
    graph = import_graph(modules)
    assert graph["paddle_fa4.a"] == {"paddle_fa4._cute.b"}
    assert graph["paddle_fa4.c"] == {"paddle_fa4.a"}
    assert find_cycle(graph) == ["paddle_fa4._cute.b", "paddle_fa4.a", "paddle_fa4._cute.b"]
    (pkg / "_cute" / "b.py").write_text("X = 1\n")
    assert find_cycle(import_graph(modules)) is None


def test_planners_import_neither_glue_nor_reference():
    graph = import_graph()
    planners = [m for m in graph if m.startswith(f"{PACKAGE}._plan.")]
    assert planners, "no planner modules found"
    for m in planners:
        bad = sorted(t for t in graph[m] if t.startswith((f"{PACKAGE}._cute", f"{PACKAGE}.reference")))
        assert not bad, f"{m} imports {bad}"


def test_lower_layers_do_not_import_upwards():
    """Glue, reference and planner never import their public module; the reference never the glue."""
    graph = import_graph()
    for m, targets in graph.items():
        parts = m.split(".")
        if len(parts) == 3 and parts[1] in ("_cute", "reference", "_plan"):
            assert f"{PACKAGE}.{parts[2]}" not in targets, f"{m} imports its public module"
            if parts[1] == "reference":
                assert not any(t.startswith(f"{PACKAGE}._cute") for t in targets), f"{m} imports the CuTe glue"


def test_family_modules_follow_the_layout():
    """Every CuTe glue / reference / planner module has a public op module of the same family."""
    modules = _modules()
    for sub in ("_cute", "reference", "_plan"):
        for m in modules:
            if m.startswith(f"{PACKAGE}.{sub}."):
                family = m.rsplit(".", 1)[1]
                assert f"{PACKAGE}.{family}" in modules, f"{m} has no public module {PACKAGE}.{family}"
    for old in ("block_sparse_cute", "block_sparse_ref", "block_sparse_planner", "indexed_plan"):
        assert f"{PACKAGE}.{old}" not in modules, f"{PACKAGE}.{old} breaks the layout rule"


def test_dir_lists_the_api_only():
    import paddle_fa4

    names = set(dir(paddle_fa4))
    public = {n for n in names if not n.startswith("_")}
    assert public == set(paddle_fa4.__all__), sorted(public ^ set(paddle_fa4.__all__))
    for name in paddle_fa4.__all__:
        getattr(paddle_fa4, name)
    assert set(dir(paddle_fa4)) == names  # loading the names adds nothing to dir()
    assert "__version__" in names


@pytest.mark.parametrize("name,module", [
    ("indexed_attention_plan", "paddle_fa4.indexed"), ("IndexedAttentionPlan", "paddle_fa4._plan.indexed"),
    ("block_sparse_plan", "paddle_fa4.block_sparse"), ("BlockSparsePlan", "paddle_fa4._plan.block_sparse"),
])
def test_plan_names_stay_public(name, module):
    import importlib

    import paddle_fa4

    assert getattr(paddle_fa4, name) is getattr(importlib.import_module(module), name)
