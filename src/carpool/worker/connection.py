"""connection.py: the worker's connection to its broker, one class per transport.

:class:`BrokerConnection` is what the worker's loop sees: open (with READY), send,
flush before a poll, receive after it, close (to connect again) and shut (for good).
:class:`ZmqConnection` is a DEALER to the broker's backend, :class:`LinkConnection` a
unix stream socket to its local endpoint (carpool.common.link), and
:class:`InProcessConnection` an outbox its broker's loop takes, for a worker embedded in
the broker's process. Each owns its socket and its place in the loop's poller. The
worker's messages come typed (``ToBroker``): a socket sends each one's frames
(``to_frames``, its one encoder), the in-process outbox the message itself; what arrives
on a socket is frames, which the loop decodes (``decode_from_broker``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import zmq

from carpool.common.curve import ClientKeys, connect_keys
from carpool.common.errors import ConfigError
from carpool.common.link import MAX_FRAMES, Link, LinkFull, TooLarge
from carpool.common.protocol import ModelSpec, ToBroker
from carpool.common.sockets import NOBLOCK, send_frames, waiting

logger = logging.getLogger(__name__)

_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_POLLERR = int(zmq.POLLERR)
#: How long a closing DEALER may hold DISCONNECT.
_SHUT_LINGER_MS = 100

#: The events of one poll, as ``dict(zmq.Poller.poll())`` gives them.
Events = Mapping[Any, int]


class BrokerConnection(Protocol):
    """A connection to the broker, as the worker's loop sees it."""

    #: The warning logged when it is lost, with the worker's name and why.
    lost_log: str
    #: The warning logged when the worker waits before connecting again (name, wait in
    #: seconds); None: not logged.
    wait_log: str | None

    def open(self, poller: zmq.Poller, ready: ToBroker) -> None:
        """Connect (anew), join ``poller``, and send ``ready`` (the READY message).

        Raises:
            ConfigError: the endpoint is malformed.
        """
        ...

    def send(self, message: ToBroker) -> bool:
        """Send one message now; False when it could not be (not connected, the broker
        not reading)."""
        ...

    def flush(self) -> bool:
        """Before a poll: write what waits. True when whole messages already read wait
        (the poll must not wait for them)."""
        ...

    def receive(self, events: Events) -> Iterable[list[Any]]:
        """After a poll: the messages from the broker (none if its socket was not in
        ``events``)."""
        ...

    @property
    def lost(self) -> str | None:
        """Why the broker's end has closed, once :meth:`flush` or :meth:`receive` found
        it so (and the messages received before it are handled): connect again."""
        ...

    def close(self) -> None:
        """Drop the connection and leave the poller (to connect again, or not)."""
        ...

    def shut(self) -> None:
        """Close for good, giving the last message sent (DISCONNECT) a moment to leave."""
        ...


class ZmqConnection:
    """A DEALER connected to the broker's backend (``tcp://``, ``ipc://``, ...).

    Args:
        endpoint: the broker's backend.
        name: the worker's name, for logs.
        context: the zmq context; None: its own, terminated by :meth:`shut`.
        keys: CURVE keys (the broker's public key, this worker's pair); None: no CURVE.
    """

    lost_log = "worker %s reconnecting: %s"
    wait_log: str | None = "worker %s: connecting again in %.0f s"
    lost: str | None = None  # a DEALER reconnects by itself: the core counts silence

    def __init__(
        self,
        endpoint: str,
        name: str,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        *,
        keys: ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.keys = keys
        self.name = name
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.socket: zmq.Socket[bytes] | None = None
        self._poller: zmq.Poller | None = None
        self._opened = 0

    def open(self, poller: zmq.Poller, ready: ToBroker) -> None:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 1000)
        # No receive mark: at one libzmq stops reading the connection, and if the peer
        # then resets it, a PING it sent behind the message that met the mark aborts the
        # process as the worker reads on (libzmq 4.3.5, ``!_io_error``). What waits is
        # what the broker sends: the batches its credits allow, and heartbeats.
        dealer.setsockopt(zmq.RCVHWM, 0)
        if self.keys is not None:
            connect_keys(dealer, self.keys)
        try:
            dealer.connect(self.endpoint)
        except zmq.ZMQError as exc:  # a malformed endpoint (a reconnect reuses one that worked)
            dealer.close()
            raise ConfigError(f"cannot connect to {self.endpoint!r}: {exc}") from None
        poller.register(dealer, zmq.POLLIN)
        self._poller = poller
        self.socket = dealer
        self.send(ready)
        # A ZeroMQ connect returns whether or not anyone listens: READY is queued, nothing
        # more is known. Said once; later attempts follow a "reconnecting" warning.
        logger.log(
            logging.INFO if self._opened == 0 else logging.DEBUG,
            "worker name=%s: READY sent to %s, waiting for a broker to answer",
            self.name,
            self.endpoint,
        )
        self._opened += 1

    def send(self, message: ToBroker) -> bool:
        dealer = self.socket
        if dealer is None:
            return False  # waiting to connect again: heartbeats go nowhere meanwhile
        try:
            send_frames(dealer, message.to_frames(), NOBLOCK)
        except zmq.Again:
            # The broker is not taking messages; liveness will notice and reconnect.
            logger.warning("worker %s: broker not reading, message dropped", self.name)
            return False
        return True

    def flush(self) -> bool:
        return False  # libzmq writes on its own thread

    def receive(self, events: Events) -> Iterable[list[Any]]:
        dealer = self.socket
        return waiting(dealer) if dealer is not None and dealer in events else ()

    def close(self) -> None:
        dealer, self.socket = self.socket, None
        if dealer is not None:
            if self._poller is not None:
                self._poller.unregister(dealer)
            dealer.close(linger=0)

    def shut(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=_SHUT_LINGER_MS)  # give DISCONNECT a moment to leave
            self.socket = None
        if self._own_context:
            self.context.term()


class LinkConnection:
    """A unix stream socket to the broker's local endpoint (carpool.common.link).

    If nobody listens when it opens, READY is lost and the core's liveness check starts
    over (at most ``heartbeat_s * liveness`` later), as it does for a broker that
    stopped answering. What the socket does not take at once waits in the link and is
    written when the socket is writable (the poller then watches for POLLOUT too).
    """

    lost_log = "worker %s reconnecting: %s"
    wait_log: str | None = "worker %s: connecting again in %.0f s"

    def __init__(self, endpoint: str, path: str, name: str) -> None:
        self.endpoint = endpoint
        self.path = path
        self.name = name
        self.link: Link | None = None
        self._fd = -1  # the link's, while it is registered in _poller
        self._poller: zmq.Poller | None = None
        self._lost: str | None = None

    @property
    def lost(self) -> str | None:
        return self._lost

    def open(self, poller: zmq.Poller, ready: ToBroker) -> None:
        self._poller = poller
        self._lost = None
        try:
            link = Link.connect(self.path)
        except OSError as exc:
            self.link = None
            logger.warning("worker %s: no broker at %s (%s)", self.name, self.endpoint, exc)
        else:
            self.link = link
            self._fd = link.fileno()
            poller.register(self._fd, zmq.POLLIN)
            logger.info("worker %s connected to %s", self.name, self.endpoint)
        self.send(ready)

    def send(self, message: ToBroker) -> bool:
        link = self.link
        if link is None or link.closed:
            return False  # not connected: liveness starts over
        try:
            link.send(message.to_frames())  # what the socket does not take now: flush(), on POLLOUT
        except LinkFull:
            logger.warning("worker %s: broker not reading, message dropped", self.name)
            return False
        except TooLarge as exc:
            logger.error("worker %s: message dropped: %s", self.name, exc)
            return False
        return True

    def flush(self) -> bool:
        """Write what waits; True when whole messages already read wait in the link's
        buffer (``Link.pending``)."""
        link = self.link
        if link is None:
            return False
        if link.wants_write:
            link.flush()
            if link.closed:
                self._lost = f"the broker closed the link ({link.error})"
                return False
            if link.wants_write:
                self._modify(zmq.POLLIN | zmq.POLLOUT)
        return link.pending

    def receive(self, events: Events) -> Iterable[list[Any]]:
        link = self.link
        if link is None:
            return ()
        flags = events.get(self._fd, 0)
        if not flags and not link.pending:
            return ()
        if flags & _POLLOUT:
            link.flush()
            if not link.wants_write:
                self._modify(zmq.POLLIN)
        messages: Sequence[list[Any]] = ()
        if flags & (_POLLIN | _POLLERR) or link.pending:
            messages = link.receive()
        if link.closed:
            self._lost = f"the broker closed the link ({link.error or 'end of stream'})"
        return messages

    def _modify(self, flags: int) -> None:
        if self._poller is not None:
            self._poller.modify(self._fd, flags)

    def close(self) -> None:
        self._lost = None
        link, self.link = self.link, None
        if link is not None:
            if self._poller is not None:
                self._poller.unregister(self._fd)
            link.close()

    def shut(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.flush()  # DISCONNECT, into the kernel's buffer if it takes it
            link.close()


class InProcessConnection:
    """A worker embedded in its broker's process: messages for the broker wait in an
    outbox that the broker's loop takes (``WorkerServer.deliver`` and ``service``), and
    the broker's messages arrive through ``deliver``, never through a poll."""

    lost_log = "embedded worker %s registering again: %s"
    wait_log: str | None = None
    lost: str | None = None

    def __init__(self) -> None:
        self._outbox: list[ToBroker] = []

    def open(self, poller: zmq.Poller, ready: ToBroker) -> None:
        self._outbox.append(ready)

    def send(self, message: ToBroker) -> bool:
        self._outbox.append(message)
        return True

    def flush(self) -> bool:
        return False

    def receive(self, events: Events) -> Iterable[list[Any]]:
        return ()

    def close(self) -> None:
        pass

    def shut(self) -> None:
        pass

    def take(self) -> list[ToBroker]:
        """The messages for the broker's core, oldest first; the outbox is then empty."""
        out, self._outbox = self._outbox, []
        return out

    def discard(self) -> None:
        """Drop what waits (results of an epoch that has passed)."""
        self._outbox.clear()


def too_large_for_a_link(specs: Sequence[ModelSpec]) -> str | None:
    """Why a model's full batch would not fit the local link's frame limit (a BATCH has a
    frame per request and input, a RESULT up to two plus one per output), or None."""
    for spec in specs:
        per_request = max(len(spec.inputs), 2 + len(spec.outputs))
        frames = 2 + spec.max_batch * per_request
        if frames > MAX_FRAMES:
            return (
                f"model {spec.name!r}: a batch of {spec.max_batch} takes up to {frames} "
                f"frames, over the local link's {MAX_FRAMES}; use a smaller max_batch or "
                "the broker's ZeroMQ backend"
            )
    return None
