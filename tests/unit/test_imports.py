"""The import graph of src/carpool has no cycle.

Every import counts, at a module's top and inside functions alike, since both run; only
imports under ``if TYPE_CHECKING:`` do not, since they never run. A cycle is a strongly
connected component of more than one module (or a module that imports itself).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "carpool"


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under ``node`` that can run: all but ``if TYPE_CHECKING:`` bodies."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children: list[ast.AST] = list(node.orelse)
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from _import_nodes(child)


def _targets(
    node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: set[str]
) -> set[str]:
    """The carpool modules an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        found = {alias.name for alias in node.names}
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join([*base, node.module] if node.module else base)
        else:
            module = node.module or ""
        found = set()
        for alias in node.names:
            submodule = f"{module}.{alias.name}"
            found.add(submodule if submodule in known else module)
    return {target for target in found if target in known}


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Each carpool module and the carpool modules it imports."""
    paths = {_module_name(path, src): path for path in sorted((src / PACKAGE).rglob("*.py"))}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        graph[name] = set()
        for node in _import_nodes(tree):
            graph[name] |= _targets(node, name, is_package, known)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` that hold a cycle (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a deep graph cannot reach the recursion limit.
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 40
    assert "carpool.worker.config" in graph["carpool.worker.repository"]  # at the top
    assert "carpool.worker.notify" in graph["carpool.cli"]  # inside a function


def test_cycles_finds_a_cycle_and_ignores_a_chain() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"a": {"a"}}) == [["a"]]


def test_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from carpool import b\n"
        "def f():\n    from . import c\n"
    )
    (package / "b.py").write_text("from carpool import a\n")
    (package / "c.py").write_text("")
    graph = import_graph(tmp_path)
    assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.c"}
    assert graph[f"{PACKAGE}.b"] == {f"{PACKAGE}.a"}


def test_no_import_cycle_in_src() -> None:
    """No module reaches itself through imports, module-level or function-level."""
    found = cycles(import_graph())
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_command_lines_parser_loads_no_command_it_does_not_run() -> None:
    """Building ``carpool``'s parser (what every ``carpool`` process does first, a broker's
    and ``carpool status``'s alike) imports no client, simulator, load generator, broker
    core or HTTP server: each command loads those when it runs."""
    heavy = (
        "asyncio",
        "carpool.broker.core",
        "carpool.client",
        "carpool.loadgen",
        "carpool.sim.simulator",
        "http.server",
    )
    script = (
        "import sys\nimport carpool.cli\ncarpool.cli.build_parser()\n"
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert found.stdout.strip() == ""
