"""requests.py: a request held by the broker, its lifecycle as data, and the book that
alone moves a request from one state to the next.

Pure: no sockets, threads or clocks.

Lifecycle (h11's ``_state.py`` is the model: the states and the allowed transitions are a
table, and one method applies it)::

    QUEUED ──take──▶ DISPATCHED ──result──▶ DONE
      │  ▲               │
      │  └───requeue─────┤  (its worker was lost; attempts and deadline allow)
      │                  ├──expire / doomed──▶ EXPIRED
      │                  └──failed / lost / stop──▶ FAILED
      ├──expire / shed──▶ EXPIRED
      └──answered from the queue (stop, respec, unservable, cancel)──▶ FAILED

DONE, EXPIRED and FAILED are final: the request has had its one reply.

Rules:
- :meth:`RequestBook.move` (and :meth:`RequestBook.move_all`, the same for a batch's
  requests) is the only writer of ``PendingRequest.state``; a move not in
  :data:`TRANSITIONS` raises :class:`IllegalTransition`.
- A request that reaches a final state drops its payload frames in the same move, so
  answered requests hold no tensor memory.
- The book keeps, per client, the requests it holds (entered and not yet final) and their
  payload bytes: what the door's per-client limits read. A client holding none has no
  entry.
- The book indexes the requests it holds that carry an origin (:data:`Origin`: the
  client's nonce, after its authenticated key under CURVE, and the request id), so that
  a copy sent again (protocol.md §6.1) and a CANCEL (§6.5) find the request. An entry
  leaves when its request reaches a final state, so the index holds no more than the
  queue and in-flight limits let in. :meth:`RequestBook.redirect` points a request's
  answer at the connection a copy came by, and moves its share of the per-client limits
  with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, NewType

from carpool.common.protocol import Frame, Priority, ShmRef

ClientId = NewType("ClientId", bytes)
#: A worker's routing id, as the registry knows it (here, beside the client's, so that
#: the registry's in-flight table can name it without importing the registry).
WorkerId = NewType("WorkerId", bytes)
#: Who sent a request, as a copy of it is known by: (origin, request id), where the origin
#: is the client's nonce (REQUEST ``client``), after its authenticated key under CURVE.
Origin = tuple[bytes, int]
RequestKey = tuple[str, tuple[tuple[str, str, tuple[int, ...]], ...]]


class RequestState(Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    DONE = "done"
    EXPIRED = "expired"
    FAILED = "failed"


_QUEUED, _DISPATCHED, _DONE, _EXPIRED, _FAILED = (
    RequestState.QUEUED,
    RequestState.DISPATCHED,
    RequestState.DONE,
    RequestState.EXPIRED,
    RequestState.FAILED,
)

#: Every allowed (from, to) move of a request, with what makes it.
TRANSITIONS: dict[tuple[RequestState, RequestState], str] = {
    (_QUEUED, _DISPATCHED): "taken into a batch for a worker",
    (_QUEUED, _EXPIRED): "deadline passed, or shed as hopeless, while queued",
    (_QUEUED, _FAILED): "answered from the queue (stopping, respec, unservable, cancelled)",
    (_DISPATCHED, _DONE): "its worker's RESULT answered it",
    (_DISPATCHED, _EXPIRED): "deadline passed in flight, or doomed at dispatch",
    (_DISPATCHED, _FAILED): "its batch failed, its worker was lost, or the broker stopped",
    (_DISPATCHED, _QUEUED): "requeued after its worker was lost",
}

#: States of a request that still waits for its answer.
LIVE = frozenset((_QUEUED, _DISPATCHED))
#: The final states: the request has had its one reply.
FINAL = (_DONE, _EXPIRED, _FAILED)

#: The states a request may move to, by the value of the state it is in: TRANSITIONS
#: indexed for :meth:`RequestBook.move`. Keyed by value and held in tuples, so a move
#: neither hashes the Enum nor compares more than identities.
#: speed: docs/benchmarks.md "Why the hot path looks as it does"
_TARGETS: dict[str, tuple[RequestState, ...]] = {
    state.value: tuple(to for frm, to in TRANSITIONS if frm is state) for state in RequestState
}


class IllegalTransition(RuntimeError):
    """A request was moved along an edge that :data:`TRANSITIONS` does not hold (a bug)."""

    def __init__(self, frm: RequestState, to: RequestState) -> None:
        super().__init__(f"request state {frm.name} -> {to.name} is not a transition")
        self.frm = frm
        self.to = to


@dataclass(slots=True, eq=False)
class PendingRequest:
    """One client request held by the broker. Its ``state`` is the book's to move."""

    seq: int  # broker-wide arrival order, the FIFO tie-break
    client: ClientId
    # The client sent an empty delimiter frame (a REQ socket); replies must carry one too.
    delimited: bool
    request_id: int
    simple: bool
    model: str
    key: RequestKey
    samples: int
    priority: Priority
    arrival_s: float
    deadline_s: float
    payloads: Sequence[Frame]  # in spec order; the key holds their names, dtypes, shapes
    # Per input (spec order), where its bytes are in shared memory (§5.4), or None for
    # an input in its frame; None when all are in frames: BATCH ``requests[i].shm``.
    refs: tuple[ShmRef | None, ...] | None = None
    shm_outputs: bool = False  # BATCH ``requests[i].shm_outputs`` (§5.5)
    nbytes: int = 0  # payload bytes held in its frames (what max_queued_mib counts)
    # Its own item shapes per input (spec order) where they differ from its bucket, the
    # key's: BATCH ``requests[i].shapes`` (§8.3); None: the key's shapes are its own.
    shapes: tuple[tuple[int, ...], ...] | None = None
    origin: Origin | None = None  # sent with a nonce: how a copy or a CANCEL finds it
    state: RequestState = _QUEUED
    attempts: int = 0

    def __lt__(self, other: PendingRequest) -> bool:
        return self.seq < other.seq


#: Called with (from, to) after every move any book makes (tests record coverage).
Observer = Callable[[RequestState, RequestState], None]


def count_in(tally: dict[ClientId, list[int]], client: ClientId, nbytes: int) -> None:
    """One more request, of ``nbytes``, in ``client``'s [requests, bytes] of ``tally``."""
    mine = tally.get(client)
    if mine is None:
        tally[client] = [1, nbytes]
    else:
        mine[0] += 1
        mine[1] += nbytes


def count_out(tally: dict[ClientId, list[int]], client: ClientId, nbytes: int) -> None:
    """One request, of ``nbytes``, fewer in ``client``'s [requests, bytes] of ``tally``
    (its entry goes with its last request)."""
    mine = tally[client]
    if mine[0] <= 1:
        del tally[client]
    else:
        mine[0] -= 1
        mine[1] -= nbytes


class RequestBook:
    """The owner of request state: every move of every request goes through :meth:`move`
    (or :meth:`move_all`, a batch's)."""

    #: Watchers of every book's moves (class-wide: brokers are built inside servers).
    observers: ClassVar[list[Observer]] = []

    def __init__(self) -> None:
        #: Per client: [requests held, their payload bytes], for the requests entered
        #: (:meth:`enter`) that have not reached a final state.
        self.held: dict[ClientId, list[int]] = {}
        #: The requests entered and not yet final that carry an origin, by it.
        self.by_origin: dict[Origin, PendingRequest] = {}
        #: Writes so far (enter, redirect, move): the core's :meth:`changes` reads it.
        self.changes = 0

    def enter(self, req: PendingRequest) -> None:
        """A new request is held for its client until it reaches a final state."""
        self.changes += 1
        mine = self.held.get(req.client)  # (count_in, inlined: speed, docs/benchmarks.md)
        if mine is None:
            self.held[req.client] = [1, req.nbytes]
        else:
            mine[0] += 1
            mine[1] += req.nbytes
        if req.origin is not None:
            self.by_origin[req.origin] = req

    def redirect(self, req: PendingRequest, client: ClientId, delimited: bool) -> None:
        """A copy of ``req`` came by another connection (``client``): the request's one
        answer goes there, and its share of the per-client limits moves there with it."""
        self.changes += 1
        old = req.client
        if old != client:
            held = self.held
            if old in held:  # (absent: a request made without enter, in tests)
                count_out(held, old, req.nbytes)
                count_in(held, client, req.nbytes)
            req.client = client
        req.delimited = delimited

    def move(self, req: PendingRequest, to: RequestState) -> None:
        """Move ``req`` to state ``to``; raise :class:`IllegalTransition` if the table
        has no such edge. With :meth:`move_all`'s, the only assignment to
        ``PendingRequest.state``. A request that reaches a final state drops its payload
        frames now (not at its deadline, when its deadline-heap entry goes)."""
        frm = req.state
        if to not in _TARGETS[frm._value_]:
            raise IllegalTransition(frm, to)
        req.state = to
        self.changes += 1
        if to in FINAL:
            req.payloads = ()
            # (count_out, inlined: speed: docs/benchmarks.md "Why the hot path looks as it does";
            # absent: a request made without enter, in tests)
            mine = self.held.get(req.client)
            if mine is not None:
                if mine[0] <= 1:
                    del self.held[req.client]
                else:
                    mine[0] -= 1
                    mine[1] -= req.nbytes
            if req.origin is not None:
                del self.by_origin[req.origin]
        if self.observers:
            for observe in self.observers:
                observe(frm, to)

    def move_all(
        self, requests: Iterable[PendingRequest], frm: RequestState, to: RequestState
    ) -> None:
        """:meth:`move` each of ``requests`` that is in state ``frm`` to ``to``; the others
        stay as they are. One call for a batch (its RESULT, or the requests of a batch
        that would finish too late); raises :class:`IllegalTransition` if the table has
        no such edge, before any request moves."""
        if to not in _TARGETS[frm._value_]:
            raise IllegalTransition(frm, to)
        final, held, by_origin, observers = to in FINAL, self.held, self.by_origin, self.observers
        moved = 0  # (counted even where a move raises: the core's changes must see it)
        try:
            for req in requests:
                if req.state is not frm:
                    continue
                req.state = to
                moved += 1
                if final:
                    req.payloads = ()
                    mine = held.get(req.client)  # (as move's)
                    if mine is not None:
                        if mine[0] <= 1:
                            del held[req.client]
                        else:
                            mine[0] -= 1
                            mine[1] -= req.nbytes
                    if req.origin is not None:
                        del by_origin[req.origin]
                if observers:
                    for observe in observers:
                        observe(frm, to)
        finally:
            self.changes += moved
