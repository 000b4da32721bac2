"""local.py: LinkWorkers — workers on this host, over unix stream sockets (carpool.common.link).

Each accepted link is a worker, known by an id this transport makes (:data:`LINK_ID` and
a counter). A link lives while its worker is registered, or for the join window after it
connected (:class:`carpool.broker.joining.JoinWindow`). Sends write what the kernel takes
at once; the rest waits in the link and goes when the socket is writable (the poller then
watches for POLLOUT). A link that ends, or cannot take a message, is a lost worker; what
it sent before it went reaches the core first.
"""

from __future__ import annotations

import logging

import zmq

from carpool.broker.config import BrokerConfig
from carpool.broker.joining import JoinWindow
from carpool.broker.replies import WorkerBound
from carpool.broker.transports import BURST, Events, Upstream
from carpool.common.errors import ConfigError
from carpool.common.link import Link, LinkFull, LinkListener, TooLarge, link_path
from carpool.common.peer_names import peer_tag
from carpool.common.protocol import decode_from_worker

logger = logging.getLogger(__name__)

#: The start of a local worker's id (ZeroMQ never makes one: its ids are 5 bytes, a zero
#: byte and a counter).
LINK_ID = b"\x00link-"

_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_POLLERR = int(zmq.POLLERR)


class LinkWorkers:
    """The links of workers on this host, and the listener they connect to.

    Args:
        listener: the listening socket (closed by :meth:`close`).
        poller: the server's; the listener and every link join it.
        upstream: the core and the server's sends.
        window: which links must register by when (a fresh :class:`JoinWindow` by default).
    """

    label = "local"
    id_prefix = LINK_ID
    hears_goodbye = True

    def __init__(
        self,
        listener: LinkListener,
        poller: zmq.Poller,
        upstream: Upstream,
        window: JoinWindow | None = None,
    ) -> None:
        self._listener = listener
        self._poller = poller
        self._up = upstream
        self.window = window or JoinWindow()
        self._links: dict[bytes, Link] = {}
        self._ids: dict[int, bytes] = {}  # fd -> id
        self._linked = 0
        self._in_burst: bytes | None = None  # the link whose messages are being handled
        poller.register(listener.fileno(), zmq.POLLIN)

    @classmethod
    def listen(cls, config: BrokerConfig, poller: zmq.Poller, upstream: Upstream) -> LinkWorkers:
        """Listen at the configuration's ``local_backend`` (``unix:PATH``).

        Raises:
            ConfigError: no such ``local_backend_group``, or the path cannot be taken.
        """
        path = link_path(config.local_backend)
        assert path is not None  # BrokerConfig checked the scheme
        group = config.local_backend_group
        try:
            listener = LinkListener(path, group=group)
        except KeyError:
            raise ConfigError(f"local_backend_group {group!r}: no such group") from None
        except OSError as exc:
            raise ConfigError(f"local_backend {config.local_backend}: {exc}") from None
        return cls(listener, poller, upstream)

    @property
    def peers(self) -> list[bytes]:
        """The ids of the links open now."""
        return list(self._links)

    def next_wakeup(self, now: float) -> float | None:
        return self.window.next_due_s()

    def before_poll(self) -> bool:
        """Write what waits for local workers (a send writes what the kernel takes at
        once); poll for POLLOUT where some is left. True when a link holds whole messages
        already read (``Link.pending``): the poll must not wait."""
        pending = False
        for wid, link in list(self._links.items()):
            if not link.closed:  # (closed: a send found the worker gone since the last turn)
                pending = pending or link.pending
                if not link.wants_write:
                    continue
                link.flush()
            if link.closed:
                self._lost(wid, link, link.error or "closed")
            elif link.wants_write:
                self._poller.modify(link.fileno(), _POLLIN | _POLLOUT)
        return pending

    def on_poll(self, events: Events) -> int:
        if self._listener.fileno() in events:
            self._accept()
        up = self._up
        n = 0
        for fd, wid in list(self._ids.items()):
            flags = events.get(fd, 0)
            link = self._links.get(wid)  # a send above may have dropped it
            if link is None or not (flags or link.pending):
                continue
            if flags & _POLLOUT:
                link.flush()
            if flags & (_POLLIN | _POLLERR) or link.pending:
                on_worker, send, now = up.on_worker, up.send, up.now
                self._in_burst = wid
                try:
                    for frames in link.receive(BURST):
                        n += 1
                        try:
                            msg = decode_from_worker(frames)
                        except Exception as exc:  # (it answers WorkerMalformed: a bug if not)
                            up.unreadable("backend", "decode", exc)
                            continue
                        out = on_worker(now(), wid, msg)
                        if out:
                            send(out)
                            if wid not in self._links:
                                break  # dropped by that send: the rest is a lost worker's
                finally:
                    self._in_burst = None
                if wid not in self._links:
                    continue
                self.window.check(wid, up.knows)
            if link.closed:
                self._lost(wid, link, link.error or "the worker closed the link")
            elif not link.wants_write:
                self._poller.modify(link.fileno(), _POLLIN)
        return n

    def _accept(self) -> None:
        for new in self._listener.accept():
            self._linked += 1
            wid = LINK_ID + b"%d" % self._linked
            self._links[wid] = new
            self._ids[new.fileno()] = wid
            self._up.routes[wid] = self
            self.window.connected(wid, self._up.now())
            self._poller.register(new.fileno(), zmq.POLLIN)
            logger.info("a local worker connected (link %d, peer=%s)", self._linked, peer_tag(wid))

    def send(self, wid: bytes, message: WorkerBound) -> None:
        """Send to a local worker. A send that finds it gone closes the link; what the
        worker sent before (results still in the socket) reaches the core first, then
        the loss, at once (so no more batches go its way this turn, each spending an
        attempt of its requests). In the middle of that worker's own burst the rest of
        the burst comes first: :meth:`on_poll` ends the link after it."""
        link = self._links.get(wid)
        if link is None or link.closed:
            return
        try:
            link.send(message.to_frames())
        except LinkFull:
            logger.warning("local worker link %s is not reading; dropped", _name(wid))
            self._drop(wid, "not reading")
            return
        except TooLarge as exc:  # a batch the link cannot carry: the worker is lost
            logger.error("local worker link %s: %s; dropped", _name(wid), exc)
            self._drop(wid, str(exc))
            return
        if link.error is not None and wid != self._in_burst:  # the write found it gone
            self._lost(wid, link, link.error)

    def after_turn(self, now: float) -> None:
        """Close the links of workers the core has forgotten, so they do not hold a
        descriptor here, and those that did not register within the join window."""
        window = self.window
        for wid in window.forgotten(self._up.knows):
            self._drop(wid, "the broker forgot this worker")
        for wid in window.late(now):
            self._drop(wid, f"no READY within {window.within_s:g} s")

    def _lost(self, wid: bytes, link: Link, reason: str) -> None:
        """A link that ended: first what its worker sent before it went (results that a
        send to it, failing, left unread), then the loss (its batches are requeued)."""
        up = self._up
        for frames in link.leftovers():
            if wid not in self._links:
                return  # dropped meanwhile (a reply sent below failed for it)
            out = up.on_worker(up.now(), wid, decode_from_worker(frames))
            if out:
                up.send(out)
        self._drop(wid, reason)

    def _drop(self, wid: bytes, reason: str) -> None:
        self.window.gone(wid)
        link = self._links.pop(wid, None)
        if link is None:
            return
        self._up.routes.pop(wid, None)
        del self._ids[link.fileno()]
        self._poller.unregister(link.fileno())
        link.close()
        logger.info("local worker link %s closed: %s", _name(wid), reason)
        self._up.unreachable(wid)

    def close(self, linger_ms: int) -> None:
        for wid, link in self._links.items():
            self._up.routes.pop(wid, None)
            link.close()
        self._links.clear()
        self._ids.clear()
        self._listener.close()


def _name(wid: bytes) -> str:
    return wid[1:].decode()
