"""transports: the broker's connections to workers, one class per way a worker connects.

:class:`WorkerTransport` is what the server's loop sees of each: its wake-up time, a
write before the poll, what the poll found, a send to a worker by its id, the end of a
loop turn, and close. The implementations are :class:`~.zeromq.ZmqWorkers` (the backend
ROUTER), :class:`~.local.LinkWorkers` (unix stream sockets from workers on this host,
carpool.common.link) and :class:`~.inprocess.InProcessWorkers` (workers in the broker's
own process). Each owns its sockets and their place in the loop's poller, hands every
message it receives to :class:`Upstream` (the core, then the sends its answer makes),
typed by the one decoder of workers' messages (``decode_from_worker``), and reports a
worker it can no longer reach there.

A worker id is an opaque key: ZeroMQ makes 5-byte routing ids (a zero byte and a
counter); the other transports make ids with a prefix of their own
(:attr:`WorkerTransport.id_prefix`), which no ZeroMQ peer may use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from carpool.broker.replies import Outgoing, WorkerBound
    from carpool.common.protocol import FromWorker

#: The events of one poll, as ``dict(zmq.Poller.poll())`` gives them.
Events = Mapping[Any, int]
#: Messages taken from one socket before the loop looks at the others and at the clock.
BURST = 256


def _ignore(endpoint: str, kind: str, exc: BaseException) -> None:
    """(An Upstream without a server: nothing counts unreadable messages.)"""


@dataclass(slots=True)
class Upstream:
    """What a transport reports to: the broker's core and the server's sends.

    Attributes:
        now: the server's clock.
        on_worker: the core's handler of a worker's message (``BrokerCore.on_worker``),
            decoded by :func:`carpool.common.protocol.decode_from_worker`.
        send: the server's send of what the core answered (to any transport or client).
        knows: whether the core has this worker registered.
        unreachable: a worker this transport cannot reach any more (its link closed, it
            is not reading): the core loses it, and what that answers is sent.
        routes: the ids of workers on transports other than the default one (ZeroMQ):
            each transport adds its workers' ids when they connect and removes them when
            they go.
        later: deliveries a transport defers until the messages being sent are all
            sent (see :meth:`WorkerTransport.send`); the server runs them.
        unreadable: a message that could not be read (endpoint, kind, the exception):
            the transport drops it, and the server counts and logs it.
    """

    now: Callable[[], float]
    on_worker: Callable[[float, bytes, FromWorker], list[Outgoing]]
    send: Callable[[list[Outgoing]], None]
    knows: Callable[[bytes], bool]
    unreachable: Callable[[bytes], None]
    routes: dict[bytes, WorkerTransport]
    later: list[Callable[[], None]]
    unreadable: Callable[[str, str, BaseException], None] = _ignore


class WorkerTransport(Protocol):
    """A way workers connect to the broker, as the server's loop sees it."""

    #: What the STATS snapshot calls a worker on it ("zeromq", "local", "embedded").
    label: str
    #: The start of every id this transport makes; b"" for ZeroMQ's own.
    id_prefix: bytes
    #: Whether a worker on it is sent the broker's last DISCONNECT when it stops.
    hears_goodbye: bool

    def next_wakeup(self, now: float) -> float | None:
        """When :meth:`after_turn` or :meth:`on_poll` next has something to do (None:
        nothing on time)."""
        ...

    def before_poll(self) -> bool:
        """Write what waits. True when whole messages already read wait (the poll must
        not wait for them)."""
        ...

    def on_poll(self, events: Events) -> int:
        """Handle what the poll found: each message goes to :class:`Upstream`. Returns
        the number of messages handled."""
        ...

    def send(self, wid: bytes, message: WorkerBound) -> None:
        """Send one message to a worker: its frames (``message.to_frames()``) on a socket,
        the typed message (``message.to_message()``) to a worker in this process. One
        that finds it unreachable reports it to :attr:`Upstream.unreachable`; a worker not
        (or no longer) here is skipped."""
        ...

    def after_turn(self, now: float) -> None:
        """The end of a loop turn: close what the core has forgotten or what overstayed."""
        ...

    def close(self, linger_ms: int) -> None:
        """Close its sockets; ``linger_ms``: how long the last messages may still leave."""
        ...
