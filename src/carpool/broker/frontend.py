"""frontend.py: Frontend — the broker's ROUTER for clients, as a transport is for workers.

It owns the socket (:func:`~carpool.broker.transports.zeromq.bind_router`: behind the
door's ZAP domain, or CURVE; frames over ``max_frame_mib`` refused; ZMTP heartbeats) and
the table of its connections (:class:`~carpool.broker.connections.ClientConnections` and
its socket monitor). :meth:`Frontend.messages` reads what waits, each message with the
core's client id for it (the sender's key under CURVE, then its connection's token and
its routing id); one whose sender cannot be told (a message property libzmq does not
give, the connection table) is dropped and reported (``unreadable``: faults.py), never
handed on. A reply goes back by that id (:meth:`Frontend.deliver`): to the connection
the request came by, or nowhere once that has closed.
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq

from carpool.broker.auth import CLIENTS, KEY_CHARS, BrokerAuth, Door
from carpool.broker.config import BrokerConfig
from carpool.broker.connections import ClientConnections
from carpool.broker.stats import BrokerStats
from carpool.broker.transports import BURST
from carpool.broker.transports.zeromq import bind_router
from carpool.common.errors import ConfigError
from carpool.common.peer_names import peer_tag
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog
from carpool.common.sockets import NOBLOCK, send_frames, waiting

__all__ = ["Frontend"]

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
