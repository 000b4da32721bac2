"""server.py: BrokerServer — the broker's sockets and loop around :class:`BrokerCore`.

The only I/O of the broker. One thread owns everything: the frontend ROUTER (clients), the
transports workers connect by (:mod:`carpool.broker.transports`: the backend ROUTER, a
unix socket for workers on this host, workers in this process), the trace writer, and a
``zmq.Poller`` whose timeout comes from the core's and the transports' next wake-up (no
fixed tick, no busy polling). Client sends use ROUTER_MANDATORY and DONTWAIT, so a
vanished or slow client is reported to the core instead of stalling the loop. New
connections on both ROUTERs pass the :class:`~carpool.broker.auth.Door` (ZAP). A message
that cannot be read, or a fault inside the core, is handled as faults.py says.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial

import zmq

from carpool.broker.auth import CLIENTS, WORKERS, BrokerAuth, Door, WorkerKeys
from carpool.broker.config import BrokerConfig
from carpool.broker.core import BrokerCore, Outgoing, Side, ToClient, ToWorker
from carpool.broker.faults import BrokerFault, Fault, FaultPolicy
from carpool.broker.frontend import Frontend
from carpool.broker.metrics import BrokerMetrics
from carpool.broker.requests import WorkerId
from carpool.broker.trace import TraceWriter, recorded_models
from carpool.broker.transports import BURST, Upstream, WorkerTransport
from carpool.broker.transports.inprocess import EmbeddedWorker, InProcessWorkers
from carpool.broker.transports.local import LinkWorkers
from carpool.broker.transports.zeromq import ZmqWorkers, bind_router
from carpool.common.clock import Clock, MonotonicClock, poll_timeout_ms
from carpool.common.errors import ConfigError
from carpool.common.protocol import FromWorker
from carpool.common.routing_ids import seed_routing_ids
from carpool.common.supervision import LoopWatch
from carpool.common.wake import WakePipe

logger = logging.getLogger(__name__)

__all__ = ["BURST", "BrokerFault", "BrokerServer", "EmbeddedWorker"]

#: How long the sockets may hold wind_down's last answers on close.
_STOP_LINGER_MS = 1000
# Enum members as globals, for speed: docs/benchmarks.md "Why the hot path looks as it does".
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
        self.core = BrokerCore(self.config)
        self.clock: Clock = clock or MonotonicClock()
        self.core.started_s = self.clock.now()
        # carpool record: admitted arrivals go to a JSON-lines trace, flushed every turn,
        # and the models of the last run wait at the door for their workers (holding.py).
        self._trace: TraceWriter | None = None
        if record:
            self.core.expect(recorded_models(record))
            self._trace = TraceWriter.for_clock(record, self.clock)
            self.core.intake.recording = []
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._stopping = False
        self._reload_asked = False  # ask_reload (SIGHUP): reload_keys on the next turn
        self._stops = 0  # stop() calls after the first: one ends wind_down's wait
        self._closed = False
        self.metrics: BrokerMetrics | None = None
        self._linger_ms = 0  # wind_down raises it: its answers must leave before close
        self._delivering = False  # running upstream.later
        self._faults = faults = FaultPolicy(self.core)
        self.transports: list[WorkerTransport] = []
        self.local: LinkWorkers | None = None
        config = self.config
        # Before the ROUTERs are made: each draws where its generated routing ids start.
        seed_routing_ids()
        # The door (auth.py) is bound before either socket; CURVE's keys are checked there.
        self.auth: BrokerAuth | None = None
        try:
            self._door = door = Door(self.context)
        except ConfigError:
            self._close_early(None)
            raise
        try:
            if config.curve.enabled:
                self.auth = BrokerAuth(door, config.curve)
            auth = self.auth
            self._frontend = Frontend(
                self.context, config, auth, faults.unreadable, self.core.stats, door
            )
        except ConfigError:
            self._close_early(door)
            raise
        self.frontend = self._frontend.socket
        try:  # Workers are not limited by max_frame_mib: an output over it would look
            # like a lost worker, and its batches would run again.
            backend = bind_router(
                self.context,
                config.backend,
                peer_heartbeat_s=config.peer_heartbeat_s,
                peer_timeout_s=config.peer_timeout_s,
                secure=partial(Door.guard, domain=WORKERS) if auth is None else auth.secure_backend,
            )
        except ConfigError:
            self._frontend.close(0)
            self._close_early(door)
            raise
        # stop() wakes a blocked poll from any thread or a signal handler.
        self._wake = WakePipe()
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        if self._frontend.monitor is not None:
            self.poller.register(self._frontend.monitor, zmq.POLLIN)
        self._later: list[Callable[[], None]] = []
        self._routes: dict[bytes, WorkerTransport] = {}
        up = Upstream(
            now=self.clock.now,
            on_worker=self._on_worker,
            send=self._send,
            knows=self._knows,
            unreachable=self._unreachable,
            routes=self._routes,
            later=self._later,
            unreadable=faults.unreadable,
        )
        # No ZeroMQ peer may take an id the other transports make, whether or not they
        # are in use here.
        reserved = (InProcessWorkers.id_prefix, LinkWorkers.id_prefix)
        keys = None if auth is None else WorkerKeys(self._knows, auth.failures)
        self._zmq = ZmqWorkers(backend, self.poller, up, reserved, keys=keys)
        if auth is not None:
            self.core.stats_gate = auth.is_operator
            # A request's origin (resends, CANCEL) is bound to its key, not its nonce alone.
            self.core.resends.key_of = auth.key_of
        self.backend = backend
        self.core.worker_transport = lambda wid: self._route(wid).label
        self.poller.register(self._wake.fd, zmq.POLLIN)
        self.poller.register(door.socket, zmq.POLLIN)
        self.transports.append(self._zmq)
        if embedded:
            inprocess = InProcessWorkers(embedded, self.poller, up)
            self.transports.append(inprocess)
            inprocess.start()
        if config.local_backend:
            try:
                self.local = LinkWorkers.listen(config, self.poller, up)
            except ConfigError:
                self.close()
                raise
            # The links before the embedded workers, as each turn has always handled them.
            self.transports.insert(1, self.local)
        if config.metrics:  # /metrics, /healthz, /readyz (broker/metrics.py)
            try:
                ready = lambda: not self._stopping  # noqa: E731 (one line's closure)
                self.metrics = BrokerMetrics(config.metrics, self.core, self._wake.wake, ready)
            except ConfigError:
                self.close()
                raise
        logger.info(
            "broker listening frontend=%s backend=%s%s",
            self.frontend_endpoint,
            self.backend_endpoint,
            f" local={config.local_backend}" if self.local else "",
        )

    def _close_early(self, door: Door | None) -> None:
        """What __init__ made before a ConfigError."""
        if door is not None:
            door.close()
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

    def _route(self, wid: bytes) -> WorkerTransport:
        return self._routes.get(wid) or self._zmq

    def _knows(self, wid: bytes) -> bool:
        return self.core.registry.get(WorkerId(wid)) is not None

    def _unreachable(self, wid: bytes) -> None:
        self._send(self.core.on_unreachable(self.clock.now(), _BACKEND, wid))

    @property
    def frontend_endpoint(self) -> str:
        return self._frontend.endpoint

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
        wait_ms = poll_timeout_ms(wait_s)
        for transport in transports:
            if transport.before_poll():
                wait_ms = 0  # whole messages wait in a buffer: no poll would say so
        events = dict(self.poller.poll(wait_ms))
        handled = 0
        door = self._door
        if door.socket in events:  # (handshakes: answered first)
            door.on_poll()
        frontend = self._frontend
        if frontend.socket in events:
            handled += self._drain_clients()
        # Connections opened and closed (the door reads them too, before it numbers a
        # connection; replies read them again before they leave): the monitor's queue
        # drained each turn.
        if frontend.monitor in events:
            frontend.refresh()
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
        if self._trace is not None and self.core.intake.recording:
            self._trace.write(self.core.intake.recording)
            self.core.intake.recording.clear()
        return handled

    def _drain_clients(self, limit: int | None = BURST) -> int:
        """The messages waiting on the frontend (at most ``limit``), each handed to the
        core (faults.py: a fault inside it is answered, or stops the broker)."""
        core, faults = self.core, self._faults
        on_client, changes = core.on_client, core.changes
        now = self.clock.now
        n = 0
        for client, frames in self._frontend.messages(limit):
            n += 1
            mark = changes()
            try:
                out = on_client(now(), client, frames[1:])
            except Exception as exc:
                out = faults.after_fault(now(), exc, mark, Side.FRONTEND, client, frames[1:])
            if out:
                self._send(out)
        if n:
            self._frontend.heard_s = now()
        return n

    def _on_worker(self, now: float, wid: bytes, msg: FromWorker) -> list[Outgoing]:
        """A worker's message, from any transport, handed to the core (faults.py)."""
        core = self.core
        mark = core.changes()
        try:
            return core.on_worker(now, wid, msg)
        except Exception as exc:
            return self._faults.after_fault(now, exc, mark, _BACKEND, wid, None)

    def _send(self, messages: list[Outgoing]) -> None:
        routes, backend = self._routes, self._zmq
        frontend = self._frontend
        fresh = False  # the monitor read since the last send to a client
        for msg in messages:
            if isinstance(msg, ToWorker):
                (routes.get(msg.identity) or backend).send(msg.identity, msg.message)
                continue
            if not fresh:  # a connection closed before this point gets nothing
                frontend.refresh()
                fresh = True
            if not frontend.deliver(msg.identity, msg.frames):  # (not reading, or gone)
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
        stop as :meth:`wind_down` says. ``watch`` is told of every turn (systemd). Close
        the server when it returns: the door's half-open connections close only with it.

        Raises:
            BrokerFault: a fault inside the core may have changed its state; the broker
                wound down first (faults.py).
        """
        self.core.loop_thread = threading.get_ident()  # (its stats are taken on this thread)
        try:
            while not self._stopping:
                self.step(None if watch is None else watch.turn(self.clock.now()))
        except Exception as exc:  # (a Fault is logged already: faults.py)
            if not isinstance(exc, Fault):
                self._faults.stop_for(exc)
            self._stopping = True
        if watch is not None:
            watch.stopping()
        self.wind_down()
        fatal = self._faults.fatal
        if fatal is not None:
            raise BrokerFault(f"stopped after a fault inside the core: {fatal!r}") from fatal

    def wind_down(self) -> None:
        """Stop without losing a request, as protocol.md §11 says: the door shut (new
        connections wait for the next broker), every client message read and answered
        (UNAVAILABLE, ``retry``), the grace for what runs (a second :meth:`stop` cuts it
        and the drain short), then DISCONNECT to workers, and the frontend read until its
        connections are quiet (``stop_quiet_s``; ``stop_drain_s`` at most), a last read
        (until empty, ``stop_quiet_s`` at most), and closed, lingering until its answers
        have left (closed, not unbound: libzmq's unbind drops them). A fault on the way
        stops the broker all the same (faults.py)."""
        if self.core.stopping:
            return
        self._stopping = True
        config, core, frontend = self.config, self.core, self._frontend
        self._door.close_to(CLIENTS, WORKERS)
        try:
            now = self.clock.now()
            until = now + config.stop_grace_s
            self._send(core.begin_stop(now, until, until + config.stop_drain_s))
            self._wait(lambda: until if core.inflight_batches or core.queued else None)
            now = self.clock.now()
            closes = now + config.stop_drain_s
            final = core.finish_stop(now, closes)
            route = self._route
            self._send([m for m in final if type(m) is ToClient or route(m.identity).hears_goodbye])
            quiet_s = config.stop_quiet_s

            def drain_until() -> float | None:  # (none open: nobody left to answer)
                open_now = frontend.open_count()
                return None if open_now == 0 else min(closes, frontend.heard_s + quiet_s)

            self._wait(drain_until)
            last_s = self.clock.now() + quiet_s
            while self._drain_clients() == BURST and self.clock.now() < last_s:
                pass  # (answered "stopping")
        except Exception as exc:
            if not isinstance(exc, Fault):
                self._faults.stop_for(exc)
        self._linger_ms = _STOP_LINGER_MS
        self.poller.unregister(self.frontend)
        self.frontend.close(linger=_STOP_LINGER_MS)

    def _wait(self, until: Callable[[], float | None]) -> None:
        """Run loop turns until the time ``until()`` says (None: not at all; asked again
        after each turn), a second :meth:`stop`, or a fault that stops the broker."""
        while not self._stops:
            end_s = until()
            left = 0.0 if end_s is None else end_s - self.clock.now()
            if left <= 0:
                return
            try:
                self.step(timeout_s=left)
            except Exception as exc:
                if not isinstance(exc, Fault):
                    self._faults.stop_for(exc)
                return

    @property
    def signal_fd(self) -> int:
        """A descriptor whose write wakes :meth:`serve`'s poll, for
        ``signal.set_wakeup_fd`` (a process's signal may land on any of its threads)."""
        return self._wake.write_fd

    def stop(self) -> None:
        """Ask :meth:`serve` to wind down and return (after the current turn; a second
        call cuts the waits short: for running batches, and for quiet clients)."""
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
        self._frontend.close(self._linger_ms)
        self._wake.close()
        self._door.close()
        if self._own_context:
            self.context.term()

    def __enter__(self) -> BrokerServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
