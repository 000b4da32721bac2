"""turns.py: Turns — which thread owns a :class:`~carpool.client.Client`'s socket.

A zmq socket may be used by one thread at a time. The thread that owns it pumps it for
every thread; the others wait on a condition, in the order they came, and one that must
send wakes the owner through a pipe its poll watches (:mod:`carpool.client.sync`'s
docstring tells the whole arrangement). ``close`` goes before the line; once it has
begun the others give up.
"""

from __future__ import annotations

import threading
from collections import deque

from carpool.common.clock import Clock
from carpool.common.errors import CarpoolError
from carpool.common.wake import WakePipe

__all__ = ["RECHECK_S", "Turns"]

RECHECK_S = 0.05
"""How long a thread waiting for another's socket waits before it looks again (it is
woken sooner when the other lets go); bounds any wake-up lost to a race."""


class Turns:
    """The socket's owner, if any, and the threads waiting for it.

    Re-entrant, both locks: a signal handler (or a ``__del__``) that calls close() or
    submit() runs in whichever thread it interrupts, perhaps the one that holds them.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.own = threading.RLock()  # held by the thread that uses the socket
        self.cond = threading.Condition(threading.RLock())  # threads waiting for it
        self.line: deque[int] = deque()  # idents of the threads waiting, in order
        self.sending: set[int] = set()  # threads waiting to send: a pumper won't block
        self.closing = False  # close() has begun: the others give up
        self.closed = False  # set (under cond) once the client is closed
        self.wake = WakePipe()  # a sender wakes the pumper: its poll watches wake.fd

    @property
    def contended(self) -> bool:
        """Threads wait for the socket, or close() has begun: the owner lets go soon."""
        return bool(self.line) or self.closing

    def _check_open(self) -> None:
        if self.closed:
            raise CarpoolError("the client is closed")

    def take(self, wait_s: float | None, *, send: bool, close: bool = False) -> bool:
        """Own the socket: at once when it is free and no thread waits for it (with one
        thread, all this costs); else in turn, for at most ``wait_s`` (None: as long as
        it takes; False: not owned by then). A thread that waits to send wakes the owner
        if it is blocked in its poll. ``close`` goes before the line; once it has begun,
        a sender raises and a poller gives up after a nap (close answers its futures).

        A signal handler's call runs in whichever thread it interrupts: in the owner it
        goes on at once (before any check that could raise, so that the caller's
        ``let_go`` cannot release the interrupted frame's hold); in a thread waiting in
        line it goes before the line, as close() does (behind its own thread's ticket it
        would wait for ever).

        Raises:
            CarpoolError: the client is closed (or closing, for a sender).
        """
        own = self.own
        if own._is_owned():  # type: ignore[attr-defined]
            own.acquire()  # (re-entrant: a handler in the thread that owns it)
            return True
        if not self.line and not self.closing and own.acquire(False):
            return True
        clock = self.clock
        until_s = None if wait_s is None else clock.now() + wait_s
        me = threading.get_ident()
        with self.cond:
            ahead = close or me in self.line  # (a handler in a waiting thread)
            queued = not ahead
            try:
                if queued:
                    self.line.append(me)
                if send:
                    self.sending.add(me)
                while True:
                    # (Under cond, which close() holds to close the pipe.)
                    self._check_open()
                    left_s = RECHECK_S if until_s is None else until_s - clock.now()
                    if self.closing and not close:
                        if send:
                            raise CarpoolError("the client is closed")
                        if left_s > 0:
                            self.cond.wait(min(left_s, RECHECK_S))
                        return False
                    if (ahead or self.line[0] == me) and own.acquire(False):
                        return True
                    if left_s <= 0:
                        return False
                    if send or close:
                        self.wake.wake()  # the owner, if polling, returns and lets go
                    self.cond.wait(min(left_s, RECHECK_S))
            finally:
                if queued and me in self.line:  # (first: an interrupt must not strand it)
                    head = self.line[0] == me
                    self.line.remove(me)
                    if head and self.line and not own._is_owned():  # type: ignore[attr-defined]
                        self.cond.notify_all()  # it gave up its turn: the next one's
                if send:
                    self.sending.discard(me)

    def let_go(self) -> None:
        """Release the socket if this thread holds it (an exception may have struck
        before the acquire or between it and the ``try``), and wake waiting threads."""
        own = self.own
        if own._is_owned():  # type: ignore[attr-defined]
            own.release()
        if self.line or self.closing:
            self.notify()

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()
