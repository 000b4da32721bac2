"""architecture.py: four figures of the broker's shape, each beside its target.

    PYTHONPATH=src python tools/architecture.py [--json] [--verbose] [--skip-request]

It measures the ``carpool`` package the interpreter imports: ``PYTHONPATH`` pointed at
another checkout's ``src`` measures that checkout with this script.

1. **Files one request touches**: the distinct ``src/carpool`` files whose Python
   functions run (``sys.setprofile``, and ``threading.setprofile`` for every thread)
   during one blocking ``Client.infer`` round trip, after a few to warm up, through a
   broker and an ONNX Runtime worker on threads of this process, over real ZeroMQ
   sockets on 127.0.0.1 and a small ONNX model built here with ``onnx.helper``. The
   smallest of ``--trials`` recorded requests is reported (a heartbeat that falls in one
   is not the request's). Target: fewer than 40.
2. **Longest import path in src/carpool/broker**: the longest chain of broker modules
   each importing the next (``ast``: imports at module level and inside functions count,
   those under ``if TYPE_CHECKING:`` do not; ``from carpool.broker import x`` of a
   submodule is an edge to it), counted in modules. Cycles are listed too (a cycle's
   modules count as one link of its length in the path). Target: at most 8.
3. **Attributes of broker parts that hold another part**: in a ``BrokerCore()``, the
   core's objects are those its attributes hold whose class is defined in
   ``carpool.broker`` (frozen dataclasses, enums and exceptions are values). Of them,
   the *state objects* are the owners of the core's state in docs/architecture.md's
   "Who owns what" (:data:`STATE_CLASSES`: the request book, the backlog, the held
   requests, the registry (whose in-flight table is its own), the fleet model, the
   stats); the others
   are *parts*, which act on state they are given. Counted: each attribute of a part
   (its ``__dict__`` or slots) whose value is another part, a method bound to one, the
   core or a method bound to it; a dataclass, container or closure held there is looked
   into one level. Target: 0 outside the core. Also listed: the state objects that hold
   another state object.
3b. **State objects a part holds**: per part, the distinct state objects its attributes
   hold (as above); the figure is the largest. Target: at most 3.
4. **Lines in the client-message handler**: the source lines of the function
   ``BrokerCore.on_client`` runs (a method of the core, or the part's method it is bound
   to), from its ``def`` to its last line. Target: at most 30.

It measures and never enforces: it exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import json
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import CellType, FrameType, FunctionType, MethodType
from typing import Any


def package_dir() -> Path:
    """The ``carpool`` package this interpreter imports (``PYTHONPATH=src``: this
    checkout's; another checkout's ``src`` measures that one)."""
    import carpool

    return Path(carpool.__file__).resolve().parent


BROKER_PACKAGE = "carpool.broker"

#: The classes of the core's state objects: the owners of its state (docs/architecture.md,
#: "Who owns what"). Every other object of the core is a part.
STATE_CLASSES = frozenset(
    {
        "RequestBook",
        "Backlog",
        "HeldRequests",
        "WorkerRegistry",
        "FleetModel",
        "BrokerStats",
    }
)

#: Each figure's target: the comparison and the bound.
TARGETS: dict[str, tuple[str, int]] = {
    "request_files": ("<", 40),
    "broker_import_path": ("<=", 8),
    "part_references": ("==", 0),
    "state_per_part": ("<=", 3),
    "client_handler_lines": ("<=", 30),
}
_MEETS: dict[str, Callable[[int, int], bool]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
}


# --------------------------------------------------------------------------- 2. imports


def module_names(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``package_dir``, by dotted name (a package's
    ``__init__.py`` under the package's own name)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under ``node``, at any depth, except under ``if
    TYPE_CHECKING:`` (its ``else`` branch runs, so it counts)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _type_checking(child.test):
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The module a ``from`` import names, relative imports resolved against ``name``."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(package_dir: Path, package: str) -> dict[str, set[str]]:
    """Each module of the package, with the package's modules it imports."""
    modules = module_names(package_dir, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in _import_nodes(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _absolute(node, name, path.name == "__init__.py")
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            for target in targets:
                # `import a.b.c` loads a.b.c: the deepest of the package's modules it names
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def longest_path(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """The longest chain of imports (importer first), counted in modules. A cycle's
    modules stand as one link that counts all of them (named ``{a, b}``)."""
    component = {node: node for node in graph}
    for members in cycles(graph):
        label = "{" + ", ".join(members) + "}"
        component.update(dict.fromkeys(members, label))
    size = {label: label.count(",") + 1 for label in component.values()}
    succs: dict[str, set[str]] = {label: set() for label in size}
    for node, targets in graph.items():
        for target in targets:
            if component[target] != component[node]:
                succs[component[node]].add(component[target])

    @functools.cache
    def best(label: str) -> tuple[int, tuple[str, ...]]:
        tails = [best(succ) for succ in sorted(succs[label])]
        length, tail = max(tails, default=(0, ()), key=lambda t: t[0])
        return length + size[label], (label, *tail)

    return list(max((best(label) for label in sorted(size)), default=(0, ()))[1])


def path_length(path: list[str]) -> int:
    return sum(link.count(",") + 1 for link in path)


# --------------------------------------------------------------------------- 3. parts


def _is_part_class(cls: type, package: str) -> bool:
    """A class of the package whose instances are parts: not a value (frozen dataclass,
    enum, exception)."""
    if not (cls.__module__ == package or cls.__module__.startswith(package + ".")):
        return False
    if issubclass(cls, enum.Enum | BaseException):
        return False
    params = getattr(cls, "__dataclass_params__", None)
    return not (params is not None and params.frozen)


def attributes(obj: object) -> dict[str, Any]:
    """An object's instance attributes: its ``__dict__`` and the slots of its classes."""
    found = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                found.setdefault(slot, getattr(obj, slot))
    return found


def parts_of(core: object, package: str = BROKER_PACKAGE) -> dict[str, object]:
    """The core's parts, by the name of the core's attribute that holds each (a private
    attribute by its name without the underscore: ``_stats`` is the stats)."""
    return {
        name.lstrip("_"): value
        for name, value in attributes(core).items()
        if _is_part_class(type(value), package) and value is not core
    }


def _inner(value: Any) -> Iterator[tuple[str, Any]]:
    """What a held value holds, one level down: a dataclass's fields, a container's
    items, a partial's function and arguments, a closure's cells."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield f".{field.name}", getattr(value, field.name, None)
    elif isinstance(value, list | tuple | set | frozenset):
        for i, item in enumerate(value):
            yield f"[{i}]", item
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"[{key!r}]", item
    elif isinstance(value, functools.partial):
        yield ".func", value.func
        for i, arg in enumerate(value.args):
            yield f".args[{i}]", arg
    elif isinstance(value, FunctionType) and value.__closure__:
        for var, cell in zip(value.__code__.co_freevars, value.__closure__, strict=True):
            yield f"<{var}>", _contents(cell)


def _contents(cell: CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def part_references(core: object, package: str = BROKER_PACKAGE) -> list[tuple[str, str]]:
    """``(part.attribute, what it holds)`` for each attribute of a part that holds another
    part or the core (or a method bound to one), directly or one level down."""
    parts = parts_of(core, package)
    names = {id(part): f"{name} ({type(part).__name__})" for name, part in parts.items()}
    names[id(core)] = type(core).__name__

    def target(value: Any, owner: object) -> str | None:
        method = ""
        if isinstance(value, MethodType):
            value, method = value.__self__, f" .{value.__func__.__name__}"
        if value is owner or id(value) not in names:
            return None
        return names[id(value)] + method

    found = []
    for name, part in parts.items():
        for attr, value in sorted(attributes(part).items()):
            where = f"{name}.{attr}"
            held = target(value, part)
            if held is not None:
                found.append((where, held))
                continue
            for suffix, inner in _inner(value):
                held = target(inner, part)
                if held is not None:
                    found.append((where + suffix, held))
    return found


def classify(
    core: object,
    refs: list[tuple[str, str]],
    package: str = BROKER_PACKAGE,
    state: frozenset[str] = STATE_CLASSES,
) -> dict[str, Any]:
    """``refs`` (:func:`part_references`) sorted by who holds what: anything holding a part
    or the core (``between_parts``; a state object that did would count too), a part
    holding state objects (``state_of``: the distinct ones per part, every part listed)
    and a state object holding another (``between_state``)."""
    objects = parts_of(core, package)
    is_state = {name: type(obj).__name__ in state for name, obj in objects.items()}
    between_parts, between_state = [], []
    state_of: dict[str, set[str]] = {n: set() for n, s in is_state.items() if not s}
    for where, held in refs:
        holder, target = where.split(".")[0], held.split(" ")[0]
        if not is_state.get(target, False):  # a part, or the core
            between_parts.append((where, held))
        elif is_state[holder]:
            between_state.append((where, held))
        else:
            state_of[holder].add(target)
    return {
        "between_parts": between_parts,
        "between_state": between_state,
        "state_of": {name: sorted(held) for name, held in sorted(state_of.items())},
    }


# --------------------------------------------------------------------------- 4. handler


def client_handler(core: Any) -> Callable[..., Any]:
    """The function a client message runs: the core's ``on_client`` method, or the
    function of the part's method the core binds to that name."""
    handler: Any = inspect.getattr_static(core, "on_client")
    if not callable(handler):  # a property: read it on the instance
        handler = core.on_client
    while isinstance(handler, MethodType | staticmethod | classmethod):
        handler = handler.__func__
    if isinstance(handler, functools.partial):
        handler = handler.func
    return inspect.unwrap(handler)  # type: ignore[no-any-return]


def handler_lines(func: Callable[..., Any]) -> tuple[int, str]:
    lines, first = inspect.getsourcelines(func)
    path = Path(inspect.getsourcefile(func) or "?")
    root = package_dir().parent.parent  # (src/carpool's checkout)
    where = path.relative_to(root) if path.is_relative_to(root) else path
    return len(lines), f"{where}:{first}-{first + len(lines) - 1} ({func.__qualname__})"


# --------------------------------------------------------------------------- 1. request


class Recorder:
    """A profile function that notes the file of each Python call while ``on``; cheap
    while off. Set before any thread starts (``threading.setprofile`` reaches only
    threads started after it)."""

    def __init__(self, root: Path) -> None:
        self.root = str(root) + "/"
        self.on = False
        self.files: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if self.on and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(self.root):
                self.files.add(name[len(self.root) :])

    def __enter__(self) -> Recorder:
        self._before = sys.getprofile(), threading.getprofile()
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.setprofile(self._before[0])
        threading.setprofile(self._before[1])


def _model(folder: Path) -> Path:
    """y = relu(x W): a per-sample ONNX model with a batch dim, 4 inputs, 3 outputs."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    f32 = onnx.TensorProto.FLOAT
    w = np.arange(12, dtype=np.float32).reshape(4, 3) - 5
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", f32, ["batch", 4])],
        [helper.make_tensor_value_info("y", f32, ["batch", 3])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "mm.onnx"
    onnx.save(model, str(path))
    return path


def request_files(trials: int = 3, warmup: int = 5) -> list[list[str]]:
    """The files each of ``trials`` recorded requests touched (sorted, relative to
    src/carpool), each after ``warmup`` unrecorded ones."""
    import numpy as np

    from carpool.broker.config import BrokerConfig
    from carpool.broker.server import BrokerServer
    from carpool.client import Client
    from carpool.common.clock import MonotonicClock
    from carpool.common.testing import ServerThread
    from carpool.worker.engines.ort import OnnxRuntimeEngine
    from carpool.worker.server import WorkerServer

    runs = []
    with tempfile.TemporaryDirectory() as tmp, Recorder(package_dir()) as recorder:
        path = _model(Path(tmp))
        config = BrokerConfig(
            frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", register_grace_s=0.0
        )
        with ServerThread(BrokerServer(config)) as broker:
            worker = WorkerServer(
                broker.backend_endpoint, {"mm": lambda: OnnxRuntimeEngine(path)}, warmup=False
            )
            with ServerThread(worker), Client(broker.frontend_endpoint) as client:
                clock = MonotonicClock()
                until_s = clock.now() + 30.0
                while not client.stats()["workers"]:  # the worker registers
                    if clock.now() > until_s:
                        raise RuntimeError("the worker did not register within 30 s")
                    client.poll(0.02)
                x = np.ones((1, 4), np.float32)
                for _ in range(warmup):
                    client.infer("mm", {"x": x}, timeout_s=30)
                for _ in range(trials):
                    recorder.files = set()
                    recorder.on = True
                    client.infer("mm", {"x": x}, timeout_s=30)
                    recorder.on = False
                    if not recorder.files:
                        raise RuntimeError(f"no call recorded under {package_dir()}")
                    runs.append(sorted(recorder.files))
                    for _ in range(2):
                        client.infer("mm", {"x": x}, timeout_s=30)
    return runs


# --------------------------------------------------------------------------- report


def measure(*, request: bool = True, trials: int = 3) -> dict[str, Any]:
    from carpool.broker.core import BrokerCore

    graph = import_graph(package_dir() / "broker", BROKER_PACKAGE)
    path = longest_path(graph)
    core = BrokerCore()
    refs = part_references(core)
    sorted_refs = classify(core, refs)
    state_of = sorted_refs["state_of"]
    lines, where = handler_lines(client_handler(core))
    figures: dict[str, Any] = {
        "broker_import_path": {
            "value": path_length(path),
            "path": path,
            "cycles": cycles(graph),
            "modules": len(graph),
        },
        "part_references": {
            "value": len(sorted_refs["between_parts"]),
            "parts": sorted(state_of),
            "state_objects": sorted(set(parts_of(core)) - set(state_of)),
            "references": [f"{w} -> {h}" for w, h in sorted_refs["between_parts"]],
            "between_state": [f"{w} -> {h}" for w, h in sorted_refs["between_state"]],
        },
        "state_per_part": {
            "value": max((len(held) for held in state_of.values()), default=0),
            "state_of": state_of,
        },
        "client_handler_lines": {"value": lines, "function": where},
    }
    if request:
        runs = request_files(trials)
        files = min(runs, key=len)
        figures["request_files"] = {
            "value": len(files),
            "trials": [len(run) for run in runs],
            "files": files,
        }
    for name, figure in figures.items():
        op, bound = TARGETS[name]
        figure["target"] = f"{op} {bound}"
        figure["meets"] = _MEETS[op](figure["value"], bound)
    return figures


def _print(figures: Mapping[str, Any], verbose: bool) -> None:
    titles = {
        "request_files": "files one request touches",
        "broker_import_path": "longest import path in src/carpool/broker (modules)",
        "part_references": "attributes of broker parts that hold another part",
        "state_per_part": "state objects a broker part holds, at most",
        "client_handler_lines": "lines in the client-message handler",
    }
    for name in TARGETS:
        if name not in figures:
            continue
        figure = figures[name]
        verdict = "meets" if figure["meets"] else "misses"
        print(f"{titles[name]}: {figure['value']}  ({verdict} the target {figure['target']})")
        if name == "request_files":
            print(f"  recorded requests: {figure['trials']} files (the smallest is reported)")
            if verbose:
                print("".join(f"    {f}\n" for f in figure["files"]), end="")
        elif name == "broker_import_path":
            print("  " + " -> ".join(p.removeprefix(BROKER_PACKAGE + ".") for p in figure["path"]))
            print(f"  cycles: {figure['cycles'] or 'none'}")
        elif name == "part_references":
            print(f"  parts: {', '.join(figure['parts'])}")
            print(f"  state objects: {', '.join(figure['state_objects'])}")
            print("".join(f"    {ref}\n" for ref in figure["references"]), end="")
            print("  state objects that hold another:")
            print("".join(f"    {ref}\n" for ref in figure["between_state"]), end="")
        elif name == "state_per_part":
            for part, held in figure["state_of"].items():
                print(f"    {part} ({len(held)}): {', '.join(held)}")
        else:
            print(f"  {figure['function']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--verbose", action="store_true", help="list the request's files")
    parser.add_argument(
        "--skip-request", action="store_true", help="leave out figure 1 (the slow one)"
    )
    parser.add_argument("--trials", type=int, default=3, help="requests recorded (figure 1)")
    args = parser.parse_args(argv)
    figures = measure(request=not args.skip_request, trials=args.trials)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        _print(figures, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
