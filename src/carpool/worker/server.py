"""server.py: WorkerServer — the worker's loop over its connection and inference thread.

The main thread owns the connection to the broker (``connection.py``: ZeroMQ, the local
unix link, or an outbox when embedded in the broker's process) and a wake-up pipe; it
polls them with the inference thread's pipe (``inference.py``), so heartbeats keep
flowing while a long batch runs. The policy (what to send, when to connect again, which
batches run on this thread) is ``WorkerCore``'s; this shell does the I/O it decides.
No zmq socket is shared between threads.
"""

from __future__ import annotations

import grp
import logging
import os
from collections.abc import Callable, Mapping

import zmq

from carpool.common.clock import Clock, MonotonicClock, poll_timeout_ms
from carpool.common.curve import ClientKeys
from carpool.common.errors import ConfigError
from carpool.common.link import link_path
from carpool.common.protocol import FromBroker, Telemetry, ToBroker, decode_from_broker
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog
from carpool.common.shm import RegionReader
from carpool.common.supervision import LoopWatch
from carpool.common.wake import WakePipe
from carpool.worker.connection import (
    BrokerConnection,
    InProcessConnection,
    LinkConnection,
    ZmqConnection,
    too_large_for_a_link,
)
from carpool.worker.core import (
    EMBEDDED_BACKOFF,
    Answer,
    Backoff,
    JobOutcome,
    Reconnect,
    RunBatch,
    WorkerCore,
)
from carpool.worker.engines.base import engines_busy_s
from carpool.worker.inference import START_TIMEOUT_S, EngineFactory, InferenceThread
from carpool.worker.metrics import WorkerMetrics
from carpool.worker.run import LazyRing, run_job
from carpool.worker.telemetry import TelemetrySampler

__all__ = ["EngineFactory", "WorkerServer"]

logger = logging.getLogger(__name__)

#: How long close() waits for a running batch (a worker process; an embedded worker).
_CLOSE_WAIT_S = 25.0
_CLOSE_WAIT_EMBEDDED_S = 2.0


def _check_ring_group(group: str) -> None:
    """The output ring's group exists and this process may give its files to it: found
    now, not when a client first asks for shared-memory outputs (the ring is made then;
    a misspelt group meant a warning in the log and outputs in frames)."""
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"shm_output_group {group!r}: no such group") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ConfigError(
            f"shm_output_group {group!r}: this process is not a member (give the worker's "
            "unit SupplementaryGroups= that group)"
        )


class WorkerServer:
    """A worker serving one or more models to one broker.

    Args:
        broker: the broker's backend endpoint, e.g. ``tcp://127.0.0.1:5556``, or its local
            one, ``unix:PATH`` (same host: a unix stream socket, carpool.common.link).
        models: model name → a factory that builds its engine (called on the inference
            thread, once, at start).
        name: worker name for logs and broker stats.
        slots: batches the broker may have outstanding here; 2 keeps the engine busy while
            the next batch is on its way.
        heartbeat_s, liveness: heartbeat interval and missed intervals before reconnecting.
        context, clock: injected zmq context and time source (tests).
        shm_output_bytes, shm_output_mode, shm_output_group: the shared-memory output
            ring (protocol §5.5), made when a client first asks; 0 bytes: never.
        embedded: run inside a broker's process (``BrokerServer(embedded=[...])``): no
            socket to the broker, which drives this worker through :meth:`deliver` and
            :meth:`service`; :meth:`serve` is not used.
        curve: CURVE keys for a ZeroMQ broker endpoint (the broker's public key, this
            worker's pair; :func:`carpool.common.curve.client_keys`); None: no CURVE.
        telemetry: takes a sample of the host and device for HEARTBEAT/RESULT (§8.2);
            None: :meth:`TelemetrySampler.detect` (NVML for the GPU CUDA names, a
            Jetson's sysfs, the host; the CUDA versions the GPU probe found).
        metrics: HOST:PORT of its Prometheus endpoint (docs/operations.md); "": none.
        start_timeout_s, starting: how long building and warming the engines may take,
            and what is told while they have not finished (:class:`InferenceThread`).

    Raises:
        ConfigError: a setting is invalid, or the engines did not start in time.
    """

    def __init__(
        self,
        broker: str,
        models: Mapping[str, EngineFactory],
        *,
        name: str = "worker",
        slots: int = 2,
        heartbeat_s: float = 1.0,
        liveness: int = 3,
        warmup: bool = True,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        clock: Clock | None = None,
        shm_output_bytes: int = 64 << 20,
        shm_output_mode: int = 0o600,
        shm_output_group: str | None = None,
        embedded: bool = False,
        curve: ClientKeys | None = None,
        telemetry: Callable[[], Telemetry] | None = None,
        metrics: str = "",
        start_timeout_s: float = START_TIMEOUT_S,
        starting: Callable[[float], None] | None = None,
    ) -> None:
        if not models:
            raise ConfigError("a worker needs at least one model")
        if shm_output_group and shm_output_bytes > 0:
            _check_ring_group(shm_output_group)
        self.broker = broker
        try:
            path = link_path(broker)
        except ValueError as exc:
            raise ConfigError(f"broker endpoint: {exc}") from None
        self.clock: Clock = clock or MonotonicClock()
        # Shared-memory inputs (§5.4) and outputs (§5.5); used by whichever thread runs
        # a batch. The output ring is made when a client first asks for it.
        self._shm = RegionReader()
        self._ring = LazyRing(shm_output_bytes, shm_output_mode, shm_output_group)
        self._inference = InferenceThread(
            models,
            name=name,
            warmup=warmup,
            clock=self.clock,
            reader=self._shm,
            rings=self._ring,
            start_timeout_s=start_timeout_s,
            starting=starting,
        )
        self.specs = self._inference.specs
        self._engines = self._inference.engines
        if path is not None and (too_large := too_large_for_a_link(self.specs)):
            self._inference.stop(30.0)
            self._inference.release_after(lambda: None)
            raise ConfigError(too_large)
        thread_free = [m for m, e in self._engines.items() if not getattr(e, "thread_bound", True)]
        self.core = WorkerCore(
            name,
            self.specs,
            slots=slots,
            heartbeat_s=heartbeat_s,
            liveness=liveness,
            backoff=EMBEDDED_BACKOFF if embedded else Backoff(),
            thread_free=thread_free,
            telemetry=telemetry or TelemetrySampler.detect(),
            busy_s=engines_busy_s(self._engines),
        )
        # Embedded in a broker's process (carpool.broker.server.BrokerServer(embedded=)):
        # no socket to the broker; messages to it wait in an outbox for the broker's loop.
        self._embedded = InProcessConnection() if embedded else None
        self._conn: BrokerConnection
        if self._embedded is not None:
            self._conn = self._embedded
        elif path is not None:
            self._conn = LinkConnection(broker, path, name)
        else:
            self._conn = ZmqConnection(broker, name, context, keys=curve)
        self._close_wait_s = _CLOSE_WAIT_EMBEDDED_S if embedded else _CLOSE_WAIT_S
        self._wake = WakePipe()  # stop() wakes a blocked poll
        self._results_fd = self._inference.wake_fd
        self.poller = zmq.Poller()
        self.poller.register(self._results_fd, zmq.POLLIN)
        self.poller.register(self._wake.fd, zmq.POLLIN)
        self._stopping = False
        self._closed = False
        self.metrics: WorkerMetrics | None = None  # /metrics, /healthz, /readyz
        self._log_unreadable = RateLimitedLog(logger, PEER_LINES_PER_MIN)
        self._log_fault = RateLimitedLog(logger, PEER_LINES_PER_MIN, level=logging.ERROR)
        try:
            if metrics:
                names = [spec.name for spec in self.specs]
                self.metrics = WorkerMetrics(metrics, self.core, self._wake.wake, names)
            self._connect()
        except ConfigError:  # a malformed endpoint: nothing of this worker stays behind
            self.close(wait_s=5.0)
            raise

    # ------------------------------------------------------------------ connection

    def _connect(self) -> None:
        self._conn.open(self.poller, self.core.on_connect(self.clock.now()))

    def _reconnect(self, reason: str) -> None:
        """The connection is lost: connect again now, or when the core's back-off says.
        Meanwhile what arrives is ignored and what finishes is dropped (a new epoch: the
        broker has requeued those batches)."""
        core = self.core
        if core.rejoining:
            return  # not connected: it connects at core.rejoin_at_s
        conn = self._conn
        logger.warning(conn.lost_log, core.name, reason)
        # Batches of the old connection not started yet would only delay the new ones: the
        # broker has requeued them (their results would be dropped anyway).
        core.on_batches_dropped(self._inference.drop_queued())
        at_once = core.on_lost(self.clock.now())
        conn.close()
        if at_once:
            self._connect()
        elif conn.wait_log is not None:
            logger.warning(conn.wait_log, core.name, core.backoff_s)

    # ------------------------------------------------------------------ loop

    def batches_waiting(self) -> int:
        """Batches handed to the inference thread and not started yet (diagnostics)."""
        return self._inference.waiting()

    def step(self, timeout_s: float | None = None) -> int:
        """One loop turn: wait (bounded by ``timeout_s`` and the next heartbeat), handle
        broker messages and finished batches, send heartbeats. Returns messages handled."""
        core = self.core
        now = self.clock.now()
        if core.rejoin_due(now):
            self._connect()
        # Backing off, nothing is due but connecting again: the core's heartbeats and its
        # count of the broker's silence wait for the connection.
        wake = core.next_wakeup(now)
        wait_s = None if wake is None else wake - now
        if timeout_s is not None:
            wait_s = timeout_s if wait_s is None else min(wait_s, timeout_s)
        wait_ms = poll_timeout_ms(wait_s)
        conn = self._conn
        if conn.flush():
            wait_ms = 0  # whole messages wait, read already: no poll would say so
        elif conn.lost is not None:
            self._reconnect(conn.lost)
        events = dict(self.poller.poll(wait_ms))
        handled = 0
        if self._results_fd in events:
            handled += self._drain_results()
        decode, known, cpu = decode_from_broker, core.batch_inputs, self.clock.cpu
        try:
            for frames in conn.receive(events):
                handled += 1
                cpu0 = cpu()
                try:
                    msg = decode(frames, known)
                except Exception as exc:  # (it answers BrokerMalformed: a bug if not)
                    self._unreadable("decode", exc)
                    continue
                try:
                    went_on = self._on_broker(msg, cpu0)
                except Exception as exc:
                    # A bug of ours: start over (a new connection, the broker requeues
                    # what it sent this one), so no half-done state outlives it.
                    self._log_fault("a fault on the broker's message (a bug)", exc_info=exc)
                    self._reconnect("a fault on the broker's message (a bug, logged)")
                    break
                if not went_on:
                    break  # started over: the rest belonged to the old connection
            else:
                if conn.lost is not None:
                    self._reconnect(conn.lost)
        except zmq.ZMQError as exc:
            self._unreadable("receive", exc)
        if self._wake.fd in events:
            self._wake.clear()
        self._tick()
        if self.metrics is not None:
            self.metrics.on_turn(self.clock.now())
        return handled

    def _unreadable(self, kind: str, exc: BaseException) -> None:
        """A message from the broker's side that could not be read: dropped, counted and
        logged (with its traceback the first time of each kind; rate-limited)."""
        counts = self.core.unreadable
        counts[kind] += 1
        self._log_unreadable(
            "a message from the broker could not be read (%s): %r; dropped",
            kind,
            exc,
            exc_info=exc if counts[kind] == 1 else None,
        )

    def _tick(self) -> None:
        messages, reconnect = self.core.on_tick(self.clock.now())
        if messages:  # heartbeats: about once a second
            self._shm.sweep()
        for beat in messages:
            self._conn.send(beat)
        if reconnect is not None:
            self._reconnect(reconnect.reason)

    def _on_broker(self, msg: FromBroker, cpu0: float) -> bool:
        """One message from the broker, whose decoding began at this thread's CPU time
        ``cpu0``; False when the connection was started over."""
        core = self.core
        action = core.on_broker(self.clock.now(), msg)
        if isinstance(action, RunBatch):
            inline = core.runs_inline(action)
            core.on_batch_queued(self.clock.now())
            action.cpu_s = self.clock.cpu() - cpu0
            if inline:
                outcome = run_job(self._engines, action, self.clock, self._shm, self._ring)
                return self._finish_job(outcome)
            self._inference.submit(action)
        elif isinstance(action, Answer):
            self._conn.send(action.message)
        elif isinstance(action, Reconnect):
            self._reconnect(action.reason)
            return False
        return True

    def _drain_results(self) -> int:
        n = 0
        for outcome in self._inference.finished():
            n += 1
            if not self._finish_job(outcome):
                self._inference.rewake()  # the rest: on the next turn, as stale
                return n
        return n

    def _finish_job(self, outcome: JobOutcome) -> bool:
        """Report a finished batch to the broker; False if it had to reconnect."""
        if self.metrics is not None:
            self.metrics.on_job(outcome)
        msg = self.core.on_job_done(self.clock.now(), outcome)
        if msg is not None and not self._conn.send(msg):
            # A lost RESULT would hold its credit at the broker for good while heartbeats
            # still arrive: start over, so the broker requeues what this worker held.
            self._reconnect("a result could not be sent")
            return False
        return True

    def serve(self, watch: LoopWatch | None = None) -> None:
        """Loop until :meth:`stop` (``watch`` told of every turn: systemd); closing then
        says DISCONNECT to the broker."""
        while not self._stopping:
            self.step(None if watch is None else watch.turn(self.clock.now()))
        if watch is not None:
            watch.stopping()

    @property
    def inference_alive(self) -> bool:
        """The inference thread still runs (it ends only when stopped)."""
        return self._inference.alive

    @property
    def signal_fd(self) -> int:
        """A descriptor whose write wakes :meth:`serve`'s poll, for
        ``signal.set_wakeup_fd`` (a process's signal may land on any of its threads)."""
        return self._wake.write_fd

    def stop(self) -> None:
        """Ask :meth:`serve` to return (safe from any thread or a signal handler)."""
        self._stopping = True
        self._wake.wake()

    # ------------------------------------------------------------------ embedded

    def _outbox(self) -> InProcessConnection:
        assert self._embedded is not None, "not an embedded worker"
        return self._embedded

    def deliver(self, message: FromBroker) -> list[ToBroker]:
        """Embedded: a message from the broker's core; returns the messages for it (a
        short batch runs right here, on the broker's thread, and its RESULT comes back)."""
        outbox = self._outbox()
        if not self.core.rejoining:  # else not registered: nothing is ours to answer
            self._on_broker(message, self.clock.cpu())
        return outbox.take()

    def service(self, results_ready: bool) -> list[ToBroker]:
        """Embedded, once per broker loop turn: finished batches of the inference thread
        (when :attr:`results_fd` is readable) and heartbeats due; returns the messages for
        the broker's core."""
        outbox = self._outbox()
        if results_ready:  # always: a readable pipe left unread would spin the broker
            self._drain_results()
        core = self.core
        if core.rejoining:
            if not core.rejoin_due(self.clock.now()):
                outbox.discard()  # results of the old epoch: dropped already
                return []
            self._connect()
        self._tick()
        return outbox.take()

    def next_wakeup(self, now: float) -> float | None:
        """Embedded: when :meth:`service` is next due (a heartbeat, or READY again)."""
        return self.core.next_wakeup(now)

    def take_outbox(self) -> list[ToBroker]:
        return self._outbox().take()

    @property
    def results_fd(self) -> int:
        """Readable when the inference thread has finished a batch (embedded: the broker
        polls it, and passes what it saw to :meth:`service`)."""
        return self._results_fd

    # ------------------------------------------------------------------ lifecycle

    def close(self, wait_s: float | None = None) -> None:
        """Say DISCONNECT (the broker requeues what this worker holds), then wait up to
        ``wait_s`` for a batch that is running, so that the engines close cleanly: 25 s by
        default (the worker unit's TimeoutStopSec is 30 s), 2 s for an embedded worker
        (its broker has stopped: the broker unit allows 10 s). A batch still running
        then is left to the process's exit, and so is what it uses."""
        if self._closed:
            return
        self._closed = True
        self._conn.send(self.core.on_stop())
        # Batches not started yet are dropped: the broker requeues them on DISCONNECT.
        self._inference.stop(self._close_wait_s if wait_s is None else wait_s)
        self._conn.shut()
        if self.metrics is not None:
            self.metrics.close()
        self._wake.close()
        if not self._inference.release_after(self._release):
            # A batch still runs: it may still use the regions. The inference thread lets
            # them go when it ends (or the process exits).
            logger.warning("worker %s: a batch still runs; not waiting", self.core.name)

    def _release(self) -> None:
        self._shm.close()
        self._ring.close()

    def __enter__(self) -> WorkerServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
