"""zeromq.py: ZmqWorkers — workers on the broker's backend ROUTER (``tcp://``, ``ipc://``).

Also :func:`bind_router`, the ROUTER both of the broker's ZeroMQ sides use. Sends use
ROUTER_MANDATORY and DONTWAIT, so a vanished or slow peer is reported
(:attr:`Upstream.unreachable`) instead of stalling the loop.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from carpool.broker.auth import WorkerKeys
from carpool.broker.replies import WorkerBound
from carpool.broker.transports import BURST, Events, Upstream
from carpool.common.errors import ConfigError
from carpool.common.peer_names import peer_tag
from carpool.common.protocol import decode_from_worker
from carpool.common.sockets import NOBLOCK, send_frames, waiting

logger = logging.getLogger(__name__)


def bind_router(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    *,
    max_frame_mib: int = 0,
    peer_heartbeat_s: float = 0.0,
    peer_timeout_s: float = 0.0,
    secure: Callable[[zmq.Socket[Any]], None] | None = None,
    prepare: Callable[[zmq.Socket[bytes]], None] | None = None,
) -> zmq.Socket[bytes]:
    """A ROUTER bound to ``endpoint``: ROUTER_MANDATORY, a send high-water mark of 10,000
    and no receive mark, no linger; frames over ``max_frame_mib`` (0: no limit) drop the
    connection; ZMTP heartbeats every ``peer_heartbeat_s`` (0: none) close a peer silent
    for ``peer_timeout_s``; ``prepare`` is called with the socket before it binds, and
    ``secure`` sets CURVE on it (:class:`carpool.broker.auth.BrokerAuth`).

    Raises:
        ConfigError: the endpoint is malformed or in use (the socket is closed).
    """
    sock = context.socket(zmq.ROUTER)
    if max_frame_mib:
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_mib << 20)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    # No receive mark. At one libzmq stops reading the connection; should the peer then
    # reset it, the next PING on it (ours, or one the peer sent behind the message that
    # met the mark) aborts the process (libzmq 4.3.5, stream_engine_base.cpp:310,
    # ``!_io_error``): any peer could stop the broker. The loop reads each socket as it
    # becomes readable, so what waits is what a peer sends faster than the broker reads.
    sock.setsockopt(zmq.RCVHWM, 0)
    if peer_heartbeat_s:  # peers that vanish (BrokerConfig)
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(peer_heartbeat_s * 1000)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(peer_timeout_s * 1000))
    if prepare is not None:
        prepare(sock)
    if secure is not None:
        secure(sock)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:  # a malformed endpoint, an address in use
        sock.close()
        raise ConfigError(f"cannot bind {endpoint!r}: {exc}") from None
    return sock


class ZmqWorkers:
    """Workers connected to the backend ROUTER.

    Args:
        router: the bound backend (:func:`bind_router`); closed by :meth:`close`.
        poller: the server's; the router joins it.
        upstream: the core and the server's sends.
        reserved: id prefixes of the other transports: a peer that sets such a routing id
            is not heard (none may speak as an embedded or local worker), and a message
            for such an id (a local worker whose link has just gone) is not sent here.
        keys: under CURVE, the key each worker id registered with: a message under that
            id with another key is not heard.
    """

    label = "zeromq"
    id_prefix = b""
    hears_goodbye = True

    def __init__(
        self,
        router: zmq.Socket[bytes],
        poller: zmq.Poller,
        upstream: Upstream,
        reserved: Sequence[bytes] = (),
        *,
        keys: WorkerKeys | None = None,
    ) -> None:
        self.router = router
        self.keys = keys
        self._up = upstream
        self._reserved = tuple(reserved)
        poller.register(router, zmq.POLLIN)

    @property
    def endpoint(self) -> str:
        return str(self.router.getsockopt_string(zmq.LAST_ENDPOINT))

    def next_wakeup(self, now: float) -> float | None:
        return None

    def before_poll(self) -> bool:
        return False  # libzmq writes on its own thread

    def on_poll(self, events: Events) -> int:
        router = self.router
        if router not in events:
            return 0
        up = self._up
        on_worker, send, now = up.on_worker, up.send, up.now
        reserved = self._reserved
        keys = self.keys
        unreadable = up.unreadable
        n = 0
        messages = waiting(router, BURST)
        while True:
            try:
                frames = next(messages, None)
            except zmq.ZMQError as exc:  # (receiving: a send below raises on its own)
                unreadable("backend", "receive", exc)
                return n
            if frames is None:
                return n
            n += 1
            try:
                identity = frames[0].bytes
                if reserved and identity.startswith(reserved):
                    logger.warning("a backend peer used a local worker's id: dropped")
                    continue
                if keys is not None and not keys.admit(identity, frames[0]):
                    continue
            except Exception as exc:  # the User-Id property, the key table
                unreadable("backend", "connection", exc)
                continue
            try:
                msg = decode_from_worker(frames[1:])
            except Exception as exc:  # (it answers WorkerMalformed: a bug if not)
                unreadable("backend", "decode", exc)
                continue
            out = on_worker(now(), identity, msg)
            if out:
                send(out)

    def send(self, wid: bytes, message: WorkerBound) -> None:
        reserved = self._reserved
        if reserved and wid.startswith(reserved):
            return  # a local worker's link dropped meanwhile: nobody to send to
        try:
            send_frames(self.router, message.to_frames(), NOBLOCK, wid)
        except zmq.Again:
            logger.warning("peer=%s on the backend is not reading; dropped", peer_tag(wid))
            self._up.unreachable(wid)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            logger.info("peer=%s on backend is gone", peer_tag(wid))
            self._up.unreachable(wid)

    def after_turn(self, now: float) -> None:
        pass

    def close(self, linger_ms: int) -> None:
        self.router.close(linger=linger_ms)
