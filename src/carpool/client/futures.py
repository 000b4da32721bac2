"""futures.py: ReplyFuture — the pending reply of one request of the blocking Client."""

from __future__ import annotations

from typing import Any, Protocol

from numpy.typing import NDArray

from carpool.client.results import InferResult
from carpool.common.clock import Clock
from carpool.common.errors import CarpoolError, RequestError


class _Owner(Protocol):
    """The client a future belongs to: its clock, its poll for one future, its cancel."""

    clock: Clock

    def _poll(self, timeout_s: float | None, future: ReplyFuture) -> int: ...

    def cancel(self, future: ReplyFuture) -> bool: ...


class ReplyFuture:
    """The pending reply of one request; :meth:`result` waits for it."""

    def __init__(self, client: _Owner, request_id: int) -> None:
        self._client = client
        self.request_id = request_id
        self._result: InferResult | None = None
        self._error: RequestError | None = None

    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def _set(self, outcome: InferResult | RequestError) -> None:
        if isinstance(outcome, RequestError):
            self._error = outcome
        else:
            self._result = outcome

    def result(self, timeout_s: float | None = None) -> InferResult:
        """Wait for the reply (at most ``timeout_s``); raise its typed error if it failed.

        Raises:
            TimeoutError: ``timeout_s`` passed first (the request stays pending).
            RequestError: the request failed (a subclass per error code).
        """
        ready = self._result
        if ready is not None:  # the common case once polled: no clock reads
            return ready
        clock = self._client.clock
        until = None if timeout_s is None else clock.now() + timeout_s
        while not self.done():
            left = None if until is None else until - clock.now()
            if left is not None and left <= 0:
                raise TimeoutError(f"request {self.request_id} still pending")
            try:
                self._client._poll(left, self)
            except CarpoolError:
                if not self.done():
                    raise
                # (Another thread closed the client between done() and poll(): this
                # future was answered then.)
        if self._error is not None:
            raise self._error
        assert self._result is not None  # done() and no error
        return self._result

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
        return self._client.cancel(self)


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
