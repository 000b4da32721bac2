"""calls.py: what callers of a blocking Client hand its I/O thread, and the futures it
completes for them.

Each :class:`Call` is answered once, from the I/O thread
(:mod:`carpool.client.iothread`), with a value or an exception; the caller waits on a
lock of the call's own, so a signal handler's call, in the thread whose call it
interrupted, waits on another. A :class:`Cancel` is not waited for. A submitted
request's answer is a :class:`ReplyFuture`, which the I/O thread completes once and any
thread may wait for: each waiting call parks on a lock of its own, which the I/O thread
releases when it completes the future (a waiter that an exception interrupts leaves
nothing held that another waiter needs). No I/O thread crosses ``fork()``: in a child, a
future of its parent's client that is not done raises rather than wait for nobody.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from numpy.typing import ArrayLike, NDArray

from carpool.client.inputs import Encoded
from carpool.client.results import InferResult
from carpool.common.errors import CarpoolError, RequestError
from carpool.common.protocol import Priority

__all__ = [
    "Call",
    "Cancel",
    "Close",
    "Completions",
    "Owner",
    "Query",
    "ReplyFuture",
    "Submit",
    "fail",
]

#: How long ``poll(0)`` waits when nothing completed: it gives up the GIL that long.
_YIELD_S = 1e-6
#: What a parent's client, or its future, says in a ``fork()`` child.
NOT_ACROSS_FORK = "a Client does not cross fork(): open another in the child"
_forks = 0  # fork()s on the way to this process: a client's thread is in its own


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def forks() -> int:
    """How many ``fork()``s lie between the first process and this one."""
    return _forks


class Owner(Protocol):
    """What a future belongs to: its client, which cancels it."""

    def cancel(self, future: ReplyFuture) -> bool: ...


class ReplyFuture:
    """The pending reply of one request; :meth:`result` waits for it."""

    __slots__ = ("_error", "_forks", "_owner", "_result", "_waiters", "request_id")

    def __init__(self, owner: Owner, request_id: int) -> None:
        self._owner = owner
        self._forks = _forks
        self.request_id = request_id
        self._result: InferResult | None = None
        self._error: RequestError | None = None
        self._waiters: list[threading.Lock] = []  # one per waiting call, each held

    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def _set(self, outcome: InferResult | RequestError) -> None:
        """(The I/O thread, once.) Complete the future and wake the calls waiting."""
        if isinstance(outcome, RequestError):
            self._error = outcome
        else:
            self._result = outcome
        for waiter in list(self._waiters):
            waiter.release()

    def result(self, timeout_s: float | None = None) -> InferResult:
        """Wait for the reply (at most ``timeout_s``; None or ``math.inf``: as long as it
        takes); raise its typed error if it failed.

        Raises:
            TimeoutError: ``timeout_s`` passed first (the request stays pending).
            RequestError: the request failed (a subclass per error code).
            CarpoolError: not answered, in a ``fork()`` child of the client's process.
        """
        ready = self._result
        if ready is not None:  # the common case once answered
            return ready
        if not self.done():
            self._wait(timeout_s)
        if self._error is not None:
            raise self._error
        assert self._result is not None  # done() and no error
        return self._result

    def _wait(self, timeout_s: float | None) -> None:
        if self._forks != _forks:  # (its I/O thread is in the parent)
            raise CarpoolError(NOT_ACROSS_FORK)
        waiter = threading.Lock()
        waiter.acquire()
        self._waiters.append(waiter)
        try:
            # (Completed between the look and the append: _set released the waiters it
            # saw, after it set the outcome, so one of the two looks sees it.)
            if self.done():
                return
            if timeout_s is None or timeout_s >= threading.TIMEOUT_MAX:
                waiter.acquire()
            elif timeout_s <= 0 or not waiter.acquire(True, timeout_s):
                raise TimeoutError(f"request {self.request_id} still pending")
        finally:
            self._waiters.remove(waiter)

    def outputs(self, timeout_s: float | None = None) -> dict[str, NDArray[Any]]:
        return self.result(timeout_s).outputs

    def cancel(self) -> bool:
        """Tell the broker this request is no longer needed (CANCEL, protocol §6.5),
        without waiting: a request still queued there is dropped. The future still
        resolves with the request's one answer, which says what became of it:
        :class:`~carpool.common.errors.Cancelled` if it was dropped before a worker had
        it, else its result (or error) as usual. A request waiting in the client to be
        sent again (after a lost connection) is at no broker: it resolves ``Cancelled``
        at once. Returns False if the future was already answered."""
        return self._owner.cancel(self)


def fail(futures: dict[int, ReplyFuture], failed: list[tuple[int, RequestError]]) -> int:
    """Fail the futures (taken out of ``futures``) of requests that the client's core
    settled itself, each with its error; returns how many it completed."""
    completed = 0
    for rid, error in failed:
        future = futures.pop(rid, None)
        if future is not None:
            future._set(error)
            completed += 1
    return completed


class Call:
    """What a caller hands the I/O thread and waits for: answered once, from the I/O
    thread, with a value or an exception. The caller's wait holds a lock of the call's
    own (a signal handler's call, in the same thread, waits on another)."""

    __slots__ = ("_gate", "answered", "error", "value")

    def __init__(self) -> None:
        self._gate = threading.Lock()
        self._gate.acquire()
        self.value: Any = None
        self.error: BaseException | None = None
        self.answered = False

    def answer(self, value: Any = None, error: BaseException | None = None) -> None:
        """(The I/O thread.) The first answer stands; a later one is ignored."""
        if self.answered:
            return
        self.answered = True
        self.value, self.error = value, error
        self._gate.release()

    def wait(self) -> Any:
        """The answer; raises the exception answered."""
        self._gate.acquire()  # (a signal handler's exception interrupts it)
        self._gate.release()
        if self.error is not None:
            raise self.error
        return self.value


class Submit(Call):
    """Send a request; answered with its :class:`ReplyFuture` once the socket took it
    (or it failed), or with what encoding it raised. The future belongs to ``owner``
    (the client, which it keeps open while the request is pending). A request the
    caller ``encoded`` comes with its future, and nobody waits for the answer."""

    __slots__ = (
        "encoded",
        "frames",
        "future",
        "inputs",
        "model",
        "owner",
        "priority",
        "timeout_s",
        "until",
    )

    def __init__(
        self,
        owner: Owner,
        model: str,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float | None,
        priority: Priority,
        encoded: Encoded | None = None,
    ) -> None:
        super().__init__()
        self.owner, self.encoded = owner, encoded
        self.model, self.inputs, self.timeout_s, self.priority = model, inputs, timeout_s, priority
        self.frames: list[Any] = []
        self.future: ReplyFuture | None = None
        self.until = 0.0  # its send window's end


class Query(Call):
    """Send the STATS or METADATA request ``ask`` makes; answered with the broker's
    answer, or ``TimeoutError`` after ``timeout_s``."""

    __slots__ = ("ask", "frames", "qid", "timeout_s", "until")

    def __init__(self, ask: Callable[[], tuple[int, list[Any]]], timeout_s: float) -> None:
        super().__init__()
        self.ask, self.timeout_s = ask, timeout_s
        self.frames: list[Any] = []
        self.qid = 0
        self.until = 0.0


class Close(Call):
    """Close the client: answer every future and call, close the sockets, end the thread."""

    __slots__ = ()


class Cancel:
    """Cancel ``future``'s request (nobody waits for this call's answer)."""

    __slots__ = ("future",)

    def __init__(self, future: ReplyFuture) -> None:
        self.future = future


class Completions:
    """The futures a client's I/O thread completed, for ``Client.poll``: the thread adds
    to the count (:meth:`add`); callers wait for it to grow (:meth:`wait`) and take what
    it grew by (:meth:`look`). Each waiting call parks on a lock of its own, which the
    thread releases: the thread takes no lock a caller could hold (one interrupted by a
    signal handler's exception might keep it)."""

    __slots__ = ("_counts", "_waiters")

    def __init__(self) -> None:
        # What each add() completed, until a look takes it: appends and pops of a deque
        # are atomic, so looks in two threads never count one completion twice.
        self._counts: deque[int] = deque()
        self._waiters: list[threading.Lock] = []

    def add(self, completed: int) -> None:
        """(The I/O thread.) ``completed`` more futures: wake the waiting calls."""
        self._counts.append(completed)
        self.wake()

    def wake(self) -> None:
        """(The I/O thread.) Wake the waiting calls (the client closes, say)."""
        waiters = self._waiters
        while waiters:
            waiters.pop().release()

    def wait(self, timeout_s: float | None, closing: threading.Event) -> None:
        """Wait at most ``timeout_s`` (None: without end) for the count to grow, unless
        it grew since the last look already, or ``closing`` is set."""
        if self._counts or closing.is_set():
            return
        if timeout_s == 0:  # (a wait this short still lets the I/O thread take the GIL,
            timeout_s = _YIELD_S  # which a loop of poll(0) would hold for 5 ms at a time)
        waiter = threading.Lock()
        waiter.acquire()
        self._waiters.append(waiter)
        try:
            # (Grown between the look and the append: add() woke the waiters it saw,
            # after it counted, so one of the two looks sees it.)
            if self._counts or closing.is_set():
                return
            if timeout_s is None or timeout_s >= threading.TIMEOUT_MAX:
                waiter.acquire()
            elif timeout_s > 0:
                waiter.acquire(True, timeout_s)
        finally:
            with contextlib.suppress(ValueError):  # (the thread took it out)
                self._waiters.remove(waiter)

    def look(self) -> int:
        """How much the count grew since the last look."""
        grown = 0
        with contextlib.suppress(IndexError):
            while True:
                grown += self._counts.popleft()
        return grown
