"""calls.py: what callers of a blocking Client hand its I/O thread.

Each :class:`Call` is answered once, from the I/O thread
(:mod:`carpool.client.iothread`), with a value or an exception; the caller waits on a
lock of the call's own, so a signal handler's call, in the thread whose call it
interrupted, waits on another. A :class:`Cancel` is not waited for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from numpy.typing import ArrayLike

from carpool.client.futures import Owner, ReplyFuture
from carpool.common.protocol import Priority

__all__ = ["Call", "Cancel", "Close", "Query", "Submit"]


class Call:
    """What a caller hands the I/O thread and waits for: answered once, from the I/O
    thread, with a value or an exception. The caller's wait holds a lock of the call's
    own (a signal handler's call, in the same thread, waits on another)."""

    __slots__ = ("_gate", "error", "value")

    def __init__(self) -> None:
        self._gate = threading.Lock()
        self._gate.acquire()
        self.value: Any = None
        self.error: BaseException | None = None

    def answer(self, value: Any = None, error: BaseException | None = None) -> None:
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
    (the client, which it keeps open while the request is pending)."""

    __slots__ = ("frames", "future", "inputs", "model", "owner", "priority", "timeout_s", "until")

    def __init__(
        self,
        owner: Owner,
        model: str,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float | None,
        priority: Priority,
    ) -> None:
        super().__init__()
        self.owner = owner
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
