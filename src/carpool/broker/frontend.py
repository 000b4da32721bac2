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
by its routing id *and* its connection. libzmq says when a connection opens
(``ACCEPTED``) and closes (``DISCONNECTED``), by descriptor, through a socket monitor,
and which descriptor a message came by (its ``SRCFD`` property). Descriptors are reused,
and a connection's last messages may be read after the monitor has said that it closed
and that another connection opened on its descriptor: the descriptor alone cannot tell
the two apart. So the door numbers the connections too: its answer to each handshake it
admits on the frontend carries the next connection number as a ZAP metadata property
(:data:`CONNECTION_PROPERTY`), which libzmq puts on every message of that connection.
:class:`ConnectionTable` gives each connection the monitor says opened a token no other
connection gets, and the lowest number it may carry (its *floor*): one more than the
numbers given when the table heard it open. The core's client id is ``token + routing
id`` (:meth:`ClientConnections.key`), and a reply whose token is no longer open is
dropped (:meth:`ClientConnections.reply_to`) and counted, never sent.

Ordering. libzmq's I/O thread emits ``ACCEPTED`` as it accepts a connection, before the
connection's handshake asks the door, and ``DISCONNECTED`` before it closes the
descriptor (so before the kernel can reuse it) and before it removes the connection's
routing id (so before another peer can take the id). The door reads the monitor before
it gives a number (:meth:`ClientConnections.admit`). A message with number ``n`` from
descriptor ``fd`` is taken for the connection the table has open on ``fd`` when that one
carries ``n`` or carries none yet and its floor is at most ``n``; otherwise its
connection has closed, and its reply is dropped. Why that never takes a closed
connection's message for a later one: a later connection on ``fd`` opened after the
first one closed, and its floor is above every number given before the table heard it
open; a number given after that cannot be the first one's, whose handshake could not
end once it had closed. A live connection is never mistaken for a closed one while the
door hears of each connection after the monitor does (libzmq with one I/O thread, as
the broker's own context has; with more, a connection whose handshake overtook its
``ACCEPTED`` would have its replies dropped, never misdelivered).

The server reads the monitor again just before it sends replies, so a connection that
closed before that point gets nothing. What remains is stated in docs/security.md: a
connection that closes in the microseconds between that read and the send.
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

__all__ = [
    "CONNECTION_PROPERTY",
    "TOKEN_BYTES",
    "ClientConnections",
    "ConnectionTable",
    "Frontend",
    "connection_number",
]

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
        door: the broker's ZAP handler, which numbers the clients' connections.

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
        door: Door,
    ) -> None:
        tracked = not config.frontend.startswith("inproc:")
        self.clients = clients = ClientConnections(context, tracked=tracked)
        if tracked:  # each handshake the door admits numbers its connection
            door.stamp(CLIENTS, clients.admit)
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
#: The ZAP metadata property (and so message property) that carries a frontend
#: connection's number: ``NUMBER_DIGITS`` lowercase hex digits, so that the numbers'
#: order is their strings' order.
CONNECTION_PROPERTY = "X-Connection"
NUMBER_DIGITS = 16
_NUMBER = CONNECTION_PROPERTY.encode()  # (a bytes name: no encoding a message)
_frame_get = zmq.Frame.get


def connection_number(n: int) -> str:
    """The property value of connection number ``n``."""
    return f"{n:0{NUMBER_DIGITS}x}"


def number_metadata(number: str) -> bytes:
    """A ZAP reply's metadata frame (ZMTP property encoding) carrying ``number``."""
    name, value = CONNECTION_PROPERTY.encode(), number.encode()
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


@dataclass(slots=True)
class _Connection:
    """One open connection (mutable: ``number`` is set by its first message read)."""

    token: bytes
    floor: str  # the lowest connection number it may carry
    number: str | None = None  # the number its messages carry; None: none read yet


class ConnectionTable:
    """Open connections by descriptor, each with a token of its own. Pure: the monitor's
    events, the door's numbers and the messages' descriptors and numbers come in."""

    def __init__(self) -> None:
        self._count = 0  # tokens made
        self._given = 0  # connection numbers the door has given
        self._open: dict[int, _Connection] = {}  # by descriptor
        #: Tokens of the connections open now.
        self.alive: set[bytes] = set()
        #: The open connections that have carried a number, by that number.
        self.numbered: dict[str, _Connection] = {}

    def __len__(self) -> int:
        return len(self._open)

    def admit(self) -> str:
        """The next connection number, for the door's answer to a handshake (the
        monitor's events up to now applied first)."""
        self._given += 1
        return connection_number(self._given)

    def apply(self, events: Sequence[tuple[int, int]]) -> None:
        """Apply monitor events ``(event, descriptor)`` in order."""
        for event, fd in events:
            if event == _ACCEPTED:
                self.open(fd)
            elif event == _DISCONNECTED:
                self._close(fd)

    def open(self, fd: int) -> bytes:
        """A connection opened on ``fd`` (closing one the monitor never said closed, not
        expected); returns its token."""
        self._close(fd)
        self._count += 1
        conn = _Connection(_TOKEN.pack(self._count), connection_number(self._given + 1))
        self._open[fd] = conn
        self.alive.add(conn.token)
        return conn.token

    def closed_token(self) -> bytes:
        """A token of its own for a message whose connection has closed (never open)."""
        self._count += 1
        return _TOKEN.pack(self._count)

    def _close(self, fd: int) -> None:
        conn = self._open.pop(fd, None)
        if conn is not None:
            self.alive.discard(conn.token)
            if conn.number is not None:
                del self.numbered[conn.number]

    def open_on(self, fd: int) -> _Connection | None:
        """The connection open on ``fd``, as far as the table has heard."""
        return self._open.get(fd)

    def token(self, fd: int, number: str) -> bytes | None:
        """The token of the connection a message with ``number`` from ``fd`` came by:
        the one open on ``fd`` when it may carry ``number`` (module docstring); None
        when that one may not (the message's connection has closed)."""
        conn = self._open.get(fd)
        if conn is None:
            return None
        if conn.number == number:
            return conn.token
        if conn.number is None and number >= conn.floor:
            conn.number = number
            self.numbered[number] = conn
            return conn.token
        return None


class ClientConnections:
    """The frontend's connections, heard through a socket monitor and numbered by the
    door (thin shell over :class:`ConnectionTable`).

    Args:
        context: where the monitor's inproc socket is made.
        tracked: False for a frontend on ``inproc://`` (clients in this process: no
            descriptors, no monitor events, no handshakes): every client is taken for
            one connection.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], *, tracked: bool = True) -> None:
        self._context = context
        self.tracked = tracked
        self._address = f"inproc://carpool-frontend-monitor-{id(self):x}"
        self.table = ConnectionTable()
        self.alive = self.table.alive
        self._numbered = self.table.numbered
        self.monitor: zmq.Socket[bytes] | None = None
        # Untracked, every client is taken for one connection, open for good.
        self._inproc = b"" if tracked else self.table.open(-1)
        #: The core's client id for a message (:meth:`key_by_connection`, or the one
        #: connection's when not tracked).
        self.key = self.key_by_connection if tracked else self._key_inproc

    def watch(self, frontend: zmq.Socket[bytes]) -> None:
        """Monitor ``frontend``'s connections; call it before the socket binds, so none
        opens unheard. The monitor's queue has no high-water mark: libzmq would drop
        events past it (each is small, and each loop turn reads them all). libzmq keeps
        one monitor a socket: another one started on the frontend would silence this
        one, and the messages of every connection opened after it would be taken for a
        closed connection's (their replies dropped)."""
        if not self.tracked:
            return
        frontend.monitor(self._address, _ACCEPTED | _DISCONNECTED)
        monitor = self._context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(self._address)
        self.monitor = monitor

    def refresh(self) -> None:
        """Read every event waiting on the monitor into the table."""
        monitor = self.monitor
        if monitor is None or not readable(monitor):
            return
        events: list[tuple[int, int]] = []
        while True:
            try:
                frames = recv_frames(monitor, NOBLOCK)
            except zmq.Again:
                break
            event, fd = _EVENT.unpack_from(frames[0].buffer)
            events.append((event, fd))
        self.table.apply(events)

    def admit(self) -> bytes:
        """The door's metadata for a handshake it admits: the connection's number, given
        after the monitor is read (module docstring, "Ordering")."""
        self.refresh()
        return number_metadata(self.table.admit())

    def _key_inproc(self, first: zmq.Frame) -> bytes:
        return self._inproc + first.bytes

    def key_by_connection(self, first: zmq.Frame) -> bytes:
        """The core's client id for a message whose routing-id frame is ``first``: the
        token of the connection it came by (by its number once an open connection has
        carried it; else by its descriptor and number, the monitor read first when the
        table does not have it), or a token never open when that connection has closed.
        Raises when the message lacks a property it reads."""
        number: str = _frame_get(first, _NUMBER)
        conn = self._numbered.get(number)
        if conn is not None:  # an open connection's (every message after its first)
            return conn.token + first.bytes
        fd = _frame_get(first, _SRCFD)
        table = self.table
        token = table.token(fd, number)
        if token is None:
            self.refresh()
            token = table.token(fd, number) or table.closed_token()
        return token + first.bytes

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
