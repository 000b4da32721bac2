"""futures.py: ReplyFuture — the pending reply of one request of the blocking Client.

The client's I/O thread (:mod:`carpool.client.iothread`) completes each future once;
any thread may wait for it. Each waiting call parks on a lock of its own, which the I/O
thread releases when it completes the future (a waiter that an exception interrupts
leaves nothing held that another waiter needs).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from numpy.typing import NDArray

from carpool.client.results import InferResult
from carpool.common.errors import RequestError


class Owner(Protocol):
    """What a future belongs to: its client, which cancels it."""

    def cancel(self, future: ReplyFuture) -> bool: ...


class ReplyFuture:
    """The pending reply of one request; :meth:`result` waits for it."""

    __slots__ = ("_error", "_owner", "_result", "_waiters", "request_id")

    def __init__(self, owner: Owner, request_id: int) -> None:
        self._owner = owner
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


def answer(futures: dict[int, ReplyFuture], failed: list[tuple[int, RequestError]]) -> int:
    """Complete the futures (taken out of ``futures``) of requests that the client's core
    settled itself; returns how many it completed."""
    completed = 0
    for rid, error in failed:
        future = futures.pop(rid, None)
        if future is not None:
            future._set(error)
            completed += 1
    return completed
