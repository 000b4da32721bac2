"""The source tree's shape: modules small enough to read as one concern each."""

from __future__ import annotations

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
