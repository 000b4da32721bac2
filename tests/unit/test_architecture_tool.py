"""tools/architecture.py measures what it says: each measure on a small case built here
with a known answer (so a measure that goes wrong fails here), and sane figures on the
real broker (not its targets: those are the design's to meet, not this test's)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from carpool.broker.core import BrokerCore

ROOT = Path(__file__).resolve().parents[2]


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "tools_architecture", ROOT / "tools" / "architecture.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while it executes)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


arch = _load_tool()


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "pkg"


# --------------------------------------------------------------------------- imports


def test_the_longest_import_path_follows_every_kind_of_import_but_type_checking(
    tmp_path: Path,
) -> None:
    """A submodule named by ``from pkg import b``, an import inside a function, a
    relative one, a dotted ``import pkg.sub.d`` and ``..e`` from a subpackage are edges;
    the import under ``if TYPE_CHECKING:`` is not (else c -> a would close a cycle)."""
    package = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    from . import c\n",
            "pkg/c.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg import a\n"
                "import pkg.sub.d\n"
            ),
            "pkg/sub/__init__.py": "",
            "pkg/sub/d.py": "from ..e import thing\n",
            "pkg/e.py": "thing = 1\n",
        },
    )
    graph = arch.import_graph(package, "pkg")
    assert graph["pkg.c"] == {"pkg.sub.d"}
    path = arch.longest_path(graph)
    assert path == ["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.e"]
    assert arch.path_length(path) == 5
    assert arch.cycles(graph) == []


def test_a_cycle_is_found_and_counts_all_its_modules_in_the_path(tmp_path: Path) -> None:
    package = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/w.py": "import pkg.x\n",
            "pkg/x.py": "import pkg.y\n",
            "pkg/y.py": "def f():\n    from pkg.x import z\n",
            "pkg/alone.py": "",
        },
    )
    graph = arch.import_graph(package, "pkg")
    assert arch.cycles(graph) == [["pkg.x", "pkg.y"]]
    path = arch.longest_path(graph)
    assert path == ["pkg.w", "{pkg.x, pkg.y}"]
    assert arch.path_length(path) == 3


def test_the_broker_import_path_is_a_chain_of_real_imports() -> None:
    graph = arch.import_graph(arch.package_dir() / "broker", "carpool.broker")
    assert "carpool.broker.core" in graph
    path = arch.longest_path(graph)
    assert arch.path_length(path) >= 2
    for importer, imported in itertools.pairwise(path):
        if "{" not in importer + imported:
            assert imported in graph[importer]


# --------------------------------------------------------------------------- parts


@dataclass(frozen=True)
class Settings:
    limit: int = 1


class Book:
    def __init__(self) -> None:
        self.count = 0

    def add(self) -> None:
        self.count += 1


@dataclass
class Tally:
    book: Book
    seen: int = 0


@dataclass(frozen=True)
class Context:
    book: Book
    settings: Settings


class Intake:
    def __init__(self, book: Book, settings: Settings, snapshot: Any) -> None:
        self._book = book
        self.settings = settings
        self.snapshot = snapshot
        self.count = 0

    def on_client(self, message: bytes) -> int:
        """Three lines, this one included."""
        return len(message)


class Slotted:
    __slots__ = ("context", "notify", "size")

    def __init__(self, context: Context, notify: Any) -> None:
        self.context = context
        self.notify = notify
        self.size = 3


class TangledCore:
    def __init__(self) -> None:
        self.settings = Settings()
        self.book = book = Book()
        self.tally = Tally(book)
        self.intake = Intake(book, self.settings, self.snapshot)
        self.slotted = Slotted(Context(book, self.settings), lambda: book.add())
        self.on_client = self.intake.on_client

    def snapshot(self) -> dict[str, int]:
        return {"count": self.book.count}


class TidyCore:
    def __init__(self) -> None:
        self.settings = Settings()
        self.book = Book()
        self.intake = Intake(Book(), self.settings, len)

    def on_client(self, message: bytes) -> int:
        self.book.add()
        return self.intake.on_client(message)


def test_every_way_a_part_holds_another_is_counted() -> None:
    """Directly, through a method bound to the core, in a slot, in a frozen dataclass's
    field and in a closure; a frozen settings value is not a part."""
    core = TangledCore()
    assert sorted(arch.parts_of(core, __name__)) == ["book", "intake", "slotted", "tally"]
    assert sorted(arch.part_references(core, __name__)) == [
        ("intake._book", "book (Book)"),
        ("intake.snapshot", "TangledCore .snapshot"),
        ("slotted.context.book", "book (Book)"),
        ("slotted.notify<book>", "book (Book)"),
        ("tally.book", "book (Book)"),
    ]


def test_references_are_sorted_into_parts_and_state_objects() -> None:
    """With Book and Tally as state objects: tally's book is state holding state; the
    intake and slotted parts each hold one state object (book, however often); the
    intake's core method is the one reference between parts."""
    core = TangledCore()
    refs = arch.part_references(core, __name__)
    found = arch.classify(core, refs, __name__, frozenset({"Book", "Tally"}))
    assert found["between_parts"] == [("intake.snapshot", "TangledCore .snapshot")]
    assert found["between_state"] == [("tally.book", "book (Book)")]
    assert found["state_of"] == {"intake": ["book"], "slotted": ["book"]}
    # a state object that holds a part, or the core, counts as such a reference too
    found = arch.classify(core, refs, __name__, frozenset({"Book", "Intake", "Tally"}))
    assert found["between_parts"] == [("intake.snapshot", "TangledCore .snapshot")]
    assert found["state_of"] == {"slotted": ["book"]}
    # with no state classes every reference is between parts
    found = arch.classify(core, refs, __name__, frozenset())
    assert len(found["between_parts"]) == len(refs) == 5
    assert found["state_of"] == {"book": [], "intake": [], "slotted": [], "tally": []}


def test_parts_that_hold_only_values_and_their_own_objects_count_nothing() -> None:
    core = TidyCore()
    assert sorted(arch.parts_of(core, __name__)) == ["book", "intake"]
    assert arch.part_references(core, __name__) == []


def test_the_broker_parts_and_their_references_are_found() -> None:
    core = BrokerCore()
    parts = arch.parts_of(core)
    assert len(parts) >= 2
    assert "config" not in parts  # a frozen dataclass: a value
    for where, held in arch.part_references(core):
        assert where.split(".")[0] in parts
        assert held.split(" ")[0] in {*parts, "BrokerCore"}
    # every state class names an object of the core, and some objects are parts
    found = arch.classify(core, arch.part_references(core))
    states = {type(obj).__name__ for name, obj in parts.items() if name not in found["state_of"]}
    assert states == arch.STATE_CLASSES
    assert found["state_of"]


# --------------------------------------------------------------------------- handler


def test_the_handler_is_the_part_method_the_core_binds_or_its_own() -> None:
    lines, where = arch.handler_lines(arch.client_handler(TangledCore()))
    assert (lines, where.endswith("(Intake.on_client)")) == (3, True)
    lines, where = arch.handler_lines(arch.client_handler(TidyCore()))
    assert (lines, where.endswith("(TidyCore.on_client)")) == (3, True)


def test_the_broker_client_handler_is_found_in_the_broker() -> None:
    lines, where = arch.handler_lines(arch.client_handler(BrokerCore()))
    assert lines > 0
    assert where.startswith("src/carpool/broker/")


# --------------------------------------------------------------------------- a request


@pytest.mark.timeout(60)
def test_one_request_touches_files_of_the_client_broker_and_worker() -> None:
    """One recorded round trip (a couple of seconds): its files are carpool's, from each
    of the three, and the profile functions are put back afterwards."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    before = sys.getprofile()
    (files,) = arch.request_files(trials=1, warmup=2)
    assert sys.getprofile() is before
    src = arch.package_dir()
    assert all((src / name).is_file() for name in files)
    assert {name.split("/")[0] for name in files} >= {"client", "broker", "worker", "common"}


def test_the_script_prints_its_figures_as_json_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It measures and never enforces: 0 whether the targets are met or not."""
    assert arch.main(["--json", "--skip-request"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == {
        "broker_import_path",
        "part_references",
        "state_per_part",
        "client_handler_lines",
    }
    for figure in figures.values():
        assert isinstance(figure["value"], int)
        assert isinstance(figure["meets"], bool)
