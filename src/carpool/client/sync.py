"""sync.py: Client — the blocking SDK over one DEALER socket.

Futures from :meth:`Client.submit` are completed by whichever call pumps the socket next
(``ReplyFuture.result``, ``Client.infer`` or ``Client.poll``), so many requests can be in
flight from one thread without a background thread.

Threads may share a Client (one camera loop per thread, say). A zmq socket may be used by
one thread at a time, so one thread at a time owns it: the *pumper* receives for every
thread while the others wait on a condition, and a thread that must send (``submit``,
``stats``) wakes the pumper through a pipe in its poll, takes the socket, and hands it
back. Threads that wait for the socket take it in the order they came (a thread that
submits in a tight loop would otherwise take it back before a waiting thread woke, and
keep the others from their replies); ``close`` goes first, and once it has begun the
others give up. With one thread, owning it costs an uncontended lock's acquire and
release.

The pumper also reads the *retiring* socket, the one the client left when a stopping
broker refused a request with ``retry`` (:mod:`carpool.client.resend`): it opens the new
socket in the same turn as it reads that refusal, so no thread sends on the old one
after it, and closes the old one once the core awaits nothing on it.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Unpack

import zmq
from numpy.typing import ArrayLike, NDArray

from carpool.client.futures import ReplyFuture, answer
from carpool.client.options import ClientOptionArgs, ClientOptions
from carpool.client.queries import models_in
from carpool.client.shell import (
    ClientState,
    Dealer,
    close_core,
    curve_keys,
    flush,
    open_core,
    send_within,
)
from carpool.client.turns import RECHECK_S, Turns
from carpool.common.clock import Clock, MonotonicClock
from carpool.common.errors import CarpoolError, ProtocolError, RequestError, Unavailable
from carpool.common.protocol import ModelMetadata, Priority
from carpool.common.sockets import waiting

_OPEN = ClientState.OPEN  # (checked per call: a global is cheaper than Enum.MEMBER)
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)


class Client:
    """Blocking client of a carpool broker.

    Args:
        endpoint: the broker's frontend, e.g. ``tcp://127.0.0.1:5555``.
        context: zmq context to use; by default the client owns a new one.
        clock: the clock its deadlines are read from (a fake one in tests).
        options: :class:`~carpool.client.options.ClientOptions`, by keyword:
            ``default_timeout_s``, ``grace_s``, ``send_timeout_s`` and the
            ``shared_memory*`` options (their meaning and defaults are documented there).

    Raises:
        ValueError: an option out of its range.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        clock: Clock | None = None,
        **options: Unpack[ClientOptionArgs],
    ) -> None:
        self.options = ClientOptions(**options)
        keys = curve_keys(self.options)  # (before anything is opened: it may raise)
        self.core = open_core(self.options)
        self.clock: Clock = clock or MonotonicClock()
        self.context = context or zmq.Context()
        self._dealer = Dealer(self, self.context, endpoint, own_context=context is None, keys=keys)
        # One poller for the socket's life (Socket.poll builds a new one on every call).
        self._poller = zmq.Poller()
        self._poller.register(self.socket, zmq.POLLIN)
        self._poller.register(self._dealer.watch.monitor, zmq.POLLIN)
        self._events = _POLLIN  # the socket's, in the poller: POLLOUT too while the core
        # has messages the socket did not take yet (sent again, CANCELs)
        self._futures: dict[int, ReplyFuture] = {}
        self._cancels: deque[int] = deque()  # asked for by any thread; the owner sends
        self.state = ClientState.OPEN
        # Threads (module docstring): the socket's owner and the line waiting for it.
        self._turns = Turns(self.clock)
        self._wake = self._turns.wake
        weakref.finalize(self, self._wake.close)  # a Client dropped without close()
        self._poller.register(self._wake.fd, zmq.POLLIN)

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The DEALER socket to the broker (a fresh one after a lost connection)."""
        return self._dealer.socket

    def submit(
        self,
        model: str,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
    ) -> ReplyFuture:
        """Send a request without waiting; returns a future for its reply.

        The inputs may be reused (refilled) as soon as this returns. If the broker takes
        nothing for the request's whole timeout (it is away and 1,000 messages wait for
        it already), the future fails ``Unavailable`` then. A request whose connection is
        lost before its answer, or that a stopping broker refuses with ``retry``, is sent
        again on a new connection while its budget allows (:mod:`carpool.client.resend`);
        :meth:`ReplyFuture.cancel` cancels it.

        Raises (here, before anything is sent; what the broker refuses fails the future):
            TypeError: ``inputs`` is not a mapping of input names to arrays.
            ValueError: no inputs, a scalar input, or ``timeout_s`` outside (0, 3600].
            ProtocolError: an input's dtype has no wire name (complex, strings, objects).
            CarpoolError: the client is closed.
        """
        window_s = self.core.send_window_s(timeout_s)
        try:  # (acquired inside: an exception from a signal handler cannot skip finally)
            if not self._turns.take(window_s, send=True):
                # Other threads' sends have held the socket for all that time (the
                # broker takes nothing): as if this send had waited itself.
                future = ReplyFuture(self, 0)
                future._set(Unavailable("the broker is not taking requests"))
                return future
            self._check_open()
            now = self.clock.now()
            rid, frames = self.core.request(now, model, inputs, timeout_s, priority)
            future = ReplyFuture(self, rid)
            if not send_within(self.socket, frames, now + window_s, self.clock, self._stopping):
                # Its timeout passed with the broker taking nothing (down, or not
                # reading): an answer now, not a send that blocks while the broker is away.
                self.core.forget(rid)
                future._set(Unavailable("the broker is not taking requests", request_id=rid))
                return future
            self._futures[rid] = future
            return future
        finally:
            self._turns.let_go()

    def _stopping(self) -> bool:  # (a send waiting for room gives up once close() began)
        return self._turns.closing

    def cancel(self, future: ReplyFuture) -> bool:
        """Cancel ``future``'s request without waiting (:meth:`ReplyFuture.cancel`): any
        thread may call it; the thread that owns the socket sends the CANCEL. False: the
        future was answered already, or is not this client's."""
        rid = future.request_id
        if future.done() or self._futures.get(rid) is not future:
            return False
        self._cancels.append(rid)
        try:
            if self._turns.take(0.0, send=False):
                self._send_outgoing()
            else:
                self._wake.wake()  # the owner, if polling, returns and sends it
        except CarpoolError:
            return False  # closed meanwhile: close() answered the future
        finally:
            self._turns.let_go()
        return True

    def infer(
        self,
        model: str,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
    ) -> dict[str, NDArray[Any]]:
        """Run one request and return its outputs by name.

        Raises:
            RequestError: a subclass per wire error code (DeadlineExceeded, Overloaded, ...).
        """
        return self.submit(model, inputs, timeout_s, priority=priority).result().outputs

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The broker's counters: batch-size distribution per model, errors, workers."""
        return self._query(self.core.queries.stats_request, timeout_s)

    def model(self, name: str, timeout_s: float = 5.0) -> ModelMetadata:
        """What the broker's live workers say of model ``name`` (METADATA, protocol
        §6.6): its inputs and outputs, batch limits, shape rules and buckets, and the
        names of the workers that serve it.

        Raises:
            NotFound: no live worker serves ``name``.
        """
        answer = self._query(lambda: self.core.queries.metadata_request(name), timeout_s)
        return models_in(answer)[0]

    def models(self, timeout_s: float = 5.0) -> tuple[ModelMetadata, ...]:
        """Every model a live worker serves, sorted by name (see :meth:`model`)."""
        return models_in(self._query(self.core.queries.metadata_request, timeout_s))

    def _query(self, ask: Callable[[], tuple[int, list[Any]]], timeout_s: float) -> dict[str, Any]:
        """Send the STATS or METADATA request ``ask`` makes and wait for its answer."""
        self._check_open()
        until = self.clock.now() + timeout_s
        qid = 0  # (no id yet: forgetting it is a no-op)
        try:
            try:
                if not self._turns.take(timeout_s, send=True):
                    raise TimeoutError("the broker is not taking requests")
                self._check_open()
                qid, frames = ask()
                if not send_within(self.socket, frames, until, self.clock, self._stopping):
                    raise TimeoutError("the broker is not taking requests")
            finally:
                self._turns.let_go()
            # Whichever thread pumps the socket hands the answer to the core.
            while (got := self.core.queries.answer(qid)) is None:
                left = until - self.clock.now()
                if left <= 0:
                    raise TimeoutError("no answer from the broker")
                self._poll(left, None, qid)
            if isinstance(got, RequestError):
                raise got  # PermissionDenied (STATS is for operator keys), NotFound
            return got
        finally:
            self.core.queries.forget(qid)

    # ------------------------------------------------------------------ threads

    def poll(self, timeout_s: float | None = 0.0) -> int:
        """Receive what has arrived (waiting at most ``timeout_s``, or until the next local
        deadline) and complete futures. Returns the number of futures completed (by this
        call: while another thread owns the socket, this waits as long for it to let go,
        and that thread completes every thread's futures)."""
        return self._poll(timeout_s, None)

    def _poll(self, timeout_s: float | None, future: ReplyFuture | None, query_id: int = 0) -> int:
        """:meth:`poll` for ``future``'s sake (or query ``query_id``'s): it does not
        wait once that is answered (another thread may receive the answer between the
        caller's look and this one's poll)."""
        try:  # (acquired inside: an exception from a signal handler cannot skip finally)
            # Waiting for the socket, a nap at most: the owner, pumping, completes this
            # thread's futures meanwhile, and the caller looks at them again.
            waited = False
            if self._turns.contended or not self._turns.own.acquire(False):
                nap_s = RECHECK_S if timeout_s is None else min(timeout_s, RECHECK_S)
                if not self._turns.take(nap_s, send=False):
                    return 0
                waited = True
            # The socket is this thread's until it lets go.
            self._check_open()
            deadline = self.core.next_deadline()
            now = self.clock.now()
            wait_s = timeout_s
            if deadline is not None:
                wait_s = deadline - now if wait_s is None else min(wait_s, deadline - now)
            if (
                waited
                or self._turns.sending
                or (future is not None and future.done())
                or (query_id and self.core.queries.answer(query_id) is not None)
            ):
                # It waited its turn: what it waits for may have come meanwhile (the
                # owner before it pumped), so it looks and lets its caller check. Or a
                # thread waits to send: look, and let go.
                wait_s = 0.0
            wait_ms = None if wait_s is None else max(0, math.ceil(wait_s * 1000))
            completed = 0
            try:
                for which, _ in self._poller.poll(wait_ms):
                    if which is self.socket:
                        now = self.clock.now()
                        for frames in waiting(self.socket):
                            completed += self._dispatch(frames, now)
                    elif which is self._dealer.watch.monitor:
                        if self._dealer.watch.lost():
                            completed += self._connection_lost()
                    elif which == self._wake.fd:
                        self._wake.clear()  # a sender's wake-up: it takes the socket next
                    else:
                        completed += self._on_retiring(which)
            except zmq.ZMQError:
                # close() from a signal handler in this thread, while it polled: the
                # client's own error (close answered every future), not libzmq's.
                self._check_open()
                raise
            completed += answer(self._futures, self.core.expire(self.clock.now()))
            completed += self._follow_core()
            if self._cancels or self._events != _POLLIN or self.core.resend.has_outgoing:
                completed += self._send_outgoing()
            return completed
        finally:
            self._turns.let_go()

    def _send_outgoing(self) -> int:
        """(Owning the socket.) Apply the cancels asked for, and send what the core has
        for the socket while it takes it, polling for POLLOUT until it has taken all.
        Returns the number of futures completed (cancelled before being sent again)."""
        completed = 0
        while self._cancels:
            error = self.core.cancel(self._cancels.popleft())
            if error is not None and error.request_id is not None:
                completed += answer(self._futures, [(error.request_id, error)])
        events = _POLLIN
        if flush(self.core, self.socket, self.clock.now()):
            events |= _POLLOUT
        if events != self._events:
            self._poller.modify(self.socket, events)
            self._events = events
        return completed

    def _connection_lost(self) -> int:
        """The connection to the broker closed (the broker stopped, or missed its
        heartbeats): what it sent before is read, and the socket is opened afresh, so
        that nothing still queued in the old one reaches the broker the client connects
        to next and is answered twice. Each request still pending on it (its reply can no
        longer come: the broker answers by connection) is sent again on the new socket
        while its budget allows, and fails UNAVAILABLE now otherwise (protocol §11)."""
        completed = self._drain(self.socket)
        self._poller.unregister(self.socket)
        self._poller.unregister(self._dealer.watch.monitor)
        self._dealer.reopen()
        self._register_current()
        return completed + answer(self._futures, self.core.connection_lost(self.clock.now()))

    def _register_current(self) -> None:
        self._poller.register(self.socket, _POLLIN)
        self._events = _POLLIN
        self._poller.register(self._dealer.watch.monitor, zmq.POLLIN)

    def _follow_core(self) -> int:
        """(Owning the socket.) Leave the current connection when the core says so (its
        broker refused a request with ``retry``: protocol §11), and close the retiring
        socket once the core awaits nothing on it. Returns the number of futures completed
        (requests on a retiring socket dropped, with too little budget left)."""
        completed = 0
        dealer = self._dealer
        if self.core.leaving:
            old = dealer.retiring
            if old is not None:  # (at most one retires: it goes, after a last read)
                completed += self._drain(old.socket)
                self._poller.unregister(old.socket)
                self._poller.unregister(old.watch.monitor)
            if self._events != _POLLIN:
                self._poller.modify(self.socket, _POLLIN)  # (read only from now on)
            dealer.switch()
            self._register_current()
            completed += answer(self._futures, self.core.switched(self.clock.now()))
        retiring = dealer.retiring
        if retiring is not None and not self.core.retiring:
            self._poller.unregister(retiring.socket)
            self._poller.unregister(retiring.watch.monitor)
            dealer.close_retiring()
        return completed

    def _on_retiring(self, which: object) -> int:
        """The poll found the retiring socket readable, or its monitor: read its answers,
        or, when its connection closed, let the core send its requests again."""
        retiring = self._dealer.retiring
        if retiring is None:
            return 0  # (closed earlier in this turn)
        if which is retiring.socket:
            return self._drain(retiring.socket)
        if which is not retiring.watch.monitor or not retiring.watch.lost():
            return 0
        completed = self._drain(retiring.socket)
        self._poller.unregister(retiring.socket)
        self._poller.unregister(retiring.watch.monitor)
        self._dealer.close_retiring()
        return completed + answer(self._futures, self.core.retiring_lost(self.clock.now()))

    def _drain(self, socket: zmq.Socket[bytes]) -> int:
        now = self.clock.now()
        return sum(self._dispatch(frames, now) for frames in waiting(socket))

    def _dispatch(self, frames: list[zmq.Frame], now: float) -> int:
        try:
            rid, outcome = self.core.on_reply(frames, now)
        except ProtocolError:
            return 0  # not a message we can read; nothing waits on it
        if isinstance(outcome, dict):
            return 0  # a STATS or METADATA answer: the core keeps it for the call that asked
        future = None if rid is None else self._futures.pop(rid, None)
        if future is None:
            return 0
        future._set(outcome)
        return 1

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    def _check_open(self) -> None:
        if self.state is not _OPEN:
            raise CarpoolError("the client is closed")

    def close(self) -> None:
        if self.state is ClientState.CLOSED:
            return
        self._turns.closing = True  # a send that waits for room gives up (RECHECK_S)
        try:
            # Own the socket: no other thread is in it then. (Re-entrant: close() from a
            # signal handler in the thread that owns it goes on at once; that thread's
            # interrupted call then fails on the closed socket.)
            self._turns.take(None, send=False, close=True)
            if self.state is not _OPEN:  # (closed by another thread meanwhile)
                return
            with self._turns.cond:  # no thread is waking the pipe while it closes
                self.state = ClientState.CLOSED
                self._turns.closed = True
                self._wake.close()
            for rid, future in self._futures.items():  # each still gets an answer
                self.core.forget(rid)
                future._set(Unavailable("the client was closed", request_id=rid))
            self._futures.clear()
        except CarpoolError:  # another thread closed it meanwhile
            return
        except BaseException:
            # Interrupted (a second Ctrl-C) before it closed anything: the client stays
            # open, and usable, rather than refusing every send as if closing for ever.
            if self.state is _OPEN:
                self._turns.closing = False
            raise
        finally:
            self._turns.let_go()
        self._dealer.close()
        close_core(self.core)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
