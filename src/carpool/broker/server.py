"""server.py: BrokerServer — the broker's sockets and loop around :class:`BrokerCore`.

The only I/O of the broker. One thread owns everything: two ROUTER sockets (clients on the
frontend, workers on the backend), optionally a unix socket that workers on this host
connect to (``local_backend``, carpool.common.link), and a ``zmq.Poller`` whose timeout
comes from ``core.next_wakeup`` (no fixed tick, no busy polling). Sends use
ROUTER_MANDATORY and DONTWAIT (links: a bounded queue), so a vanished or slow peer is
reported to the core instead of stalling the loop.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import stat
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol, TextIO

import zmq

from carpool.broker.config import BrokerConfig
from carpool.broker.core import EMBEDDED_ID, LINK_ID, BrokerCore, Outgoing, Side
from carpool.broker.registry import WorkerId
from carpool.common.clock import Clock, MonotonicClock, wall_offset_s
from carpool.common.errors import ConfigError
from carpool.common.link import Link, LinkFull, LinkListener, TooLarge, link_path
from carpool.common.sockets import NOBLOCK, send_frames, waiting
from carpool.common.wake import WakePipe

logger = logging.getLogger(__name__)

#: Messages taken from one socket before the loop looks at the other and at the clock.
BURST = 256
#: How long a local link may stay connected without saying READY (or after a refusal).
_JOIN_WITHIN_S = 10.0
#: How long the sockets may hold wind_down's last answers on close.
_STOP_LINGER_MS = 1000
# Read per message: on CPython 3.11 ``Enum.MEMBER`` costs ~85 ns a read, a global ~15.
_FRONTEND, _BACKEND = Side.FRONTEND, Side.BACKEND
# Routing ids of workers in this process and on the local endpoint (no zmq peer's).
_LOCAL_IDS = (EMBEDDED_ID, LINK_ID)


class EmbeddedWorker(Protocol):
    """A worker in the broker's own process (``carpool.worker.server.WorkerServer`` made
    with ``embedded=True``): messages pass as lists of frames, not through sockets, and a
    short batch runs on the broker's thread."""

    @property
    def results_fd(self) -> int:
        """Readable when the worker's inference thread has finished a batch."""
        ...

    @property
    def local_metas(self) -> bool:
        """BATCH and RESULT metas pass as BatchMeta / ResultMeta objects, not msgpack."""
        ...

    def deliver(self, frames: list[Any]) -> list[list[Any]]: ...

    def service(self, results_ready: bool) -> list[list[Any]]:
        """``results_ready``: ``results_fd`` was readable this turn."""
        ...

    def take_outbox(self) -> list[list[Any]]: ...

    def next_wakeup(self, now: float) -> float | None: ...


def _open_trace(path: str) -> TextIO:
    """The trace to append to.

    A regular file is locked for this broker (``flock``): two brokers appending to one
    trace at once would interleave parts of their lines. A recording that was cut (a
    kill, a full disk) can end in part of a line: that part is dropped, so the next
    run's lines are not glued to it and the file stays readable (only the cut line is
    lost); a last line that is whole but lacks its newline gets one. A pipe or
    ``/dev/stdout`` is appended to as it is.

    Raises:
        ConfigError: another process is recording to the same file.
    """
    trace = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
    try:
        if stat.S_ISREG(os.fstat(trace.fileno()).st_mode):
            try:
                fcntl.flock(trace.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConfigError(f"trace {path}: another broker is recording to it") from None
            except OSError as exc:  # (a file system without locks: NFS without lockd)
                logger.warning("trace %s: not locked: %s", path, exc)
            try:
                _end_on_a_whole_line(path)
            except OSError as exc:  # (a file this broker may write but not read)
                logger.warning("trace %s: its last line was not checked: %s", path, exc)
    except BaseException:
        trace.close()
        raise
    return trace


def _end_on_a_whole_line(path: str) -> None:
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(max(0, size - _TAIL_BYTES))
        tail = f.read()
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n") + 1
        if (cut == 0 and size > _TAIL_BYTES) or _parses(tail[cut:]):
            f.write(b"\n")  # a whole line (or one longer than any record: not ours to cut)
            return
        logger.warning(
            "trace %s ended in a line cut short (%d bytes): dropped", path, len(tail) - cut
        )
        f.truncate(size - len(tail) + cut)


def _parses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


#: How far back from its end a trace is searched for its last whole line.
_TAIL_BYTES = 64 * 1024


class BrokerServer:
    """Binds both ROUTERs on construction; ``step()`` runs one loop turn, ``serve()`` loops.

    Args:
        config: endpoints and batching settings; ``tcp://127.0.0.1:*`` picks a free port.
        context: the zmq context to use; by default the server owns a new one.
        clock: the time source handed to the core (a FakeClock in tests).
        record: append every admitted arrival to this JSON-lines trace.
        embedded: workers in this process (``WorkerServer(..., embedded=True)``); the
            caller owns and closes them, after the broker.
    """

    def __init__(
        self,
        config: BrokerConfig | None = None,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        clock: Clock | None = None,
        record: str | None = None,
        embedded: Sequence[EmbeddedWorker] = (),
    ) -> None:
        self.config = config or BrokerConfig()
        self.core = BrokerCore(self.config, defer_pumps=True)
        # carpool record: admitted arrivals go to a JSON-lines trace, flushed every turn.
        self._trace = _open_trace(record) if record else None
        # Trace times are Unix seconds (steady within a run): a file that several runs
        # append to stays in order with the real gaps between them, reboots included.
        self._trace_offset_s = 0.0
        if self._trace is not None:
            self.core.recording = []
        self.clock: Clock = clock or MonotonicClock()
        self.core.started_s = self.clock.now()
        if self._trace is not None and isinstance(self.clock, MonotonicClock):
            self._trace_offset_s = wall_offset_s()
        self._own_context = context is None
        self.context = context or zmq.Context()
        # Clients are the untrusted side: a frame over the limit drops that connection
        # (libzmq refuses it before buffering). Workers are not limited: an output over it
        # would look like a lost worker, and its batches would run again.
        self.frontend = self._router(self.config.frontend, self.config.max_frame_mib)
        self.backend = self._router(self.config.backend)
        # stop() wakes a blocked poll from any thread or a signal handler.
        self._wake = WakePipe()
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.backend, zmq.POLLIN)
        self.poller.register(self._wake.fd, zmq.POLLIN)
        # Embedded workers, by the routing id the core knows them by (zmq generates no
        # such id; a peer that sets one is refused in _drain).
        self._embedded = {EMBEDDED_ID + b"%d" % i: w for i, w in enumerate(embedded)}
        # Metas pass as objects, not msgpack, to the workers that take them so.
        self.core.local_workers = {wid for wid, w in self._embedded.items() if w.local_metas}
        self._local: deque[tuple[bytes, list[Any]]] = deque()  # (id, frames) to deliver
        self._delivering = False
        # Workers on this host over unix stream sockets: each link is a worker, known to
        # the core by a routing id zmq never generates (a peer that sets one is refused).
        self._listener: LinkListener | None = None
        self._links: dict[bytes, Link] = {}
        self._link_ids: dict[int, bytes] = {}  # fd -> routing id
        self._linked = 0
        # Links whose worker the core has registered: when the core forgets one (missed
        # heartbeats), its link is closed, and a worker that is still there connects anew.
        self._registered: set[bytes] = set()
        # Links that have not said READY yet, by when they connected: closed after
        # _JOIN_WITHIN_S (a peer that never does must not hold a descriptor and a buffer).
        self._unjoined: dict[bytes, float] = {}
        self._in_burst: bytes | None = None  # the link whose messages are being handled
        self._stopping = False
        self._stops = 0  # stop() calls after the first: one ends wind_down's wait
        self._closed = False
        self._linger_ms = 0  # wind_down raises it: its answers must leave before close
        for wid, worker in self._embedded.items():
            self.poller.register(worker.results_fd, zmq.POLLIN)
            for frames in worker.take_outbox():  # READY
                self._send(self.core.on_worker(self.clock.now(), wid, frames))
        if self.config.local_backend:
            path = link_path(self.config.local_backend)
            assert path is not None  # BrokerConfig checked the scheme
            group = self.config.local_backend_group
            try:
                self._listener = LinkListener(path, group=group)
            except KeyError:
                self.close()
                raise ConfigError(f"local_backend_group {group!r}: no such group") from None
            except OSError as exc:
                self.close()
                raise ConfigError(f"local_backend {self.config.local_backend}: {exc}") from None
            self.poller.register(self._listener.fileno(), zmq.POLLIN)
        logger.info(
            "broker listening frontend=%s backend=%s%s",
            self.frontend_endpoint,
            self.backend_endpoint,
            f" local={self.config.local_backend}" if self._listener else "",
        )

    def _router(self, endpoint: str, max_frame_mib: int = 0) -> zmq.Socket[bytes]:
        sock = self.context.socket(zmq.ROUTER)
        if max_frame_mib:
            sock.setsockopt(zmq.MAXMSGSIZE, max_frame_mib << 20)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        if self.config.peer_heartbeat_s:  # peers that vanish (BrokerConfig)
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(self.config.peer_heartbeat_s * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(self.config.peer_timeout_s * 1000))
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:  # a malformed endpoint, an address in use
            sock.close()
            frontend = getattr(self, "frontend", None)  # (the backend's bind failed)
            if frontend is not None:
                frontend.close()
            if self._own_context:
                self.context.term()
            if self._trace is not None:  # (and its lock: a retry must be able to record)
                self._trace.close()
            raise ConfigError(f"cannot bind {endpoint!r}: {exc}") from None
        return sock

    @property
    def frontend_endpoint(self) -> str:
        return str(self.frontend.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def backend_endpoint(self) -> str:
        return str(self.backend.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def local_endpoint(self) -> str:
        """Where workers on this host connect (``unix:PATH``); "" when there is none."""
        return self.config.local_backend

    # ------------------------------------------------------------------ loop

    def step(self, timeout_s: float | None = None) -> int:
        """Wait for work (at most ``timeout_s``, or until the core's next wake-up), then
        handle what arrived and what fell due. Returns the number of messages handled."""
        now = self.clock.now()
        wake = self.core.next_wakeup(now)
        for worker in self._embedded.values():
            due = worker.next_wakeup(now)
            if due is not None and (wake is None or due < wake):
                wake = due
        if self._unjoined:  # the first link that must have joined by then
            due = min(self._unjoined.values()) + _JOIN_WITHIN_S
            wake = due if wake is None else min(wake, due)
        wait_s = None if wake is None else wake - now
        if timeout_s is not None:
            wait_s = timeout_s if wait_s is None else min(wait_s, timeout_s)
        wait_ms = None if wait_s is None else max(0, math.ceil(wait_s * 1000))
        if self._links and self._flush_links():
            wait_ms = 0  # whole messages wait in a link's buffer: no poll would say so
        events = dict(self.poller.poll(wait_ms))
        handled = 0
        if self.frontend in events:
            handled += self._drain(self.frontend, _FRONTEND)
        if self.backend in events:
            handled += self._drain(self.backend, _BACKEND)
        if self._wake.fd in events:
            self._wake.clear()
        if self._listener is not None:
            handled += self._on_links(events)
        for wid, worker in self._embedded.items():
            for frames in worker.service(worker.results_fd in events):
                self._send(self.core.on_worker(self.clock.now(), wid, frames))
        self._send(self.core.on_tick(self.clock.now()))
        if self._registered:
            self._close_forgotten()
        if self._unjoined:
            self._close_unjoined()
        if self._trace is not None and self.core.recording:
            self._write_trace()
        return handled

    def _write_trace(self) -> None:
        trace, records = self._trace, self.core.recording
        if trace is None or records is None:
            return
        offset_s = self._trace_offset_s
        for t, model, shape, timeout_ms, priority, max_batch in records:
            line = {
                "t_s": round(t + offset_s, 6),
                "model": model,
                "shape": list(shape),
                "timeout_ms": timeout_ms,
                "priority": priority,
                "max_batch": max_batch,
            }
            trace.write(json.dumps(line) + "\n")
        records.clear()
        trace.flush()

    def _on_links(self, events: dict[Any, int]) -> int:
        listener = self._listener
        assert listener is not None
        if listener.fileno() in events:
            for new in listener.accept():
                self._linked += 1
                wid = LINK_ID + b"%d" % self._linked
                self._links[wid] = new
                self._link_ids[new.fileno()] = wid
                self._unjoined[wid] = self.clock.now()
                self.poller.register(new.fileno(), zmq.POLLIN)
                logger.info("a local worker connected (link %d)", self._linked)
        n = 0
        for fd, wid in list(self._link_ids.items()):
            flags = events.get(fd, 0)
            link = self._links.get(wid)  # a send above may have dropped it
            if link is None or not (flags or link.pending):
                continue
            if flags & zmq.POLLOUT:
                link.flush()
            if flags & (zmq.POLLIN | zmq.POLLERR) or link.pending:
                core = self.core
                now = self.clock.now
                self._in_burst = wid
                try:
                    for frames in link.receive(BURST):
                        n += 1
                        out = core.on_worker(now(), wid, frames)
                        if out:
                            self._send(out)
                            if wid not in self._links:
                                break  # dropped by that send: the rest is a lost worker's
                finally:
                    self._in_burst = None
                if wid not in self._links:
                    continue
                if wid not in self._registered and core.registry.get(WorkerId(wid)):
                    self._registered.add(wid)
                    self._unjoined.pop(wid, None)
            if link.closed:
                self._lost_link(wid, link, link.error or "the worker closed the link")
            elif not link.wants_write:
                self.poller.modify(link.fileno(), zmq.POLLIN)
        return n

    def _flush_links(self) -> bool:
        """Before the poll: write what waits for local workers (a send writes what the
        kernel takes at once); poll for POLLOUT where some is left. True when a link
        holds whole messages already read (``Link.pending``): the poll must not wait."""
        pending = False
        for wid, link in list(self._links.items()):
            if not link.closed:  # (closed: a send found the worker gone since the last turn)
                pending = pending or link.pending
                if not link.wants_write:
                    continue
                link.flush()
            if link.closed:
                self._lost_link(wid, link, link.error or "closed")
            elif link.wants_write:
                self.poller.modify(link.fileno(), zmq.POLLIN | zmq.POLLOUT)
        return pending

    def _close_unjoined(self) -> None:
        """Close the links that have not said READY within _JOIN_WITHIN_S of connecting
        (or were refused, and stayed)."""
        late = self.clock.now() - _JOIN_WITHIN_S
        for wid in [w for w, since in self._unjoined.items() if since <= late]:
            self._drop_link(wid, f"no READY within {_JOIN_WITHIN_S:g} s")

    def _close_forgotten(self) -> None:
        """Close the links of workers the core has forgotten (silent past their liveness,
        or gone on their own word), so they do not hold a descriptor here."""
        registry = self.core.registry
        for wid in [w for w in self._registered if registry.get(WorkerId(w)) is None]:
            self._drop_link(wid, "the broker forgot this worker")

    def _lost_link(self, wid: bytes, link: Link, reason: str) -> None:
        """A link that ended: first what its worker sent before it went (results that a
        send to it, failing, left unread), then the loss (its batches are requeued)."""
        for frames in link.leftovers():
            if wid not in self._links:
                return  # dropped meanwhile (a reply sent below failed for it)
            out = self.core.on_worker(self.clock.now(), wid, frames)
            if out:
                self._send(out)
        self._drop_link(wid, reason)

    def _drop_link(self, wid: bytes, reason: str) -> None:
        self._registered.discard(wid)
        self._unjoined.pop(wid, None)
        link = self._links.pop(wid, None)
        if link is None:
            return
        del self._link_ids[link.fileno()]
        self.poller.unregister(link.fileno())
        link.close()
        logger.info("local worker link %s closed: %s", wid[1:].decode(), reason)
        self._send(self.core.on_unreachable(self.clock.now(), _BACKEND, wid))

    def _drain(self, sock: zmq.Socket[bytes], side: Side) -> int:
        core = self.core
        handler = core.on_client if side is _FRONTEND else core.on_worker
        now = self.clock.now
        # A peer may set its own routing id: none may speak as an embedded or local worker,
        # now or later (zmq's own ids are 5 bytes: a zero byte and a counter).
        guard = side is _BACKEND
        n = 0
        for frames in waiting(sock, BURST):
            n += 1
            identity = frames[0].bytes
            if guard and identity.startswith(_LOCAL_IDS):
                logger.warning("a backend peer used a local worker's id: dropped")
                continue
            out = handler(now(), identity, frames[1:])
            if out:
                self._send(out)
        return n

    def _send(self, messages: list[Outgoing]) -> None:
        for msg in messages:
            if msg.side is _BACKEND:
                if msg.identity in self._embedded:
                    self._local.append((msg.identity, list(msg.frames)))
                    continue
                link = self._links.get(msg.identity)
                if link is not None:
                    self._send_link(msg.identity, link, msg.frames)
                    continue
                if msg.identity.startswith(_LOCAL_IDS):
                    continue  # a local worker's link dropped meanwhile: nobody to send to
            sock = self.frontend if msg.side is _FRONTEND else self.backend
            try:
                send_frames(sock, msg.frames, NOBLOCK, msg.identity)
            except zmq.Again:
                logger.warning(
                    "peer=%s on %s is not reading; dropped", msg.identity.hex(), msg.side
                )
                self._send(self.core.on_unreachable(self.clock.now(), msg.side, msg.identity))
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                logger.info("peer=%s on %s is gone", msg.identity.hex(), msg.side.value)
                self._send(self.core.on_unreachable(self.clock.now(), msg.side, msg.identity))
        if self._local:
            self._deliver_local()

    def _send_link(self, wid: bytes, link: Link, frames: Sequence[Any]) -> None:
        """Send to a local worker. A send that finds it gone closes the link; what the
        worker sent before (results still in the socket) reaches the core first, then
        the loss, at once (so no more batches go its way this turn, each spending an
        attempt of its requests). In the middle of that worker's own burst the rest of
        the burst comes first: ``_on_links`` ends the link after it."""
        if link.closed:
            return
        try:
            link.send(frames)
        except LinkFull:
            logger.warning("local worker link %s is not reading; dropped", wid[1:].decode())
            self._drop_link(wid, "not reading")
            return
        except TooLarge as exc:  # a batch the link cannot carry: the worker is lost
            logger.error("local worker link %s: %s; dropped", wid[1:].decode(), exc)
            self._drop_link(wid, str(exc))
            return
        if link.error is not None and wid != self._in_burst:  # the write found it gone
            self._lost_link(wid, link, link.error)

    def _deliver_local(self) -> None:
        """Messages for embedded workers, in order, one at a time: what they answer may
        send more (to sockets, or back here), without recursing."""
        if self._delivering:
            return
        self._delivering = True
        try:
            while self._local:
                wid, frames = self._local.popleft()
                for reply in self._embedded[wid].deliver(frames):
                    self._send(self.core.on_worker(self.clock.now(), wid, reply))
        finally:
            self._delivering = False

    def serve(self) -> None:
        """Loop until :meth:`stop` is called (from any thread or a signal handler); then
        stop as :meth:`wind_down` says."""
        while not self._stopping:
            self.step()
        self.wind_down()

    def wind_down(self) -> None:
        """Answer every queued request UNAVAILABLE at once and refuse new ones; give the
        batches at workers up to ``stop_grace_s`` to finish (a second :meth:`stop` cuts it
        short); answer what is left UNAVAILABLE and send every worker DISCONNECT. The
        sockets then linger a moment on close, so those answers leave."""
        if self.core.stopping:
            return
        self._stopping = True
        self._send(self.core.begin_stop(self.clock.now()))
        until = self.clock.now() + self.config.stop_grace_s
        while self.core.inflight_batches and not self._stops:
            left = until - self.clock.now()
            if left <= 0:
                break
            self.step(timeout_s=left)
        final = self.core.finish_stop(self.clock.now())
        self._send([m for m in final if m.identity not in self._embedded])
        self._linger_ms = _STOP_LINGER_MS

    @property
    def signal_fd(self) -> int:
        """A descriptor whose write wakes :meth:`serve`'s poll, for
        ``signal.set_wakeup_fd`` (a process's signal may land on any of its threads)."""
        return self._wake.write_fd

    def stop(self) -> None:
        """Ask :meth:`serve` to wind down and return (after the current turn; a second
        call ends the wait for running batches)."""
        if self._stopping:
            self._stops += 1
        self._stopping = True
        self._wake.wake()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._trace is not None:
            self._trace.close()
        for link in self._links.values():
            link.close()
        self._links.clear()
        if self._listener is not None:
            self._listener.close()
        self.frontend.close(linger=self._linger_ms)
        self.backend.close(linger=self._linger_ms)
        self._wake.close()
        if self._own_context:
            self.context.term()

    def __enter__(self) -> BrokerServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
