"""frontend.py: Frontend — the broker's ROUTER for clients, as a transport is for workers.

It owns the socket (:func:`~carpool.broker.transports.zeromq.bind_router`: behind the
door's ZAP domain, or CURVE; frames over ``max_frame_mib`` refused; ZMTP heartbeats) and
the table of its connections (:class:`~carpool.broker.frontend.ClientConnections` and
its socket monitor). :meth:`Frontend.messages` reads what waits, each message with the
core's client id for it (the sender's key under CURVE, then its connection's token and
its routing id); one whose sender cannot be told (a message property libzmq does not
give, the connection table) is dropped and reported (``unreadable``: faults.py), never
handed on. A reply goes back by that id (:meth:`Frontend.deliver`): to the connection
the request came by, or nowhere once that has closed.

:class:`ClientConnections` tracks the client connection each frontend message came by,
so that a reply for a connection that has closed never reaches a later one under the
same routing id.

A ROUTER knows a peer only by its routing id, and a peer may choose its own: when a
client's connection closes, a newcomer can connect under its id and would receive the
replies to the requests the first one left behind. The broker therefore keys each client
by its routing id *and* its connection. libzmq says which connection a message came by
(the message's ``SRCFD`` property, the connection's socket descriptor) and, through a
socket monitor, when a connection opens (``ACCEPTED``) and closes (``DISCONNECTED``).
Descriptors are reused, so :class:`ConnectionTable` gives each connection it hears of a
token no other connection gets; the core's client id is ``token + routing id``
(:meth:`ClientConnections.key`), and a reply whose token is no longer open is dropped
(:meth:`ClientConnections.reply_to`) and counted, never sent.

Ordering. libzmq's I/O thread emits ``ACCEPTED`` before the connection can deliver a
message, and ``DISCONNECTED`` before it closes the descriptor (so before the kernel can
reuse it) and before it removes the connection's routing id (so before another peer can
take the id). Hence:

- a message from a descriptor the table knows open, under the routing id that connection
  has said (or its first), is taken for that connection. If that one has in fact closed
  and a newcomer sent the message on the reused descriptor, the reply is dropped when the
  monitor says so;
- a message from a descriptor the table does not know open, or under another routing id
  (a connection has one), makes the server read the monitor at once; if the descriptor
  changed meanwhile, the candidates are the connection open before and those opened
  since, and the message goes to the oldest one that may have sent it (one that has said
  nothing yet, or said this routing id); if nothing changed and the monitor said the
  connection on it closed (none opened since), the message came by that closed one, and
  its reply is dropped;
- the server reads the monitor after each loop turn's messages (not before them: a
  connection's last message read after both its close and the reuse of its descriptor
  would be taken for the newcomer's), and again just before it sends replies, so a
  connection that closed before that point gets nothing.

What remains is stated in docs/security.md: a connection that closes in the
microseconds between that read and the send, and a closed connection's one message read
after another connection on its descriptor has spoken.
"""

from __future__ import annotations

import errno
import logging
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from carpool.broker.auth import CLIENTS, KEY_CHARS, BrokerAuth, Door
from carpool.broker.config import BrokerConfig
from carpool.broker.stats import BrokerStats
from carpool.broker.transports import BURST
from carpool.broker.transports.zeromq import bind_router
from carpool.common.errors import ConfigError
from carpool.common.peer_names import peer_tag
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog
from carpool.common.sockets import NOBLOCK, readable, recv_frames, send_frames, waiting

__all__ = ["TOKEN_BYTES", "ClientConnections", "ConnectionTable", "Frontend"]

logger = logging.getLogger(__name__)


class Frontend:
    """The clients' ROUTER and its connections; see the module docstring.

    Args:
        context: the broker's context (its door runs on it).
        config: the endpoint, frame limit and heartbeats.
        auth: CURVE (None: the door's ZAP domain alone).
        unreadable: where a message that cannot be read is reported (endpoint, kind,
            the exception).
        stats: where the replies dropped for a closed connection are counted.

    Raises:
        ConfigError: the endpoint is malformed or in use.
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        config: BrokerConfig,
        auth: BrokerAuth | None,
        unreadable: Callable[[str, str, BaseException], None],
        stats: BrokerStats,
    ) -> None:
        tracked = not config.frontend.startswith("inproc:")
        self.clients = clients = ClientConnections(context, tracked=tracked)
        try:
            # Clients are the untrusted side: a frame over the limit drops that connection
            # (libzmq refuses it before buffering).
            self.socket = bind_router(
                context,
                config.frontend,
                max_frame_mib=config.max_frame_mib,
                peer_heartbeat_s=config.peer_heartbeat_s,
                peer_timeout_s=config.peer_timeout_s,
                secure=_guard_clients if auth is None else auth.secure_frontend,
                prepare=clients.watch,
            )
        except ConfigError:
            clients.close()
            raise
        #: Where clients connect (read at bind: the wind-down closes the socket).
        self.endpoint = str(self.socket.getsockopt_string(zmq.LAST_ENDPOINT))
        self.monitor = clients.monitor
        #: The core's client id for a message, from its routing-id frame.
        self.key = clients.key if auth is None else auth.client_key(clients.key)
        self._skip = 0 if auth is None else KEY_CHARS
        self._unreadable = unreadable
        self._stats = stats
        self._log_unread = RateLimitedLog(logger, PEER_LINES_PER_MIN)  # (peers cause these)
        self._log_gone = RateLimitedLog(logger, PEER_LINES_PER_MIN, level=logging.INFO)
        #: When a message was last read (the server sets it: the wind-down's quiet rule).
        self.heard_s = -math.inf

    def messages(self, limit: int | None = BURST) -> Iterator[tuple[bytes, list[zmq.Frame]]]:
        """What waits (at most ``limit``): each message's client id and frames (the
        routing id first); one that cannot be read is reported and skipped."""
        key, unreadable = self.key, self._unreadable
        try:
            for frames in waiting(self.socket, limit):
                try:
                    client = key(frames[0])
                except Exception as exc:  # SRCFD, User-Id, the connection table
                    unreadable("frontend", "connection", exc)
                    continue
                yield client, frames
        except zmq.ZMQError as exc:
            unreadable("frontend", "receive", exc)

    def refresh(self) -> None:
        """Read the connections opened and closed (the monitor's events)."""
        self.clients.refresh()

    def deliver(self, client: bytes, frames: Sequence[Any]) -> bool:
        """Send a reply to the core's client id ``client`` now, by the connection its
        request came by (:meth:`refresh` first); one whose connection has closed is
        dropped (``departed``). False: the client is not reading or is gone (logged)."""
        identity = self.clients.reply_to(client[self._skip :])
        if identity is None:
            self._stats.departed += 1
            return True
        try:
            send_frames(self.socket, frames, NOBLOCK, identity)
        except zmq.Again:
            self._log_unread("peer=%s on frontend is not reading; dropped", peer_tag(client))
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._log_gone("peer=%s on frontend is gone", peer_tag(client))
            return False
        return True

    def open_count(self) -> int | None:
        """Client connections open now (None: not counted, on ``inproc://``)."""
        return self.clients.open_count()

    def close(self, linger_ms: int) -> None:
        """Close the socket (its last answers may leave for ``linger_ms``), then the
        monitor: closed first, the monitor could block an event being sent."""
        self.socket.close(linger=linger_ms)
        self.clients.close()


def _guard_clients(sock: zmq.Socket[Any]) -> None:
    """Without CURVE: the frontend's new connections ask the door (auth.py)."""
    Door.guard(sock, CLIENTS)


_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_SRCFD = int(zmq.SRCFD)
_EVENT = struct.Struct("=HI")  # a monitor event's first frame: event (u16), value (u32)
_TOKEN = struct.Struct(">Q")
#: Bytes of the connection token in front of the routing id in a core client id.
TOKEN_BYTES = _TOKEN.size
_frame_get = zmq.Frame.get

#: A descriptor's connections during one read: (token, the routing id it has said or None).
Candidates = Sequence[tuple[bytes, bytes | None]]


@dataclass(slots=True)
class _Connection:
    """One open connection (mutable: ``said`` is set by its first message)."""

    token: bytes
    said: bytes | None = None  # the routing id its messages carry; None: none yet


class ConnectionTable:
    """Open connections by descriptor, each with a token of its own. Pure: the monitor's
    events and the messages' descriptors come in."""

    def __init__(self) -> None:
        self._count = 0
        self._open: dict[int, _Connection] = {}  # by descriptor
        #: Tokens of the connections open now.
        self.alive: set[bytes] = set()
        #: Descriptors whose last connection the monitor said closed (none open on them).
        self.closed_fds: set[int] = set()

    def __len__(self) -> int:
        return len(self._open)

    def _new(self, fd: int) -> _Connection:
        self._count += 1
        conn = self._open[fd] = _Connection(_TOKEN.pack(self._count))
        self.alive.add(conn.token)
        self.closed_fds.discard(fd)
        return conn

    def apply(
        self, events: Sequence[tuple[int, int]]
    ) -> dict[int, list[tuple[bytes, bytes | None]]]:
        """Apply monitor events ``(event, descriptor)`` in order; return, for each
        descriptor they touched, its candidates: the connection open on it before, then
        each one opened by these events, oldest first."""
        touched: dict[int, list[tuple[bytes, bytes | None]]] = {}
        for event, fd in events:
            if fd not in touched:
                before = self._open.get(fd)
                touched[fd] = [] if before is None else [(before.token, before.said)]
            if event == _ACCEPTED:
                if fd in self._open:  # a close the monitor never said (not expected)
                    self._close(fd)
                touched[fd].append((self._new(fd).token, None))
            elif event == _DISCONNECTED:
                self._close(fd)
        return touched

    def closed_token(self) -> bytes:
        """A token of its own for a connection that closed before the table heard of it."""
        self._count += 1
        return _TOKEN.pack(self._count)

    def _close(self, fd: int) -> None:
        conn = self._open.pop(fd, None)
        if conn is not None:
            self.alive.discard(conn.token)
            self.closed_fds.add(fd)

    def open_on(self, fd: int) -> _Connection | None:
        """The connection open on ``fd``, as far as the table has heard."""
        return self._open.get(fd)

    def token(self, fd: int, identity: bytes) -> bytes:
        """The connection open on ``fd``: a message from a descriptor the monitor said
        nothing about since the table last changed (a connection older than the monitor
        gets a token now)."""
        conn = self._open.get(fd)
        if conn is None:
            conn = self._new(fd)
        if conn.said is None:
            conn.said = identity
        return conn.token

    def choose(self, fd: int, identity: bytes, candidates: Candidates) -> bytes:
        """The connection a message from ``fd`` came by when the descriptor changed while
        it was read: the oldest candidate that may have sent it (said nothing yet, or said
        ``identity``); the newest when none may."""
        if not candidates:
            return self.closed_token()
        token = next(
            (t for t, said in candidates if said is None or said == identity),
            candidates[-1][0],
        )
        conn = self._open.get(fd)
        if conn is not None and conn.token == token and conn.said is None:
            conn.said = identity
        return token


class ClientConnections:
    """The frontend's connections, heard through a socket monitor (thin shell over
    :class:`ConnectionTable`).

    Args:
        context: where the monitor's inproc socket is made.
        tracked: False for a frontend on ``inproc://`` (clients in this process: no
            descriptors, no monitor events): every client is taken for one connection.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], *, tracked: bool = True) -> None:
        self._context = context
        self.tracked = tracked
        self._address = f"inproc://carpool-frontend-monitor-{id(self):x}"
        self.table = ConnectionTable()
        self.alive = self.table.alive
        self.monitor: zmq.Socket[bytes] | None = None
        # Untracked, every client is taken for one connection, open for good.
        self._inproc = b"" if tracked else self.table.token(-1, b"")
        #: The core's client id for a message (:meth:`key_by_connection`, or the one
        #: connection's when not tracked).
        self.key = self.key_by_connection if tracked else self._key_inproc

    def watch(self, frontend: zmq.Socket[bytes]) -> None:
        """Monitor ``frontend``'s connections; call it before the socket binds, so none
        opens unheard. The monitor's queue has no high-water mark: libzmq would drop
        events past it (each is small, and each loop turn reads them all)."""
        if not self.tracked:
            return
        frontend.monitor(self._address, _ACCEPTED | _DISCONNECTED)
        monitor = self._context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(self._address)
        self.monitor = monitor

    def refresh(self) -> dict[int, list[tuple[bytes, bytes | None]]]:
        """Read every event waiting on the monitor into the table; return the
        descriptors they touched, with their candidates (:meth:`ConnectionTable.apply`)."""
        monitor = self.monitor
        if monitor is None or not readable(monitor):
            return {}
        events: list[tuple[int, int]] = []
        while True:
            try:
                frames = recv_frames(monitor, NOBLOCK)
            except zmq.Again:
                break
            event, fd = _EVENT.unpack_from(frames[0].buffer)
            events.append((event, fd))
        return self.table.apply(events)

    def _key_inproc(self, first: zmq.Frame) -> bytes:
        return self._inproc + first.bytes

    def key_by_connection(self, first: zmq.Frame) -> bytes:
        """The core's client id for a message whose routing-id frame is ``first``: the
        token of the connection open on its descriptor, when the message may be that
        one's; otherwise (a connection the table has not heard open yet, or one that said
        another routing id) the monitor is read first."""
        fd = _frame_get(first, _SRCFD)
        identity = first.bytes
        conn = self.table.open_on(fd)
        if conn is not None:
            said = conn.said
            if said is None:
                conn.said = identity
                return conn.token + identity
            if said == identity:
                return conn.token + identity
        candidates = self.refresh().get(fd)
        if candidates is None:
            table = self.table
            if table.open_on(fd) is None and fd in table.closed_fds:
                # The monitor said the connection on it closed, and none opened since:
                # the message was read after its connection's close.
                return table.closed_token() + identity
            return table.token(fd, identity) + identity
        return self.table.choose(fd, identity, candidates) + identity

    def open_count(self) -> int | None:
        """How many client connections are open now (the monitor read first); None when
        not tracked (``inproc://``: no connections to count)."""
        if not self.tracked:
            return None
        self.refresh()
        return len(self.table)

    def reply_to(self, key: bytes) -> bytes | None:
        """The routing id to send a reply for client ``key`` to; None when the connection
        it came by has closed (call :meth:`refresh` first)."""
        if key[:TOKEN_BYTES] not in self.alive:
            return None
        return key[TOKEN_BYTES:]

    def close(self) -> None:
        """Close the monitor's socket; call it after the frontend is closed, which stops
        its monitor (a monitor stopped first could block on an event being sent)."""
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
