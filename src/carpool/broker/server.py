"""server.py: BrokerServer — the broker's sockets and loop around :class:`BrokerCore`.

The only I/O of the broker. One thread owns everything: the frontend ROUTER (clients), the
transports workers connect by (:mod:`carpool.broker.transports`: the backend ROUTER, a
unix socket for workers on this host, workers in this process), the trace writer, and a
``zmq.Poller`` whose timeout comes from the core's and the transports' next wake-up (no
fixed tick, no busy polling). Client sends use ROUTER_MANDATORY and DONTWAIT, so a
vanished or slow client is reported to the core instead of stalling the loop.
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable, Sequence

import zmq

from carpool.broker.auth import KEY_CHARS, BrokerAuth, WorkerKeys
from carpool.broker.config import BrokerConfig
from carpool.broker.connections import ClientConnections
from carpool.broker.core import BrokerCore, Outgoing, Side, ToClient, ToWorker
from carpool.broker.metrics import BrokerMetrics
from carpool.broker.registry import WorkerId
from carpool.broker.trace import TraceWriter, recorded_models
from carpool.broker.transports import BURST, Upstream, WorkerTransport
from carpool.broker.transports.inprocess import EmbeddedWorker, InProcessWorkers
from carpool.broker.transports.local import LinkWorkers
from carpool.broker.transports.zeromq import ZmqWorkers, bind_router
from carpool.common.clock import Clock, MonotonicClock, wall_offset_s
from carpool.common.errors import ConfigError
from carpool.common.link import LinkListener, link_path
from carpool.common.peer_names import peer_tag
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog
from carpool.common.routing_ids import seed_routing_ids
from carpool.common.sockets import NOBLOCK, send_frames, waiting
from carpool.common.supervision import LoopWatch
from carpool.common.wake import WakePipe

logger = logging.getLogger(__name__)

__all__ = ["BURST", "BrokerServer", "EmbeddedWorker"]

#: How long the sockets may hold wind_down's last answers on close.
_STOP_LINGER_MS = 1000
# Read per message: on CPython 3.11 ``Enum.MEMBER`` costs ~85 ns a read, a global ~15.
_BACKEND = Side.BACKEND


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
        self.clock: Clock = clock or MonotonicClock()
        self.core.started_s = self.clock.now()
        # carpool record: admitted arrivals go to a JSON-lines trace, flushed every turn.
        # Trace times are Unix seconds (steady within a run): a file that several runs
        # append to stays in order with the real gaps between them, reboots included.
        self._trace: TraceWriter | None = None
        if record:
            # The models of the last run: requests for them wait at the door for their
            # workers in the grace window (holding.py).
            self.core.expect(recorded_models(record))
            offset_s = wall_offset_s() if isinstance(self.clock, MonotonicClock) else 0.0
            self._trace = TraceWriter(record, offset_s)
            self.core.recording = []
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._stopping = False
        self._reload_asked = False  # ask_reload (SIGHUP): reload_keys on the next turn
        self._stops = 0  # stop() calls after the first: one ends wind_down's wait
        self._closed = False
        self.metrics: BrokerMetrics | None = None
        self._linger_ms = 0  # wind_down raises it: its answers must leave before close
        self._delivering = False  # running upstream.later
        self._log_unread = RateLimitedLog(logger, PEER_LINES_PER_MIN)  # (peers cause these)
        self._log_gone = RateLimitedLog(logger, PEER_LINES_PER_MIN, level=logging.INFO)
        self.transports: list[WorkerTransport] = []
        self.local: LinkWorkers | None = None
        config = self.config
        # Before the ROUTERs are made: each draws where its generated routing ids start.
        seed_routing_ids()
        # Which connection each client message came by (reply routing, connections.py).
        tracked = not config.frontend.startswith("inproc:")
        self._clients = clients = ClientConnections(self.context, tracked=tracked)
        # CURVE (auth.py): the authenticator runs before either socket binds.
        self.auth: BrokerAuth | None = None
        try:
            if config.curve.enabled:
                self.auth = BrokerAuth(self.context, config.curve)
        except ConfigError:
            self._close_early()
            raise
        auth = self.auth
        try:
            # Clients are the untrusted side: a frame over the limit drops that connection
            # (libzmq refuses it before buffering). Workers are not limited: an output over
            # it would look like a lost worker, and its batches would run again.
            heartbeat_s, timeout_s = config.peer_heartbeat_s, config.peer_timeout_s
            self.frontend = bind_router(
                self.context,
                config.frontend,
                max_frame_mib=config.max_frame_mib,
                peer_heartbeat_s=heartbeat_s,
                peer_timeout_s=timeout_s,
                secure=None if auth is None else auth.secure_frontend,
                prepare=clients.watch,
            )
            try:
                backend = bind_router(
                    self.context,
                    config.backend,
                    peer_heartbeat_s=heartbeat_s,
                    peer_timeout_s=timeout_s,
                    secure=None if auth is None else auth.secure_backend,
                )
            except ConfigError:
                self.frontend.close()
                raise
        except ConfigError:
            self._close_early()
            raise
        self._frontend_endpoint = str(self.frontend.getsockopt_string(zmq.LAST_ENDPOINT))
        # stop() wakes a blocked poll from any thread or a signal handler.
        self._wake = WakePipe()
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        if clients.monitor is not None:
            self.poller.register(clients.monitor, zmq.POLLIN)
        self._later: list[Callable[[], None]] = []
        self._routes: dict[bytes, WorkerTransport] = {}
        up = Upstream(
            now=self.clock.now,
            on_worker=self.core.on_worker,
            send=self._send,
            knows=self._knows,
            unreachable=self._unreachable,
            routes=self._routes,
            later=self._later,
        )
        # No ZeroMQ peer may take an id the other transports make, whether or not they
        # are in use here.
        reserved = (InProcessWorkers.id_prefix, LinkWorkers.id_prefix)
        keys = None if auth is None else WorkerKeys(self._knows, auth.failures)
        self._zmq = ZmqWorkers(backend, self.poller, up, reserved, keys=keys)
        # The core's client id: the routing id, or under CURVE the key before it.
        self._client_key = clients.key if auth is None else auth.client_key(clients.key)
        if auth is not None:
            self.core.stats_gate = auth.is_operator
            # A request's origin (resends, CANCEL) is bound to its key, not its nonce alone.
            self.core.authenticated_key = auth.key_of
        self.backend = backend
        self.core.worker_transport = self._transport_label
        self.poller.register(self._wake.fd, zmq.POLLIN)
        self.transports.append(self._zmq)
        if embedded:
            inprocess = InProcessWorkers(embedded, self.poller, up)
            self.transports.append(inprocess)
            inprocess.start()
        if config.local_backend:
            path = link_path(config.local_backend)
            assert path is not None  # BrokerConfig checked the scheme
            group = config.local_backend_group
            try:
                listener = LinkListener(path, group=group)
            except KeyError:
                self.close()
                raise ConfigError(f"local_backend_group {group!r}: no such group") from None
            except OSError as exc:
                self.close()
                raise ConfigError(f"local_backend {config.local_backend}: {exc}") from None
            self.local = LinkWorkers(listener, self.poller, up)
            # The links before the embedded workers, as each turn has always handled them.
            self.transports.insert(1, self.local)
        if config.metrics:  # /metrics, /healthz, /readyz (broker/metrics.py)
            self.metrics = self._serve_metrics(config.metrics)
        logger.info(
            "broker listening frontend=%s backend=%s%s",
            self.frontend_endpoint,
            self.backend_endpoint,
            f" local={config.local_backend}" if self.local else "",
        )

    def _serve_metrics(self, address: str) -> BrokerMetrics:
        try:
            return BrokerMetrics(address, self.core, self._wake.wake, lambda: not self._stopping)
        except ConfigError:
            self.close()
            raise

    def _close_early(self) -> None:
        """What __init__ made before a ConfigError."""
        self._clients.close()
        if self.auth is not None:
            self.auth.close()
        if self._own_context:
            self.context.term()
        if self._trace is not None:  # (and its lock: a retry must be able to record)
            self._trace.close()

    def ask_reload(self) -> None:
        """Have the loop call :meth:`reload_keys` (from a signal handler or any thread)."""
        self._reload_asked = True
        self._wake.wake()

    def reload_keys(self) -> bool:
        """Read the CURVE allow-lists again (SIGHUP; :meth:`BrokerAuth.reload`). False
        when CURVE is off or a list could not be read (the current ones stay)."""
        return self.auth is not None and self.auth.reload()

    def _transport_label(self, wid: bytes) -> str:
        return (self._routes.get(wid) or self._zmq).label

    def _knows(self, wid: bytes) -> bool:
        return self.core.registry.get(WorkerId(wid)) is not None

    def _unreachable(self, wid: bytes) -> None:
        self._send(self.core.on_unreachable(self.clock.now(), _BACKEND, wid))

    @property
    def frontend_endpoint(self) -> str:
        return self._frontend_endpoint  # (read at bind: wind_down closes the socket)

    @property
    def backend_endpoint(self) -> str:
        return self._zmq.endpoint

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
        transports = self.transports
        for transport in transports:
            due = transport.next_wakeup(now)
            if due is not None and (wake is None or due < wake):
                wake = due
        wait_s = None if wake is None else wake - now
        if timeout_s is not None:
            wait_s = timeout_s if wait_s is None else min(wait_s, timeout_s)
        wait_ms = None if wait_s is None else max(0, math.ceil(wait_s * 1000))
        for transport in transports:
            if transport.before_poll():
                wait_ms = 0  # whole messages wait in a buffer: no poll would say so
        events = dict(self.poller.poll(wait_ms))
        handled = 0
        if self.frontend in events:
            handled += self._drain_clients()
        # Connections opened and closed: read after the messages that came before (a
        # message read after its connection's close and the reuse of its descriptor
        # could be taken for the newcomer's).
        if self._clients.monitor in events:
            self._clients.refresh()
        if self._wake.fd in events:
            self._wake.clear()
            if self._reload_asked:
                self._reload_asked = False
                self.reload_keys()
        for transport in transports:
            handled += transport.on_poll(events)
        now = self.clock.now()
        self._send(self.core.on_tick(now))
        for transport in transports:
            transport.after_turn(now)
        if self.metrics is not None:
            self.metrics.on_turn(now)
        if self._trace is not None and self.core.recording:
            self._trace.write(self.core.recording)
            self.core.recording.clear()
        return handled

    def _drain_clients(self) -> int:
        """The messages waiting on the frontend, each handed to the core."""
        on_client = self.core.on_client
        now = self.clock.now
        key = self._client_key  # the key (CURVE), the connection, the routing id
        n = 0
        for frames in waiting(self.frontend, BURST):
            n += 1
            out = on_client(now(), key(frames[0]), frames[1:])
            if out:
                self._send(out)
        return n

    def _send(self, messages: list[Outgoing]) -> None:
        routes, backend = self._routes, self._zmq
        keyed = self.auth is not None
        clients = self._clients
        fresh = False  # the monitor read since the last send to a client
        for msg in messages:
            if isinstance(msg, ToWorker):
                (routes.get(msg.identity) or backend).send(msg.identity, msg.message)
                continue
            if not fresh:  # a connection closed before this point gets nothing
                clients.refresh()
                fresh = True
            identity = clients.reply_to(msg.identity[KEY_CHARS:] if keyed else msg.identity)
            if identity is None:
                self.core.stats.departed += 1
                continue
            try:
                send_frames(self.frontend, msg.frames, NOBLOCK, identity)
            except zmq.Again:
                self._log_unread(
                    "peer=%s on %s is not reading; dropped", peer_tag(msg.identity), msg.side.value
                )
                self._send(self.core.on_unreachable(self.clock.now(), msg.side, msg.identity))
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                self._log_gone("peer=%s on %s is gone", peer_tag(msg.identity), msg.side.value)
                self._send(self.core.on_unreachable(self.clock.now(), msg.side, msg.identity))
        if self._later and not self._delivering:
            self._run_later()

    def _run_later(self) -> None:
        """Deliveries the transports deferred (embedded workers'), in order: what they
        answer may send more, which queues behind them instead of recursing."""
        self._delivering = True
        try:
            later = self._later
            while later:
                later.pop(0)()
        finally:
            self._delivering = False

    def serve(self, watch: LoopWatch | None = None) -> None:
        """Loop until :meth:`stop` is called (from any thread or a signal handler); then
        stop as :meth:`wind_down` says. ``watch`` is told of every turn (systemd)."""
        while not self._stopping:
            self.step(None if watch is None else watch.turn(self.clock.now()))
        if watch is not None:
            watch.stopping()
        self.wind_down()

    def wind_down(self) -> None:
        """Stop without losing a request (protocol.md §11). New requests are answered
        UNAVAILABLE "stopping" as they arrive, read as before; queued requests predicted
        to finish within ``stop_grace_s`` are still dispatched, the others answered
        UNAVAILABLE at once; batches at workers get the rest of the grace to finish (a
        second :meth:`stop` cuts it short). Then what is left is answered UNAVAILABLE,
        every worker is sent DISCONNECT, what arrived meanwhile is read and answered, and
        the frontend closes (lingering until its answers have left): new connections are
        refused, and each client's connection closes, so a client learns at once that a
        request it sent after the last read will not be answered. (Closing, not
        unbinding: libzmq's unbind closes the connections it accepted at once, dropping
        the answers still queued for them, so the answers of the grace would be lost.)"""
        if self.core.stopping:
            return
        self._stopping = True
        until = self.clock.now() + self.config.stop_grace_s
        self._send(self.core.begin_stop(self.clock.now(), until))
        core = self.core
        while (core.inflight_batches or core.queued) and not self._stops:
            left = until - self.clock.now()
            if left <= 0:
                break
            self.step(timeout_s=left)
        final = self.core.finish_stop(self.clock.now())
        routes, backend = self._routes, self._zmq
        self._send(
            [
                m
                for m in final
                if type(m) is ToClient or (routes.get(m.identity) or backend).hears_goodbye
            ]
        )
        self._linger_ms = _STOP_LINGER_MS
        self.frontend.setsockopt(zmq.LINGER, _STOP_LINGER_MS)
        self._drain_clients()  # answered "stopping" by the intake
        self.poller.unregister(self.frontend)
        self.frontend.close(linger=_STOP_LINGER_MS)

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
        if self.metrics is not None:
            self.metrics.close()
        for transport in reversed(self.transports):
            transport.close(self._linger_ms)
        self.frontend.close(linger=self._linger_ms)
        self._clients.close()
        self._wake.close()
        if self.auth is not None:
            self.auth.close()
        if self._own_context:
            self.context.term()

    def __enter__(self) -> BrokerServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
