"""The source tree's shape: modules small enough to read as one concern each, and the
``carpool`` command's parser on top of what it runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "carpool"

#: The most lines a module in src/ may have.
MAX_MODULE_LINES = 450


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_the_source_tree_is_found() -> None:
    assert len(_modules()) > 40


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_is_over_the_line_limit(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(SRC)} has {lines} lines"


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, at its top and inside functions alike."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_only_the_entry_point_imports_the_cli() -> None:
    """cli.py imports the commands; none of them imports it back (no cycle through it)."""
    importers = [
        str(path.relative_to(SRC)) for path in _modules() if "carpool.cli" in _imports(path)
    ]
    assert importers == ["__main__.py"]
