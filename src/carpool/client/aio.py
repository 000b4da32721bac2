"""aio.py: AsyncClient — the asyncio twin of :class:`carpool.client.Client`.

Same methods (``submit``, ``infer``, ``stats``, ``cancel``, ``close``) over the same
ClientCore; one reader task per client completes the futures, and sends what the core
has for the socket (requests sent again after a lost connection, CANCELs). It reads the
retiring socket too (left at a stopping broker's ``retry``: :mod:`carpool.client.resend`),
and opens the new socket in the step that reads that refusal, with no await between (a
send already waiting for room on the old socket still goes there). Use it from one
event loop at a time: a client moves to a new loop once the old one has stopped
(``asyncio.run`` after ``asyncio.run``), and refuses a second loop while the first runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any, Unpack

import zmq
import zmq.asyncio
from numpy.typing import ArrayLike, NDArray

from carpool.client.options import ClientOptionArgs, ClientOptions, client_options
from carpool.client.queries import models_in
from carpool.client.results import InferResult
from carpool.client.shell import ClientState, Dealer, close_core, curve_keys, flush, open_core
from carpool.common.clock import Clock, MonotonicClock
from carpool.common.errors import CarpoolError, ProtocolError, RequestError, Unavailable
from carpool.common.protocol import ModelMetadata, Priority
from carpool.common.sockets import waiting

_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)


def _cancelled() -> bool:
    """Whether the running task itself is being cancelled (not a socket it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Reply(asyncio.Future[InferResult]):
    """The future of one request: cancelling it (``future.cancel()``, or a task or
    ``asyncio.wait_for`` that gives up on it) sends the request's CANCEL too, and its
    later answer is dropped (:meth:`AsyncClient.cancel` keeps the answer instead)."""

    __slots__ = ("_client", "request_id")

    def __init__(self, client: AsyncClient, request_id: int, loop: asyncio.AbstractEventLoop):
        super().__init__(loop=loop)
        self._client, self.request_id = client, request_id

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        self._client._cancel(self.request_id)
        return True


class AsyncClient:
    """asyncio client of a carpool broker; see :class:`carpool.client.Client` for args."""

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.asyncio.Context | None = None,
        clock: Clock | None = None,
        options: ClientOptions | None = None,
        **args: Unpack[ClientOptionArgs],
    ) -> None:
        self.options = client_options(options, args)
        keys = curve_keys(self.options)  # (before anything is opened: it may raise)
        self.core = open_core(self.options)
        self.clock: Clock = clock or MonotonicClock()
        self.context = context or zmq.asyncio.Context()
        self._dealer = Dealer(self, self.context, endpoint, own_context=context is None, keys=keys)
        self._poll_events = _POLLIN  # the socket's, in the poller (set by _new_poller)
        self._poller = self._new_poller()
        self._futures: dict[int, asyncio.Future[InferResult]] = {}
        # stats() and model() calls waiting for their answers, by id (several may overlap).
        self._queries: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._polling: asyncio.Future[Any] | None = None  # cancelled to wake the reader
        self._loop: asyncio.AbstractEventLoop | None = None  # of the futures and reader
        self.state = ClientState.OPEN

    @property
    def socket(self) -> zmq.asyncio.Socket:
        """The DEALER socket to the broker (a fresh one after a lost connection)."""
        return self._dealer.current.socket

    async def submit(
        self,
        model: str,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
    ) -> asyncio.Future[InferResult]:
        """Send a request; returns a future that resolves to its result or typed error
        (as :meth:`carpool.client.Client.submit`: inputs may be reused at once; a broker
        that takes nothing for the whole timeout fails it ``Unavailable``; bad inputs
        raise here, with the same exceptions)."""
        self._check_open()
        loop = self._bind()
        now = self.clock.now()
        rid, frames = self.core.request(now, model, inputs, timeout_s, priority)
        future = _Reply(self, rid, loop)
        self._futures[rid] = future
        # (The time the request took to encode counts against its window.)
        send_s = now + self.core.send_window_s(timeout_s) - self.clock.now()
        socket = self.socket
        try:
            await asyncio.wait_for(socket.send_multipart(frames, copy=False), send_s)
        except (TimeoutError, asyncio.TimeoutError):  # (one class from 3.11 on)
            self.core.forget(rid)
            self._settle(rid, Unavailable("the broker is not taking requests", request_id=rid))
            return future
        except asyncio.CancelledError:
            if self._ended_by_close() or (
                not _cancelled() and (future.done() or socket is not self.socket)
            ):
                # It holds close()'s answer or the lost connection's, or the reader
                # reopened the socket and sends it again.
                return future
            self.core.forget(rid)
            self._futures.pop(rid, None)
            raise
        except BaseException:  # the socket failed: nothing was sent
            self.core.forget(rid)
            self._futures.pop(rid, None)
            raise
        self._ensure_reader()
        return future

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
    ) -> dict[str, NDArray[Any]]:
        """Run one request and return its outputs by name (raises typed errors)."""
        future = await self.submit(model, inputs, timeout_s, priority=priority)
        return (await future).outputs

    async def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The broker's counters (see :meth:`carpool.client.Client.stats`)."""
        return await self._query(self.core.queries.stats_request, timeout_s)

    async def model(self, name: str, timeout_s: float = 5.0) -> ModelMetadata:
        """What the live workers say of model ``name`` (see :meth:`carpool.client.Client.model`).

        Raises:
            NotFound: no live worker serves ``name``.
        """
        answer = await self._query(lambda: self.core.queries.metadata_request(name), timeout_s)
        return models_in(answer)[0]

    async def models(self, timeout_s: float = 5.0) -> tuple[ModelMetadata, ...]:
        """Every model a live worker serves, sorted by name."""
        return models_in(await self._query(self.core.queries.metadata_request, timeout_s))

    async def _query(
        self, ask: Callable[[], tuple[int, list[Any]]], timeout_s: float
    ) -> dict[str, Any]:
        """Send the STATS or METADATA request ``ask`` makes and wait for its answer."""
        self._check_open()
        answer: asyncio.Future[dict[str, Any]] = self._bind().create_future()
        qid, frames = ask()
        self._queries[qid] = answer
        try:
            try:
                await asyncio.wait_for(self.socket.send_multipart(frames), timeout_s)
            except (TimeoutError, asyncio.TimeoutError):  # (one class from 3.11 on)
                raise TimeoutError("the broker is not taking requests") from None
            except asyncio.CancelledError:
                if self._ended_by_close():
                    raise CarpoolError("the client is closed") from None
                raise
            self._ensure_reader()
            return await asyncio.wait_for(answer, timeout_s)
        finally:  # answered or given up: a later reply is dropped, the reader may go idle
            self._queries.pop(qid, None)
            self.core.queries.forget(qid)

    def cancel(self, future: asyncio.Future[InferResult]) -> bool:
        """Cancel ``future``'s request without waiting, as
        :meth:`carpool.client.ReplyFuture.cancel` does: the future still resolves with
        the request's one answer (``Cancelled`` if the broker dropped it before any
        worker had it, else its result). Cancelling the asyncio future itself
        (``future.cancel()``, ``asyncio.wait_for`` giving up) sends the CANCEL too, and
        drops that answer. Returns False if the future was answered already, or is not
        this client's."""
        if not isinstance(future, _Reply) or future.done() or future._client is not self:
            return False
        self._cancel(future.request_id)
        return True

    def _cancel(self, rid: int) -> None:
        error = self.core.cancel(rid)
        if error is not None:
            self._settle(rid, error)  # it was at no broker (waiting to be sent again)
        elif self.state is ClientState.OPEN:
            # (From a future's cancel() too, which must not raise: a socket that fails
            # here fails the reader as well, which answers every request.)
            with contextlib.suppress(zmq.ZMQError):
                self._send_outgoing()

    def _send_outgoing(self) -> None:
        """Send what the core has for the socket while it takes it; wake the reader to
        poll for room if some is left."""
        if flush(self.core, self.socket, self.clock.now()):
            polling = self._polling
            if polling is not None and not polling.done():
                polling.cancel()  # (the reader polls again, for POLLOUT as well)
        # A send outside zmq.asyncio's own may take the socket's edge-triggered readable
        # event; reading EVENTS through it schedules what is waiting.
        self.socket.get(zmq.EVENTS)

    def _ended_by_close(self) -> bool:
        """Whether the CancelledError being handled came from close() (zmq cancels what
        waits on a socket it closes), not from a cancel of this task."""
        task = asyncio.current_task()
        return self.state is not ClientState.OPEN and not (task is not None and task.cancelling())

    def _bind(self) -> asyncio.AbstractEventLoop:
        """The running loop, which the client's futures and reader belong to. A client
        moves to it once the loop it used before has stopped: what was pending there
        cannot be answered any more (its tasks are gone with it) and is dropped.

        Raises:
            RuntimeError: another loop, still running (in another thread), uses it.
        """
        loop = asyncio.get_running_loop()
        old = self._loop
        if old is loop:
            return loop
        if old is not None:
            if old.is_running():
                raise RuntimeError(
                    "this AsyncClient is in use by another running event loop; "
                    "use one client per loop"
                )
            for rid, future in list(self._futures.items()):
                self.core.forget(rid)
                del self._futures[rid]
                if not future.done() and not old.is_closed():
                    future.set_exception(
                        Unavailable("the client moved to another event loop", request_id=rid)
                    )
            for qid, answer in list(self._queries.items()):
                self.core.queries.forget(qid)
                del self._queries[qid]
                if not answer.done() and not old.is_closed():
                    answer.set_exception(CarpoolError("the client moved to another loop"))
            if self._reader is not None and not old.is_closed():
                self._reader.cancel()  # (if that loop ever runs again)
            self._reader = None
            # Fresh sockets: an asyncio socket keeps the futures its last poll left
            # there, bound to the old loop, and an event would wake them there.
            self._dealer.close_retiring()
            self._dealer.reopen()
            self._poller = self._new_poller()
        self._loop = loop
        return loop

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            await self._read_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the socket failed: nobody must wait forever
            for rid in list(self._futures):
                self._settle(rid, Unavailable(f"client socket failed: {exc}", request_id=rid))

    async def _read_loop(self) -> None:
        while self.state is ClientState.OPEN:
            deadline = self.core.next_deadline()
            if deadline is None and not self._futures and not self._queries:
                return  # idle: the next submit restarts the reader
            # Wake at least once a second so requests with shorter timeouts expire on time.
            wait_s = 1.0 if deadline is None else min(1.0, deadline - self.clock.now())
            wait_ms = max(0, math.ceil(wait_s * 1000))
            events = _POLLIN | _POLLOUT if self.core.resend.has_outgoing else _POLLIN
            if events != self._poll_events:  # (POLLOUT while the core has messages)
                self._poller.register(self.socket, events)  # (registered: a modify)
                self._poll_events = events
            self._polling = polling = asyncio.ensure_future(self._poller.poll(wait_ms))
            try:
                ready = dict(await polling)
            except asyncio.CancelledError:
                if _cancelled():
                    raise
                ready = {}  # woken: the core has something for the socket
            finally:
                self._polling = None
            socket, watch = self.socket, self._dealer.current.watch
            retiring = self._dealer.retiring
            if ready.get(socket, 0) & _POLLIN:
                await self._receive(socket)  # (never suspends: NOBLOCK receives)
                self._follow_core()  # at once: nothing more goes on a socket the core left
            if watch.monitor in ready and socket is self.socket and watch.lost():
                await self._connection_lost()
            if retiring is not None and retiring is self._dealer.retiring:
                if ready.get(retiring.socket, 0) & _POLLIN:
                    await self._receive(retiring.socket)
                if retiring.watch.monitor in ready and retiring.watch.lost():
                    await self._retiring_lost()
            for rid, error in self.core.expire(self.clock.now()):
                self._settle(rid, error)
            self._follow_core()
            if self.core.resend.has_outgoing:
                self._send_outgoing()

    async def _receive(self, socket: zmq.asyncio.Socket) -> None:
        now = self.clock.now()
        while True:
            try:
                frames = await socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._dispatch(frames, now)

    def _follow_core(self) -> None:
        """Leave the current connection when the core says so (its broker refused a
        request with ``retry``: protocol §11), and close the retiring socket once the core
        awaits nothing on it."""
        dealer = self._dealer
        changed = False
        if self.core.leaving:
            old = dealer.retiring
            if old is not None:  # (at most one retires: it goes, after a last read)
                now = self.clock.now()
                for frames in waiting(old.socket):
                    self._dispatch(frames, now)
            dealer.switch()
            changed = True
            for rid, error in self.core.switched(self.clock.now()):
                self._settle(rid, error)
        if dealer.retiring is not None and not self.core.retiring:
            dealer.close_retiring()
            changed = True
        if changed:
            self._poller = self._new_poller()

    def _new_poller(self) -> zmq.asyncio.Poller:
        """A poller of the socket and its watch's monitor (an asyncio socket: shell.py),
        and of the retiring socket and its monitor, if one retires."""
        dealer = self._dealer
        poller = zmq.asyncio.Poller()
        poller.register(self.socket, zmq.POLLIN)
        self._poll_events = _POLLIN
        poller.register(dealer.current.watch.monitor, zmq.POLLIN)
        if dealer.retiring is not None:
            poller.register(dealer.retiring.socket, zmq.POLLIN)
            poller.register(dealer.retiring.watch.monitor, zmq.POLLIN)
        return poller

    async def _connection_lost(self) -> None:
        """The connection closed (the broker stopped, or missed its heartbeats): what it
        sent before is read, the socket opened afresh (nothing queued in the old one
        reaches the next broker to be answered twice), and each request still pending on
        it sent again on the new one while its budget allows, or failed UNAVAILABLE now."""
        await self._receive(self.socket)
        self._dealer.reopen()
        self._poller = self._new_poller()
        for rid, error in self.core.connection_lost(self.clock.now()):
            self._settle(rid, error)

    async def _retiring_lost(self) -> None:
        """The retiring connection closed: what it sent is read, its socket closed, and
        each request still awaited there sent again on the current socket (budget
        allowing) or failed UNAVAILABLE now."""
        retiring = self._dealer.retiring
        if retiring is None:
            return
        await self._receive(retiring.socket)
        self._dealer.close_retiring()
        self._poller = self._new_poller()
        for rid, error in self.core.retiring_lost(self.clock.now()):
            self._settle(rid, error)

    def _dispatch(self, frames: list[zmq.Frame], now: float) -> None:
        try:
            rid, outcome = self.core.on_reply(frames, now)
        except ProtocolError:
            return
        if isinstance(outcome, dict):
            # A STATS or METADATA answer: rid is the call's that asked (None: nobody waits).
            answer = None if rid is None else self._queries.get(rid)
            if answer is not None and not answer.done():
                answer.set_result(outcome)
            return
        if rid is not None:
            refused = self._queries.get(rid)  # a query answered with an error
            if refused is not None and not isinstance(outcome, InferResult):
                if not refused.done():
                    refused.set_exception(outcome)
                return
            self._settle(rid, outcome)

    def _settle(self, rid: int, outcome: InferResult | RequestError) -> None:
        future = self._futures.pop(rid, None)
        if future is None or future.done():
            return
        if isinstance(outcome, RequestError):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    def _check_open(self) -> None:
        if self.state is not ClientState.OPEN:
            raise CarpoolError("the client is closed")

    async def close(self) -> None:
        if self.state is ClientState.CLOSED:
            return
        self._bind()  # (its reader must be this loop's to be awaited)
        self.state = ClientState.CLOSED
        try:
            if self._reader is not None:
                self._reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._reader
        finally:
            for rid in list(self._futures):
                self._settle(rid, Unavailable("the client was closed", request_id=rid))
            for answer in self._queries.values():
                if not answer.done():
                    answer.set_exception(CarpoolError("the client is closed"))
            self._dealer.close()
            close_core(self.core)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
