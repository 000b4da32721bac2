"""surface.py: which tensorrt attributes a module's source uses, found with ``ast``.

Every name bound to the tensorrt module (``import tensorrt as trt``) is followed through
the code: ``trt.X`` is a module member; ``trt.C(...)`` an instance of class ``C``; a
method call or property of a known class has the class its pybind11 signature returns
(recorded in the member lists, tests/data/tensorrt/); local names and ``self``
attributes keep the type of what was assigned to them, and the parameters of a function
or class of the module (its ``__init__``'s) the types of the arguments it is called with.
Each attribute read or written on
such a value is a :class:`Use`. A use on a value derived from tensorrt whose class cannot
be told is a use of class ``?``, so the check can say so instead of passing it by. A
class defined on a tensorrt base uses the base's member for each public method it
defines (IProgressMonitor's callbacks, IOutputAllocator's). A use inside
``if hasattr(E, "name"):`` of ``E.name`` is guarded: it need exist in one release only.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

MODULE = "<module>"
UNKNOWN = "?"


@dataclass(frozen=True)
class Use:
    cls: str  # MODULE, a class name, or UNKNOWN
    attr: str
    line: int
    guarded: bool


def _guards(test: ast.expr) -> Iterator[tuple[str, str]]:
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        for value in test.values:
            yield from _guards(value)
    elif (
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Name)
        and test.func.id == "hasattr"
        and len(test.args) == 2
        and isinstance(test.args[1], ast.Constant)
        and isinstance(test.args[1].value, str)
    ):
        yield ast.dump(test.args[0]), test.args[1].value


class _Walker:
    def __init__(self, members: Mapping[str, Mapping[str, Any]]) -> None:
        self.members = members  # class -> member -> returned class (union of the releases)
        self.aliases: set[str] = set()
        self.fields: dict[str, dict[str, str]] = {}  # class -> self attribute -> type
        self.signatures: dict[str, list[str]] = {}  # module function/class -> its parameters
        self.params: dict[str, dict[str, str]] = {}  # function/class -> parameter -> type
        self.uses: list[Use] = []
        self.record = False

    # -- types: "module", "class:C" (the class object), "C" (an instance), UNKNOWN, None
    def member(self, owner: str, attr: str) -> str:
        if owner == "module":
            if attr in self.members and attr != MODULE:
                return f"class:{attr}"
            returned = self.members[MODULE].get(attr)
        else:
            returned = self.members.get(owner.removeprefix("class:"), {}).get(attr)
        return returned or UNKNOWN

    def typeof(self, node: ast.expr, env: dict[str, str], cls: str | None, guards) -> str | None:
        if isinstance(node, ast.Name):
            return "module" if node.id in self.aliases else env.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and cls:
                return self.fields.get(cls, {}).get(node.attr)
            owner = self.typeof(node.value, env, cls, guards)
            if owner is None:
                return None
            name = MODULE if owner == "module" else owner.removeprefix("class:")
            if self.record:
                guarded = (ast.dump(node.value), node.attr) in guards
                self.uses.append(Use(name, node.attr, node.lineno, guarded))
            return UNKNOWN if owner == UNKNOWN else self.member(owner, node.attr)
        if isinstance(node, ast.Call):
            given = [self.typeof(arg, env, cls, guards) for arg in node.args]
            named = {k.arg: self.typeof(k.value, env, cls, guards) for k in node.keywords}
            if isinstance(node.func, ast.Name) and node.func.id in self.signatures:
                params = self.params.setdefault(node.func.id, {})
                pairs = [*zip(self.signatures[node.func.id], given, strict=False), *named.items()]
                params.update({p: kind for p, kind in pairs if p is not None and kind})
            called = self.typeof(node.func, env, cls, guards)
            if called is None:
                return None
            return called.removeprefix("class:")
        for child in ast.iter_child_nodes(node):  # (a comprehension's parts are not exprs)
            parts = [child] if isinstance(child, ast.expr) else ast.iter_child_nodes(child)
            for part in parts:
                if isinstance(part, ast.expr):
                    self.typeof(part, env, cls, guards)
        return None

    def assign(self, target: ast.expr, kind: str | None, env, cls: str | None, guards) -> None:
        if isinstance(target, ast.Name):
            if kind is not None:
                env[target.id] = kind
        elif isinstance(target, ast.Attribute):
            if isinstance(target.value, ast.Name) and target.value.id == "self" and cls:
                if kind is not None:
                    self.fields.setdefault(cls, {})[target.attr] = kind
            else:
                self.typeof(target, env, cls, guards)

    def body(self, stmts: list[ast.stmt], env: dict[str, str], cls: str | None, guards) -> None:
        for stmt in stmts:
            self.stmt(stmt, env, cls, guards)

    def stmt(self, stmt: ast.stmt, env: dict[str, str], cls: str | None, guards) -> None:
        if isinstance(stmt, ast.Import):
            self.aliases |= {a.asname or a.name for a in stmt.names if a.name == "tensorrt"}
        elif isinstance(stmt, ast.ClassDef):
            bases = [self.typeof(b, env, cls, guards) for b in stmt.bases]
            for base in (b for b in bases if b and b.startswith("class:")):
                methods = [m for m in stmt.body if isinstance(m, ast.FunctionDef)]
                for item in methods:  # (a private helper is no override)
                    private = item.name.startswith("_") and not item.name.startswith("__")
                    if self.record and not private:
                        name = base.removeprefix("class:")
                        self.uses.append(Use(name, item.name, item.lineno, False))
            self.body(stmt.body, dict(env), stmt.name, guards)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            # A module function's parameters, or its class's __init__'s, typed by its calls.
            owner = cls if stmt.name == "__init__" else None if cls else stmt.name
            self.body(stmt.body, {**env, **self.params.get(owner or "", {})}, cls, guards)
        elif isinstance(stmt, ast.Assign):
            value = stmt.value
            tuples = [t for t in stmt.targets if isinstance(t, ast.Tuple)]
            if (
                isinstance(value, ast.Tuple)
                and len(tuples) == len(stmt.targets)
                and all(len(t.elts) == len(value.elts) for t in tuples)
            ):  # a, b = x, y: each name the type of its value
                kinds = [self.typeof(v, env, cls, guards) for v in value.elts]
                for each in tuples:
                    for element, kind in zip(each.elts, kinds, strict=True):
                        self.assign(element, kind, env, cls, guards)
                return
            kind = self.typeof(value, env, cls, guards)
            for target in stmt.targets:
                self.assign(target, kind, env, cls, guards)
        elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
            kind = self.typeof(stmt.value, env, cls, guards) if stmt.value else None
            self.assign(stmt.target, kind, env, cls, guards)
        elif isinstance(stmt, ast.If):
            self.typeof(stmt.test, env, cls, guards)
            self.body(stmt.body, env, cls, guards | set(_guards(stmt.test)))
            self.body(stmt.orelse, env, cls, guards)
        else:  # (with items and except handlers hold exprs and stmts a level down)
            for child in ast.iter_child_nodes(stmt):
                parts = [child] if isinstance(child, ast.expr | ast.stmt) else []
                for part in parts or ast.iter_child_nodes(child):
                    if isinstance(part, ast.expr):
                        self.typeof(part, env, cls, guards)
                    elif isinstance(part, ast.stmt):
                        self.stmt(part, env, cls, guards)


def uses(source: str, members: Mapping[str, Mapping[str, Any]]) -> list[Use]:
    """Every use of a tensorrt attribute in ``source`` (``members``: class -> member ->
    the class it returns, over the releases checked)."""
    tree = ast.parse(source)
    walker = _Walker(members)
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef):
            walker.signatures[stmt.name] = [a.arg for a in stmt.args.args]
        elif isinstance(stmt, ast.ClassDef):
            for item in stmt.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    walker.signatures[stmt.name] = [a.arg for a in item.args.args[1:]]
    # The first passes learn the types of self attributes and parameters (a class may be
    # called before its definition); the last records the uses.
    for record in (False, False, True):
        walker.record = record
        walker.body(tree.body, {}, None, frozenset())
    return walker.uses


def merged(*listings: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The member lists of several releases as one (a member's class: the first given)."""
    out: dict[str, dict[str, Any]] = {}
    for listing in listings:
        for cls, names in listing.items():
            below = out.setdefault(cls, {})
            for name, returned in names.items():
                below[name] = below.get(name) or returned
    return out
