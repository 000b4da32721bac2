"""requests.py: the request lifecycle table, and the book that is its only writer."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from carpool.broker.requests import (
    FINAL,
    LIVE,
    TRANSITIONS,
    IllegalTransition,
    PendingRequest,
    RequestBook,
    RequestState,
)
from tests.unit.broker.pending import pending_request

SRC = Path(__file__).resolve().parents[3] / "src"
Q, D = RequestState.QUEUED, RequestState.DISPATCHED

#: A way to bring a new request to each state along the table's own edges.
PATHS: dict[RequestState, tuple[RequestState, ...]] = {
    Q: (),
    D: (D,),
    RequestState.DONE: (D, RequestState.DONE),
    RequestState.EXPIRED: (RequestState.EXPIRED,),
    RequestState.FAILED: (RequestState.FAILED,),
}


#: Every (from, to) pair of states, as a test's parameters.
EVERY_PAIR = pytest.mark.parametrize(
    ("frm", "to"),
    list(itertools.product(RequestState, RequestState)),
    ids=lambda s: s.name,
)


def request(seq: int = 1) -> PendingRequest:
    return pending_request(seq, deadline_s=1.0)


@pytest.fixture
def book(monkeypatch: pytest.MonkeyPatch) -> RequestBook:
    """A book whose moves the suite-wide transition record does not see: these tests make
    every pair on purpose, and would otherwise count as the broker using each row."""
    monkeypatch.setattr(RequestBook, "observers", [])
    return RequestBook()


def test_every_state_is_reachable_and_only_queued_and_dispatched_are_live() -> None:
    assert set(PATHS) == set(RequestState)
    assert {Q, D} == LIVE
    assert set(FINAL) == set(RequestState) - LIVE
    finals = {s for s in RequestState if not any(frm is s for frm, _ in TRANSITIONS)}
    assert finals == {RequestState.DONE, RequestState.EXPIRED, RequestState.FAILED}


@EVERY_PAIR
def test_the_book_walks_the_whole_table(
    book: RequestBook, frm: RequestState, to: RequestState
) -> None:
    """Every (from, to) pair: a row of the table moves the request, any other raises and
    leaves it where it was."""
    req = request()
    for state in PATHS[frm]:
        book.move(req, state)
    assert req.state is frm
    if (frm, to) in TRANSITIONS:
        book.move(req, to)
        assert req.state is to
        assert len(req.payloads) == (0 if to in FINAL else 1)  # answered: no tensors held
    else:
        with pytest.raises(IllegalTransition) as raised:
            book.move(req, to)
        assert (raised.value.frm, raised.value.to) == (frm, to)
        assert req.state is frm


def test_a_refused_move_changes_nothing(book: RequestBook) -> None:
    req = request()
    with pytest.raises(IllegalTransition):
        book.move(req, RequestState.DONE)  # not from QUEUED
    assert (req.state, len(req.payloads)) == (Q, 1)


def test_observers_see_each_move_after_it_is_made(book: RequestBook) -> None:
    seen: list[tuple[RequestState, RequestState]] = []
    RequestBook.observers.append(lambda frm, to: seen.append((frm, to)))
    req = request()
    book.move(req, D)
    book.move(req, Q)
    with pytest.raises(IllegalTransition):
        book.move(req, RequestState.DONE)
    assert seen == [(Q, D), (D, Q)]


# --------------------------------------------------------------------------- one writer


def _state_writes(tree: ast.AST) -> list[tuple[ast.AST, str | None]]:
    """Each write of an attribute named ``state`` (assignment, augmented or annotated,
    tuple targets, setattr), with the enclosing ``Class.method`` it is in."""
    found: list[tuple[ast.AST, str | None]] = []

    def targets(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            return list(node.targets)
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        return []

    def flat(target: ast.expr) -> list[ast.expr]:
        if isinstance(target, (ast.Tuple, ast.List)):
            return [t for e in target.elts for t in flat(e)]
        if isinstance(target, ast.Starred):
            return flat(target.value)
        return [target]

    def visit(node: ast.AST, where: str | None, cls: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, where, child.name)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{cls}.{child.name}" if cls else child.name, cls)
                continue
            for target in (t for t0 in targets(child) for t in flat(t0)):
                if isinstance(target, ast.Attribute) and target.attr == "state":
                    found.append((target, where))
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, (ast.Name, ast.Attribute))
                and (child.func.id if isinstance(child.func, ast.Name) else child.func.attr)
                in ("setattr", "__setattr__")
                and any(isinstance(a, ast.Constant) and a.value == "state" for a in child.args)
            ):
                found.append((child, where))
            visit(child, where, cls)

    visit(tree, None, None)
    return found


def test_only_the_book_writes_a_request_state() -> None:
    """Across the broker (where requests live), the one write of a ``state`` attribute
    of another object (a request) is in RequestBook.move; objects that set their own
    ``self.state`` hold their own lifecycles, and PendingRequest sets none of its own.
    (Elsewhere ``state`` is other things': the worker core's, the clients', the
    supervisor's slots'.)"""
    writers: list[str] = []
    for path in sorted((SRC / "carpool" / "broker").rglob("*.py")):
        for node, where in _state_writes(ast.parse(path.read_text(), str(path))):
            own = (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and where is not None
                and not where.startswith("PendingRequest.")
            )
            if not own:
                writers.append(f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')} {where}")
    move, move_all = _move_lines()
    assert writers == [
        f"carpool/broker/requests.py:{move} RequestBook.move",
        f"carpool/broker/requests.py:{move_all} RequestBook.move_all",
    ]


def _move_lines() -> list[int]:
    source = (SRC / "carpool/broker/requests.py").read_text()
    return [i for i, text in enumerate(source.splitlines(), 1) if "req.state = to" in text]


@EVERY_PAIR
def test_move_all_moves_a_batch_as_move_moves_each(
    book: RequestBook, frm: RequestState, to: RequestState
) -> None:
    """For every pair: the requests in ``frm`` move as :meth:`move` moves them (the
    book's per-client counts and origin index too), the others stay; a pair the table
    lacks raises before anything moves."""
    one_by_one = RequestBook()
    batch, alone = [request(seq) for seq in (1, 2, 3)], [request(seq) for seq in (1, 2, 3)]
    for i, (r, s) in enumerate(zip(batch, alone, strict=True)):
        for req, owner in ((r, book), (s, one_by_one)):
            req.origin = (b"nonce", i)
            owner.enter(req)
            for state in PATHS[frm] if i != 1 else PATHS[Q if frm is not Q else D]:
                owner.move(req, state)
    if (frm, to) not in TRANSITIONS:
        with pytest.raises(IllegalTransition):
            book.move_all(batch, frm, to)
        assert [r.state for r in batch] == [s.state for s in alone]
        return
    seen: list[tuple[RequestState, RequestState]] = []
    RequestBook.observers.append(lambda a, b: seen.append((a, b)))
    changes = book.changes, one_by_one.changes
    book.move_all(batch, frm, to)
    seen_all, seen[:] = list(seen), []
    for s in alone:
        if s.state is frm:
            one_by_one.move(s, to)
    assert seen_all == seen  # observers see the same moves
    assert book.changes - changes[0] == one_by_one.changes - changes[1]
    assert [(r.state, len(r.payloads)) for r in batch] == [
        (s.state, len(s.payloads)) for s in alone
    ]
    assert book.held == one_by_one.held
    assert book.by_origin.keys() == one_by_one.by_origin.keys()


def test_the_writer_check_sees_the_forms_of_a_write() -> None:
    """The check above is only as good as what it finds: every form of a write is seen."""
    tree = ast.parse(
        "req.state = 1\n"
        "a, (b.state, c) = 1, (2, 3)\n"
        "req.state: int = 1\n"
        "req.state += 1\n"
        "setattr(req, 'state', 1)\n"
        "object.__setattr__(req, 'state', 1)\n"
        "class K:\n"
        "    def m(self):\n"
        "        self.state = 1\n"
    )
    found = _state_writes(tree)
    assert len(found) == 7
    assert found[-1][1] == "K.m"
