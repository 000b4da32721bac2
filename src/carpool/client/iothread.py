"""iothread.py: IOThread — the one thread that owns a blocking Client's sockets and core.

Each :class:`~carpool.client.Client` starts one in its constructor: a daemon thread named
``carpool-client-io-N``, joined by ``close()``. It alone uses the client's zmq sockets
(libzmq lets one thread at a time use a socket) and changes its
:class:`~carpool.client.core.ClientCore`, the one place of protocol state (callers only
encode with it: :meth:`ClientCore.encode` reads settings and draws an id). Callers, in
any thread or a signal handler, hand it a :class:`~carpool.client.calls.Call` through a
deque and wake it through a :class:`~carpool.common.wake.WakePipe` that its poll watches
beside the sockets; it answers each call once, and completes the futures.

Sockets are held per broker, a :class:`Link` each, which the loop iterates (one today:
the DEALER, and the one retiring after a stopping broker's ``retry``). Each turn reads,
fails what expired, follows the core to a new socket, takes the calls, and sends: the
core's messages, then the calls' in order; one the socket has no room for waits (POLLOUT)
until its send window passes. A parent's Client refuses calls in a ``fork()`` child.
"""

from __future__ import annotations

import itertools
import logging
import math
import signal
import threading
import weakref
from collections import deque
from typing import Any

import zmq

from carpool.client import calls
from carpool.client.calls import Call, Cancel, Close, Completions, Query, ReplyFuture, Submit, fail
from carpool.client.core import ClientCore
from carpool.client.shell import Dealer, close_core
from carpool.common.clock import Clock
from carpool.common.curve import ClientKeys
from carpool.common.errors import Cancelled, CarpoolError, ProtocolError, RequestError, Unavailable
from carpool.common.sockets import NOBLOCK, send_frames, waiting
from carpool.common.wake import WakePipe

__all__ = ["IOThread", "Link"]

logger = logging.getLogger(__name__)

_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_CLOSED = "the client is closed"
_NOT_TAKING = "the broker is not taking requests"
_UNSENT = "cancelled before it was sent"
_NAMES = itertools.count(1)


class Link:
    """One broker's :class:`Dealer`, its current socket's poll events, what waits for it."""

    __slots__ = ("dealer", "events", "full", "unsent")

    def __init__(self, dealer: Dealer[zmq.Socket[bytes]]) -> None:
        self.dealer = dealer
        self.events = _POLLIN
        self.unsent: deque[Submit | Query] = deque()
        self.full = False  # its last send found no room, none taken since


class IOThread:
    """The thread that owns a blocking client's core and sockets (module docstring).
    Callers use the methods up to :meth:`join`; the rest runs in the thread."""

    def __init__(
        self,
        core: ClientCore,
        clock: Clock,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        *,
        own_context: bool,
        keys: ClientKeys | None,
    ) -> None:
        self.core, self.clock = core, clock
        self._wake = WakePipe()
        weakref.finalize(self, self._wake.close)  # once no caller can wake it any more
        self.links = [Link(Dealer(self, context, endpoint, own_context=own_context, keys=keys))]
        self._poller = zmq.Poller()
        self._poller.register(self._wake.fd, zmq.POLLIN)
        for link in self.links:
            self._watch(link)
        self._calls: deque[Call | Cancel] = deque()  # handed, not yet taken
        self.futures: dict[int, ReplyFuture] = {}  # by request id: sent, not answered
        self._queries: dict[int, Query] = {}  # by query id: sent, not answered
        self._closers: list[Close] = []
        self._closing = threading.Event()  # set once, by the thread, as it begins to close
        self.completions = Completions()  # for poll()
        self._forks = calls.forks()
        self._polling = False  # the thread is in (or about to enter) its poll
        self.thread = threading.Thread(
            target=self._run, name=f"carpool-client-io-{next(_NAMES)}", daemon=True
        )
        self.thread.start()

    @property
    def closed(self) -> bool:
        """The thread has begun to close (it takes no more calls)."""
        return self._closing.is_set()

    def hand(self, call: Call | Cancel) -> None:
        """Give the thread ``call`` (from any thread, a signal handler's too). Raises
        CarpoolError if the client is closed (the call not taken), or in a forked child."""
        if self._forks != calls.forks():
            raise CarpoolError(calls.NOT_ACROSS_FORK)
        if self.closed:
            raise CarpoolError(_CLOSED)
        self._calls.append(call)
        if self._closing.is_set():  # closing meanwhile: it took the call, or never will
            try:
                self._calls.remove(call)
            except ValueError:
                return  # taken: it answers it
            raise CarpoolError(_CLOSED)
        if self._polling:  # (else it looks at the calls before it polls next)
            self._wake.wake()

    def backlogged(self) -> bool:
        """A socket has no room (its last send found none), or messages wait for it."""
        return any(link.full or link.unsent for link in self.links)

    def cancel(self, future: ReplyFuture) -> bool:
        """Cancel ``future``'s request without waiting (:meth:`ReplyFuture.cancel`).
        False: answered already, or not this client's, or the client is closed."""
        if future.done() or self.futures.get(future.request_id) is not future:
            return False
        try:
            self.hand(Cancel(future))
        except CarpoolError:
            return False  # closed meanwhile: the close answered the future
        return True

    def wait_completed(self, timeout_s: float | None) -> int:
        """The futures completed since the last look (any thread's), waiting up to
        ``timeout_s`` (None: without end) for one; CarpoolError once the client closed,
        or in a forked child (no thread completes them there)."""
        if self._forks != calls.forks():
            raise CarpoolError(calls.NOT_ACROSS_FORK)
        self.completions.wait(timeout_s, self._closing)
        completed = self.completions.look()
        if not completed and self.closed:
            raise CarpoolError(_CLOSED)
        return completed

    def join(self) -> None:
        """Wait for the thread to end (not from itself: a finalizer may run there)."""
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _run(self) -> None:
        # Signals go to other threads (handlers run in the main one), never into libzmq's calls.
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            while not self._turn():
                pass
        except BaseException:  # a bug: every caller still gets an answer
            logger.exception("the client's I/O thread failed; the client closes")
        finally:
            self._shut()

    def _turn(self) -> bool:
        """One turn of the loop (module docstring); True: a Close was taken."""
        self._polling = True  # (before _wait_ms looks for calls: hand() wakes it now)
        ready = dict(self._poller.poll(self._wait_ms()))
        self._polling = False
        if self._wake.fd in ready:
            self._wake.clear()
        completed = sum(self._read(link, ready) for link in self.links)
        now = self.clock.now()
        for link in self.links:  # (first: a window ends before its request's deadline)
            completed += self._expire_unsent(link, now) if link.unsent else 0
        completed += fail(self.futures, self.core.expire(now))
        completed += sum(self._follow_core(link) for link in self.links)
        completed += self._take_calls()
        now = self.clock.now()
        completed += sum(self._send(link, now) for link in self.links)
        if self._queries:
            self._answer_queries(now)
        if completed:
            self.completions.add(completed)
        return bool(self._closers)

    def _wait_ms(self) -> int | None:
        """How long the poll may wait: until the next deadline (None: until woken)."""
        if self._calls or self._closers:
            return 0
        untils = [op.until for link in self.links for op in link.unsent]
        untils += [query.until for query in self._queries.values()]
        if (deadline := self.core.next_deadline()) is not None:
            untils.append(deadline)
        if not untils:
            return None
        return max(0, math.ceil((min(untils) - self.clock.now()) * 1000))

    def _take_calls(self) -> int:
        """Take the calls handed so far (up to a Close); returns futures completed."""
        completed = 0
        handed, now = self._calls, self.clock.now()
        while handed and not self._closers:
            call = handed.popleft()
            try:
                if isinstance(call, Submit):
                    self._submit(call, now)
                elif isinstance(call, Cancel):
                    completed += self._cancel(call.future)
                elif isinstance(call, Query):
                    self._query(call, now)
                elif isinstance(call, Close):
                    self._closers.append(call)
            except BaseException:  # a bug: back with the calls, which _shut answers
                handed.appendleft(call)
                raise
        return completed

    def _submit(self, call: Submit, now: float) -> None:
        encoded = call.encoded
        if encoded is not None:  # (encoded by the caller, its future given already)
            call.frames, now = self.core.keep(encoded), encoded.now
        else:
            try:
                encoded = self.core.encode(
                    now, call.model, call.inputs, call.timeout_s, call.priority
                )
            except Exception as exc:  # TypeError, ValueError, ProtocolError: the caller's
                call.answer(error=exc)
                return
            call.inputs = {}  # (encoded: the caller may refill them once answered)
            call.frames = self.core.keep(encoded)
            call.future = self.futures[encoded.rid] = ReplyFuture(call.owner, encoded.rid)
        call.until = now + self.core.send_window_s(call.timeout_s)
        self.links[0].unsent.append(call)

    def _query(self, call: Query, now: float) -> None:
        try:
            call.qid, call.frames = call.ask()
        except Exception as exc:
            call.answer(error=exc)
            return
        call.until = now + call.timeout_s
        self.links[0].unsent.append(call)

    def _cancel(self, future: ReplyFuture) -> int:
        if future.done() or self.futures.get(future.request_id) is not future:
            return 0
        rid = future.request_id
        for link in self.links:  # one not sent yet never leaves: no CANCEL goes ahead of it
            if op := next((o for o in link.unsent if getattr(o, "future", 0) is future), None):
                link.unsent.remove(op)
                op.answer(future)  # (first: out of the link, its caller is answered)
                self.core.forget(rid)
                return fail(self.futures, [(rid, Cancelled(_UNSENT, request_id=rid))])
        error = self.core.cancel(rid)
        if error is None or error.request_id is None:
            return 0  # its CANCEL waits in the core, for the socket
        return fail(self.futures, [(error.request_id, error)])

    def _send(self, link: Link, now: float) -> int:
        """Send what the socket takes now (module docstring); returns futures completed."""
        socket = link.dealer.current.socket
        core, unsent = self.core, link.unsent
        full = sent = False
        while (frames := core.outgoing(now)) is not None:
            try:
                send_frames(socket, frames, NOBLOCK)
            except zmq.Again:
                full = True
                break
            core.took()
            sent = True
        while unsent and not full and not core.leaving:
            try:
                send_frames(socket, unsent[0].frames, NOBLOCK)
            except zmq.Again:
                full = True
                break
            self._sent(unsent.popleft())
            sent = True
        link.full = full or (link.full and not sent)
        completed = self._expire_unsent(link, now) if unsent else 0
        events = _POLLIN | _POLLOUT if full else _POLLIN
        if events != link.events:
            self._poller.modify(socket, events)
            link.events = events
        return completed

    def _sent(self, op: Submit | Query) -> None:
        op.frames = []
        if isinstance(op, Submit):
            op.answer(op.future)
        else:
            self._queries[op.qid] = op

    def _expire_unsent(self, link: Link, now: float) -> int:
        """Fail the requests and queries whose send window passed unsent."""
        completed = 0
        for op in [op for op in link.unsent if op.until <= now]:
            link.unsent.remove(op)  # (its caller answered next, before anything can fail)
            if isinstance(op, Query):
                op.answer(error=TimeoutError(_NOT_TAKING))
                self.core.queries.forget(op.qid)
                continue
            assert op.future is not None
            op.answer(op.future)
            rid = op.future.request_id
            self.core.forget(rid)
            completed += fail(self.futures, [(rid, Unavailable(_NOT_TAKING, request_id=rid))])
        return completed

    def _answer_queries(self, now: float) -> None:
        queries = self.core.queries
        for qid, query in list(self._queries.items()):
            got = queries.answer(qid)
            if got is None and query.until > now:
                continue
            queries.forget(qid)
            del self._queries[qid]
            if got is None:
                query.answer(error=TimeoutError("no answer from the broker"))
            elif isinstance(got, RequestError):
                query.answer(error=got)  # PermissionDenied (STATS is for operator keys), NotFound
            else:
                query.answer(got)

    def _watch(self, link: Link) -> None:
        """Poll the link's current socket (for reading) and its monitor."""
        self._poller.register(link.dealer.current.socket, _POLLIN)
        self._poller.register(link.dealer.current.watch.monitor, _POLLIN)
        link.events = _POLLIN

    def _unwatch(self, socket: zmq.Socket[bytes], monitor: zmq.Socket[Any]) -> None:
        self._poller.unregister(socket)
        self._poller.unregister(monitor)

    def _read(self, link: Link, ready: dict[Any, int]) -> int:
        """Read what the poll found on the link's sockets; returns futures completed."""
        dealer = link.dealer
        completed = 0
        if dealer.current.socket in ready:
            completed += self._drain(dealer.current.socket)
        if dealer.current.watch.monitor in ready and dealer.current.watch.lost():
            completed += self._connection_lost(link)
        retiring = dealer.retiring
        if retiring is not None:
            if retiring.socket in ready:
                completed += self._drain(retiring.socket)
            if retiring.watch.monitor in ready and retiring.watch.lost():
                completed += self._drain(retiring.socket)
                self._unwatch(retiring.socket, retiring.watch.monitor)
                dealer.close_retiring()
                completed += fail(self.futures, self.core.retiring_lost(self.clock.now()))
        return completed

    def _connection_lost(self, link: Link) -> int:
        """The connection closed (the broker stopped, or missed its heartbeats): read what
        came, and open the socket afresh (nothing queued in the old one reaches the next
        broker, to be answered twice). Each request pending on it, or waiting for it to
        take it, is sent again while its budget allows, else fails now (protocol §11)."""
        completed = self._drain(link.dealer.current.socket)
        self._unwatch(link.dealer.current.socket, link.dealer.current.watch.monitor)
        link.dealer.reopen()
        self._watch(link)
        completed += fail(self.futures, self.core.connection_lost(self.clock.now()))
        self._release_unsent(link)
        return completed

    def _release_unsent(self, link: Link) -> None:
        for op in [op for op in link.unsent if isinstance(op, Submit)]:
            link.unsent.remove(op)
            self._sent(op)

    def _follow_core(self, link: Link) -> int:
        """Leave the current connection when the core says so (a ``retry`` refusal: §11),
        and close the retiring socket once the core awaits nothing on it."""
        completed = 0
        dealer = link.dealer
        if self.core.leaving:
            old = dealer.retiring
            if old is not None:  # (at most one retires: it goes, after a last read)
                completed += self._drain(old.socket)
                self._unwatch(old.socket, old.watch.monitor)
            if link.events != _POLLIN:
                self._poller.modify(dealer.current.socket, _POLLIN)  # (read only from now on)
            dealer.switch()
            self._watch(link)
            completed += fail(self.futures, self.core.switched(self.clock.now()))
            self._release_unsent(link)
        retiring = dealer.retiring
        if retiring is not None and not self.core.retiring:
            self._unwatch(retiring.socket, retiring.watch.monitor)
            dealer.close_retiring()
        return completed

    def _drain(self, socket: zmq.Socket[bytes]) -> int:
        now = self.clock.now()
        completed = 0
        for frames in waiting(socket):
            try:
                rid, outcome = self.core.on_reply(frames, now)
            except ProtocolError:
                continue  # not a message we can read; nothing waits on it
            if isinstance(outcome, dict):
                continue  # a STATS or METADATA answer: the core keeps it for its query
            future = None if rid is None else self.futures.pop(rid, None)
            if future is not None:
                future._set(outcome)
                completed += 1
        return completed

    def _shut(self) -> None:
        """Close: every future answered ``Unavailable``, every call waiting answered (a
        submit with its future, others 'closed'), sockets and shared memory let go."""
        self._closing.set()  # (callers stop handing calls; hand() takes back a late one)
        closed = CarpoolError(_CLOSED)
        while self._calls:  # (first: a submit's future is among the futures already)
            call = self._calls.popleft()
            if isinstance(call, Close):
                self._closers.append(call)
            elif isinstance(call, Call) and not (
                isinstance(call, Submit) and call.encoded is not None
            ):
                call.answer(error=closed)
        while self.futures:  # (popitem: a caller may add one meanwhile, hand() refusing it)
            rid, future = self.futures.popitem()
            self.core.forget(rid)
            future._set(Unavailable("the client was closed", request_id=rid))
        for link in self.links:
            while link.unsent:
                op = link.unsent.popleft()
                if isinstance(op, Submit):
                    op.answer(op.future)  # (answered 'closed' above)
                else:
                    op.answer(error=closed)
        for query in self._queries.values():
            query.answer(error=closed)
        self._queries.clear()
        try:
            for link in self.links:
                link.dealer.close()
            close_core(self.core)
        finally:
            self.completions.wake()
            for closer in self._closers:
                closer.answer()
