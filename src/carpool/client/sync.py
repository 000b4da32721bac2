"""sync.py: Client — the blocking SDK, over one I/O thread per client.

The constructor opens the client's DEALER socket and starts its I/O thread
(:class:`~carpool.client.iothread.IOThread`, a daemon thread named
``carpool-client-io-N``), which alone uses the socket and changes the client's
:class:`~carpool.client.core.ClientCore` from then on; ``close()`` joins it. Every method
hands that thread a call, so any thread may use the client (a camera loop per thread,
say), and so may a signal handler: a call that waits waits on a lock of its own, never
on another thread's. The thread completes every future, in whichever thread it is
waited for (:meth:`ReplyFuture.result`).

``submit`` encodes the request here and returns at once while the socket has room (the
I/O thread sends it); ``stats`` and ``model`` return once their answer came; ``poll``
waits for futures to complete. A client dropped without ``close()`` is closed when it is
collected.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Unpack

import zmq
from numpy.typing import ArrayLike, NDArray

from carpool.client.calls import Close, Query, ReplyFuture, Submit
from carpool.client.iothread import IOThread
from carpool.client.options import ClientOptionArgs, ClientOptions, client_options
from carpool.client.queries import models_in
from carpool.client.shell import ClientState, curve_keys, open_core
from carpool.common.clock import Clock, MonotonicClock
from carpool.common.errors import CarpoolError
from carpool.common.protocol import ModelMetadata, Priority


class Client:
    """Blocking client of a carpool broker.

    Args:
        endpoint: the broker's frontend, e.g. ``tcp://127.0.0.1:5555``.
        context: zmq context to use; by default the client owns a new one.
        clock: the clock its deadlines are read from (a fake one in tests).
        options: a :class:`~carpool.client.options.ClientOptions` (the same value opens
            an :class:`~carpool.client.AsyncClient`); or its fields as keywords
            (``default_timeout_s``, ``grace_s``, ``send_timeout_s``, the
            ``shared_memory*`` options...: their meaning and defaults are documented
            there), not both.

    Attributes:
        core: the client's :class:`~carpool.client.core.ClientCore`, which its I/O
            thread alone changes (its counters, ``resends`` and the like, may be read).

    Raises:
        ValueError: an option out of its range.
        TypeError: ``options`` and keyword options both.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        clock: Clock | None = None,
        options: ClientOptions | None = None,
        **args: Unpack[ClientOptionArgs],
    ) -> None:
        self.options = client_options(options, args)
        keys = curve_keys(self.options)  # (before anything is opened: it may raise)
        self.core = open_core(self.options)
        self.clock: Clock = clock or MonotonicClock()
        self.context = context or zmq.Context()
        self._io = IOThread(
            self.core,
            self.clock,
            self.context,
            endpoint,
            own_context=context is None,
            keys=keys,
        )
        # A client dropped without close() closes when collected: once no future of a
        # request still pending holds it (the thread holds the IOThread, not the client).
        weakref.finalize(self, _close, self._io)

    @property
    def state(self) -> ClientState:
        return ClientState.CLOSED if self._io.closed else ClientState.OPEN

    def submit(
        self,
        model: str,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float | None = None,
        *,
        priority: Priority = Priority.INTERACTIVE,
    ) -> ReplyFuture:
        """Send a request; returns a future for its reply.

        The inputs may be reused (refilled) as soon as this returns. While requests wait
        for room (the broker is away and 1,000 messages wait for it already), this waits
        for its own to be taken, at most its send window (its timeout, or
        ``send_timeout_s`` if shorter), and returns then with the future failed
        ``Unavailable``; a request handed on while the socket had room fails so too. A
        request whose connection is lost before its answer, or that a stopping broker
        refuses with ``retry``, is sent again on a new connection while its budget
        allows (:mod:`carpool.client.resend`); :meth:`ReplyFuture.cancel` cancels it.

        Raises (here, before anything is sent; what the broker refuses fails the future):
            TypeError: ``inputs`` is not a mapping of input names to arrays.
            ValueError: no inputs, a scalar input, or ``timeout_s`` outside (0, 3600].
            ProtocolError: an input's dtype has no wire name (complex, strings, objects).
            CarpoolError: the client is closed.
        """
        io = self._io
        if self.core.arena is None and not io.backlogged():
            # Room, and no shared memory: encoded here (what it raises, raised here), kept
            # and sent by the I/O thread without this call waiting for it.
            encoded = self.core.encode(self.clock.now(), model, inputs, timeout_s, priority)
            call = Submit(self, model, {}, timeout_s, priority, encoded)
            try:
                future = call.future = io.futures[encoded.rid] = ReplyFuture(self, encoded.rid)
                io.hand(call)
            except BaseException:  # closed, or interrupted: nobody has the future
                io.futures.pop(encoded.rid, None)
                raise
            return future
        call = Submit(self, model, inputs, timeout_s, priority)
        io.hand(call)  # (encoded by the I/O thread, sent or failed, then answered)
        waited: ReplyFuture = call.wait()
        return waited

    def cancel(self, future: ReplyFuture) -> bool:
        """Cancel ``future``'s request without waiting (:meth:`ReplyFuture.cancel`): any
        thread may call it; the I/O thread sends the CANCEL. False: the future was
        answered already, or is not this client's."""
        return self._io.cancel(future)

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
        queries = self.core.queries
        answer = self._query(lambda: queries.metadata_request(name), timeout_s)
        return models_in(answer)[0]

    def models(self, timeout_s: float = 5.0) -> tuple[ModelMetadata, ...]:
        """Every model a live worker serves, sorted by name (see :meth:`model`)."""
        return models_in(self._query(self.core.queries.metadata_request, timeout_s))

    def _query(self, ask: Callable[[], tuple[int, list[Any]]], timeout_s: float) -> dict[str, Any]:
        """The broker's answer to the STATS or METADATA request ``ask`` makes (in the I/O
        thread: ``ask`` draws its id from the core).

        Raises:
            TimeoutError: not sent, or not answered, within ``timeout_s``.
            RequestError: the broker refused it (PermissionDenied, NotFound).
            CarpoolError: the client is closed.
        """
        call = Query(ask, timeout_s)
        self._io.hand(call)
        answer: dict[str, Any] = call.wait()
        return answer

    def poll(self, timeout_s: float | None = 0.0) -> int:
        """Wait at most ``timeout_s`` (None: without end; 0: a microsecond, which lets the
        I/O thread take the GIL) for a future to complete; returns the number completed
        since the last ``poll`` (in any thread). The I/O thread completes futures whether
        or not anyone polls: this only waits.

        Raises:
            CarpoolError: the client is closed (and nothing completed since the last look),
                or this is a ``fork()`` child of the client's process.
        """
        return self._io.wait_completed(timeout_s)

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._io.futures)

    def close(self) -> None:
        """Close the client: every request still in flight fails ``Unavailable`` ('the
        client was closed'), a call that waits for the socket returns (a submit with
        such a future; a ``stats`` raising CarpoolError), later calls raise
        CarpoolError, and the I/O thread ends (joined here). Any thread may close the
        client, a signal handler too; a second close does nothing."""
        _close(self._io)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close(io: IOThread) -> None:
    """Have ``io`` close, and wait for its thread to end."""
    # (Closed or closing already, or in a forked child: no thread to hand it to.)
    with contextlib.suppress(CarpoolError):
        io.hand(Close())
    io.join()
