"""shell.py: what the two client twins do alike around their I/O: open and let go.

``Client`` (blocking) and ``AsyncClient`` (asyncio) each build the same
:class:`~carpool.client.core.ClientCore` from their :class:`ClientOptions` (with its
shared-memory region, if asked for), open a DEALER socket on their own kind of zmq
context (two while one retires: :class:`Dealer`), and release them the same way.
Everything about requests, replies, deadlines and when to change sockets is the core's;
only these resources are here.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Generic, TypeVar

import zmq

from carpool.client.core import ClientCore
from carpool.client.options import ClientOptions
from carpool.common.clock import Clock
from carpool.common.curve import ClientKeys, client_keys, connect_keys
from carpool.common.shm import ShmArena
from carpool.common.sockets import NOBLOCK, recv_frames, send_frames

SocketT = TypeVar("SocketT", bound="zmq.Socket[Any]")
#: How long a blocking send waiting for room sleeps before it looks again at whether the
#: client is closing.
_RECHECK_S = 0.05


class ClientState(Enum):
    OPEN = "open"
    CLOSED = "closed"


def open_core(options: ClientOptions) -> ClientCore:
    """The core of a client with these options, holding its shared-memory region if
    ``options.shared_memory`` asks for one."""
    arena = None
    if options.shared_memory:
        arena = ShmArena(
            options.shared_memory,
            mode=options.shared_memory_mode,
            group=options.shared_memory_group,
        )
    return ClientCore.from_options(options, arena)


def curve_keys(options: ClientOptions) -> ClientKeys | None:
    """The client's CURVE keys from its options, read once (None: no CURVE).

    Raises:
        ConfigError: a key file cannot be read, or the secret one is not private.
    """
    return client_keys(options.curve_server_key, options.curve_key, "ClientOptions.curve_key")


class Line(Generic[SocketT]):
    """One socket to the broker and the :class:`ConnectionWatch` of its connection."""

    __slots__ = ("socket", "watch")

    def __init__(self, socket: SocketT, watch: ConnectionWatch) -> None:
        self.socket, self.watch = socket, watch

    def close(self) -> None:
        release_socket(self.socket, self.watch)


class Dealer(Generic[SocketT]):
    """A client's DEALER socket to its broker (a CURVE client with ``keys``) and the
    :class:`ConnectionWatch` of its connection; the socket it left after a stopping
    broker's refusal, kept for reading until the core awaits nothing on it
    (:attr:`retiring`); and the finalizer that closes them (and ``context`` too, with
    ``own_context``) at :meth:`close` or when ``owner`` is collected without one (see
    :func:`release_sockets`). This object alone holds them; the client reads the
    :class:`Line` it sends on, ``current``, and ``retiring`` from it.
    """

    def __init__(
        self,
        owner: object,
        context: zmq.Context[SocketT],
        endpoint: str,
        *,
        own_context: bool,
        keys: ClientKeys | None,
    ) -> None:
        self._context, self._endpoint, self._keys = context, endpoint, keys
        # The lines open now, for the finalizer (it holds this list, never the owner).
        self._lines: list[Line[SocketT]] = []
        self._release = weakref.finalize(owner, release_sockets, self._lines, context, own_context)
        self.retiring: Line[SocketT] | None = None
        self.current = self._open(immediate=False)

    def _open(self, *, immediate: bool) -> Line[SocketT]:
        """``immediate``: queue messages only on a connection that is up
        (``ZMQ_IMMEDIATE``), so that a send while no broker listens waits for room
        instead (see :meth:`reopen`)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        # No receive mark: the broker sends one answer per request, so what waits is
        # bounded by what was sent. (At a mark libzmq stops reading the connection; if it
        # then closes, the next ZMTP heartbeat on it aborts the process, libzmq 4.3.5.)
        socket.setsockopt(zmq.RCVHWM, 0)
        if immediate:
            socket.setsockopt(zmq.IMMEDIATE, 1)
        if self._keys is not None:
            connect_keys(socket, self._keys)
        line = Line(socket, ConnectionWatch(socket))
        self._lines.append(line)
        socket.connect(self._endpoint)
        return line

    def _shut(self, line: Line[SocketT]) -> None:
        self._lines.remove(line)
        line.close()

    def reopen(self) -> None:
        """Close the socket and its watch (not the context) and open a fresh, watched one
        to the same endpoint: nothing still queued in the old one reaches the broker
        connected next. The fresh socket queues only on a connection that is up: a
        request sent while the broker is away (restarting) waits in its send window and
        fails there, never queued for a broker that starts after the client failed the
        request at its timeout (that broker would run it and answer a request nobody
        waits for)."""
        self._shut(self.current)
        self.current = self._open(immediate=True)

    def switch(self) -> None:
        """Leave the socket (its broker is stopping: protocol §11): keep it open for
        reading only, as :attr:`retiring` (closing the one that retired before, if any),
        and open a fresh, watched one to the same endpoint, which queues only on a
        connection that is up, as :meth:`reopen`'s does."""
        self.close_retiring()
        self.retiring = self.current
        self.current = self._open(immediate=True)

    def close_retiring(self) -> None:
        """Close the retiring socket and its watch, if any."""
        if self.retiring is not None:
            self._shut(self.retiring)
            self.retiring = None

    def close(self) -> None:
        """Close the sockets and their watches, and the context if the client made it
        (once; later calls do nothing)."""
        self._release()


#: ZMTP heartbeats on the client's connection: a broker that stops answering them (its
#: host gone, the process frozen) counts as a closed connection after the timeout.
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1000, 3000
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


_MONITORS = itertools.count()


class ConnectionWatch:
    """Heartbeats on a client's socket and a monitor of its connections: :meth:`lost`
    says when a connection that had completed its handshake closed (a peer refused at the
    handshake, by CURVE say, never counts).

    The monitor socket is of the client socket's own kind: an asyncio one for the
    asyncio twin, which polls it directly. (An asyncio shadow of a blocking monitor left
    its descriptor registered with the event loop once the monitor closed; a socket
    opened next with the same descriptor number was then never woken for.)"""

    def __init__(self, socket: zmq.Socket[Any]) -> None:
        socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        # A name of its own (an id() is reused once a dropped client is collected, while
        # its monitor's endpoint may still be bound).
        address = f"inproc://carpool-client-monitor-{next(_MONITORS)}"
        socket.monitor(address, _EVENTS)
        self.monitor: zmq.Socket[Any] = socket.context.socket(zmq.PAIR)
        self.monitor.connect(address)
        self._up = False

    def lost(self) -> bool:
        """Read the events waiting; True if a handshaken connection closed among them."""
        lost = False
        while True:
            try:
                frames = recv_frames(self.monitor, NOBLOCK)  # (either kind of socket)
            except zmq.Again:
                return lost
            event = int.from_bytes(frames[0].bytes[:2], "little")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up = True
            elif event == zmq.EVENT_DISCONNECTED and self._up:
                self._up = False
                lost = True

    def close(self) -> None:
        self.monitor.close(linger=0)


def release_socket(socket: zmq.Socket[Any], watch: ConnectionWatch) -> None:
    """Close one of a client's sockets and the watch of its connection."""
    socket.disable_monitor()
    watch.close()
    socket.close(linger=0)


def release_sockets(lines: list[Line[Any]], context: zmq.Context[Any], own_context: bool) -> None:
    """Close a client's sockets, and its context if the client made it: at ``close()``, or
    when a client dropped without ``close()`` is collected (a weakref finalizer). Left to
    pyzmq's own finalizers, a client collected in a cycle with its futures (a request
    still pending) would leave its socket open and block the collecting thread for ever in
    ``Context.term()``."""
    while lines:
        lines.pop().close()
    if own_context:
        context.term()


def send_within(
    socket: zmq.Socket[Any],
    frames: Sequence[Any],
    until_s: float,
    clock: Clock,
    stopping: Callable[[], bool],
) -> bool:
    """Send a message on a blocking socket, waiting for room at most until ``until_s``
    (or until ``stopping()``); False: not sent. (ZeroMQ queues up to its high-water mark,
    1,000 messages, for a broker that is away or not reading, and the reopened socket
    only on a connection that is up; a blocking send would wait for ever.)"""
    try:
        send_frames(socket, frames, NOBLOCK)
        return True
    except zmq.Again:
        pass
    while (left := until_s - clock.now()) > 0 and not stopping():
        # In slices: close() from another thread waits for this send to give up.
        if socket.poll(max(1, math.ceil(min(left, _RECHECK_S) * 1000)), zmq.POLLOUT):
            try:
                send_frames(socket, frames, NOBLOCK)
                return True
            except zmq.Again:
                continue
    return False


def flush(core: ClientCore, socket: zmq.Socket[Any], now: float) -> bool:
    """Send what the core has for the socket (requests sent again, CANCELs) while the
    socket takes it without waiting. True: some is left (poll for POLLOUT, then flush
    again). Either twin's socket: nothing here awaits."""
    while (frames := core.outgoing(now)) is not None:
        try:
            send_frames(socket, frames, NOBLOCK)
        except zmq.Again:
            return True
        core.took()
    return False


def close_core(core: ClientCore) -> None:
    """Let go of a closed client's shared memory: its region and the rings it read."""
    if core.arena is not None:
        core.arena.close()
    if core.reader is not None:
        core.reader.close()
