"""server.py: WorkerServer — the worker's DEALER socket, its loop and one inference thread.

The main thread owns the DEALER to the broker, a PAIR socket that receives finished
batches from the inference thread, and a wake-up pipe; it keeps heartbeats flowing while a
long batch runs. The inference thread creates the engines (so a GPU context lives on the
thread that uses it), runs batches in order, and sends results back over the inproc PAIR.
No zmq socket is shared between threads.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import math
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import zmq

from carpool.common import codec
from carpool.common.clock import Clock, MonotonicClock
from carpool.common.errors import ConfigError, ErrorCode, ProtocolError
from carpool.common.link import MAX_FRAMES, Link, LinkFull, TooLarge, link_path
from carpool.common.protocol import ModelSpec
from carpool.common.shm import RegionReader
from carpool.common.sockets import NOBLOCK, send_frames, waiting
from carpool.common.wake import WakePipe
from carpool.worker.core import Answer, Reconnect, RunBatch, WorkerCore
from carpool.worker.engines.base import Engine
from carpool.worker.run import LazyRing, run_job, warm_up

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], Engine]

_STARTUP_TIMEOUT_S = 300.0
#: Batches of thread-free engines that have been taking less than this run on the loop
#: thread: the hand-off to the inference thread and back costs ~0.25 ms.
INLINE_MAX_S = 0.002
#: A worker refused (or dropped) within this long of joining waits before it joins again,
#: this long the first time, doubling up to the most (protocol §10.4, back-off).
_REJOIN_MIN_S = 1.0
#: How long close() waits for a running batch (a worker process; an embedded worker).
_CLOSE_WAIT_S = 25.0
_CLOSE_WAIT_EMBEDDED_S = 2.0
_REJOIN_MAX_S = 10.0


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


def _check_specs(specs: list[ModelSpec]) -> None:
    """Refuse, at start, a model the broker would refuse: its READY would be dropped as a
    protocol error, and the worker would try again for ever (a name over 256 characters,
    a rank over 8, more than 64 outputs).

    Raises:
        ConfigError: naming the model and what is wrong.
    """
    name = ""
    try:
        for spec in specs:
            name = spec.name
            ModelSpec.from_wire(spec.to_wire())
    except ProtocolError as exc:
        raise ConfigError(f"model {name!r} cannot be served: {exc}") from None


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
    ) -> None:
        if not models:
            raise ConfigError("a worker needs at least one model")
        if shm_output_group and shm_output_bytes > 0:
            _check_ring_group(shm_output_group)
        self.broker = broker
        try:
            self._link_path = link_path(broker)
        except ValueError as exc:
            raise ConfigError(f"broker endpoint: {exc}") from None
        self.link: Link | None = None
        self.clock: Clock = clock or MonotonicClock()
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._inproc = f"inproc://carpool-worker-{id(self):x}"
        self._results = self.context.socket(zmq.PAIR)
        self._results.setsockopt(zmq.LINGER, 0)
        self._results.bind(self._inproc)
        self._jobs: queue.Queue[RunBatch | None] = queue.Queue()
        # Shared-memory inputs (§5.4) and outputs (§5.5); used by whichever thread runs
        # a batch. The output ring is made when a client first asks for it.
        self._shm = RegionReader()
        self._ring = LazyRing(shm_output_bytes, shm_output_mode, shm_output_group)
        self._engines: dict[str, Engine] = {}
        # Smoothed engine time per sample, per model, for running short batches without
        # the hand-off (a batch's time is predicted from its size: a large batch of a fast
        # model is not short).
        self._run_ewma_s: dict[str, float] = {}
        self._startup: queue.Queue[list[ModelSpec] | BaseException] = queue.Queue()
        self._close_lock = threading.Lock()
        self._thread_done = False  # the inference thread has ended (under _close_lock)
        self._left_behind = False  # close() returned before it did (under _close_lock)
        self._thread = threading.Thread(
            target=self._inference_loop,
            args=(dict(models), warmup),
            name=f"carpool-inference-{name}",
            daemon=True,
        )
        self._thread.start()
        started = self._startup.get(timeout=_STARTUP_TIMEOUT_S)
        if isinstance(started, BaseException):
            self._thread.join()
            self._results.close()
            if self._own_context:
                self.context.term()
            raise started
        self.specs = started
        if self._link_path is not None:
            too_large = _too_large_for_a_link(started)
            if too_large:
                self._jobs.put(None)
                self._thread.join(timeout=30)
                self._results.close()
                if self._own_context:
                    self.context.term()
                raise ConfigError(too_large)
        self.core = WorkerCore(
            name, started, slots=slots, heartbeat_s=heartbeat_s, liveness=liveness
        )
        self._wake = WakePipe()  # stop() wakes a blocked poll
        self._stopping = False
        self._closed = False
        # Embedded in a broker's process (carpool.broker.server.BrokerServer(embedded=)):
        # no socket to the broker; messages to it wait here for the broker's loop.
        self._outbox: list[list[Any]] | None = [] if embedded else None
        self.core.local = embedded
        self._last_join_s = 0.0
        self._rejoin_at: float | None = None  # when to connect (say READY) again
        self._backoff_s = 0.0  # how long the last wait before connecting again was
        self.dealer: zmq.Socket[bytes] | None = None
        try:
            self.dealer = self._connect()
        except ConfigError:  # a malformed endpoint: nothing of this worker stays behind
            self.close(wait_s=5.0)
            raise

    # ------------------------------------------------------------------ sockets

    def _connect(self) -> zmq.Socket[bytes] | None:
        self._last_join_s = self.clock.now()
        self._rejoin_at = None
        if self._outbox is not None:  # embedded: say READY to the broker's core directly
            self._to_broker(self.core.on_connect(self._last_join_s))
            return None
        self._new_poller()
        if self._link_path is not None:
            self._link()
            return None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 1000)
        dealer.setsockopt(zmq.RCVHWM, 1000)
        try:
            dealer.connect(self.broker)
        except zmq.ZMQError as exc:  # a malformed endpoint (it was fine if this is again)
            dealer.close()
            raise ConfigError(f"cannot connect to {self.broker!r}: {exc}") from None
        self.poller.register(dealer, zmq.POLLIN)
        self.dealer = dealer
        first = self.core.epoch == 0
        self._to_broker(self.core.on_connect(self.clock.now()))
        # A ZeroMQ connect returns whether or not anyone listens: READY is queued, nothing
        # more is known. Said once; later attempts follow a "reconnecting" warning.
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "worker name=%s: READY sent to %s, waiting for a broker to answer",
            self.core.name,
            self.broker,
        )
        return dealer

    def _new_poller(self) -> None:
        """A poller for the inference thread's results and the wake pipe (a connection
        adds its socket)."""
        self.poller = zmq.Poller()
        self.poller.register(self._results, zmq.POLLIN)
        self.poller.register(self._wake.fd, zmq.POLLIN)

    def _link(self) -> None:
        """Connect to the broker's local endpoint. If nobody listens yet, READY is lost
        and the core's liveness check starts over (at most ``heartbeat_s * liveness``
        later), as it does for a broker that stopped answering."""
        assert self._link_path is not None
        try:
            self.link = Link.connect(self._link_path)
        except OSError as exc:
            self.link = None
            logger.warning("worker %s: no broker at %s (%s)", self.core.name, self.broker, exc)
        else:
            self.poller.register(self.link.fileno(), zmq.POLLIN)
            logger.info("worker %s connected to %s", self.core.name, self.broker)
        self._to_broker(self.core.on_connect(self.clock.now()))

    def _reconnect(self, reason: str) -> None:
        if self._outbox is not None:
            # Embedded: the broker's core refused us (DISCONNECT) or went silent. Say
            # READY again from service(), at most once a second: not in a loop with it.
            # Meanwhile what arrives is ignored and what finishes is dropped (a new epoch:
            # the broker has requeued those batches).
            logger.warning("embedded worker %s registering again: %s", self.core.name, reason)
            self._drop_queued()
            self.core.epoch += 1
            self._rejoin_at = self._last_join_s + 1.0
            return
        if self._rejoin_at is not None:
            return  # not connected: it connects at _rejoin_at
        logger.warning("worker %s reconnecting: %s", self.core.name, reason)
        self._drop_queued()
        self.core.epoch += 1  # what is still running answers nobody: the broker requeues it
        if self.dealer is not None:
            self.dealer.close(linger=0)
            self.dealer = None
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.clock.now() - self._last_join_s < _REJOIN_MIN_S:
            # Refused (or dropped) right after joining: back off, 1 s doubling up to 10 s,
            # rather than a new connection and READY a thousand times a second.
            self._backoff_s = min(_REJOIN_MAX_S, max(_REJOIN_MIN_S, 2 * self._backoff_s))
            self._rejoin_at = self._last_join_s + self._backoff_s
            self._new_poller()
            logger.warning("worker %s: connecting again in %.0f s", self.core.name, self._backoff_s)
            return
        self._backoff_s = 0.0
        self.dealer = self._connect()

    def _drop_queued(self) -> None:
        # Batches of the old connection not started yet would only delay the new ones: the
        # broker has requeued them (their results would be dropped anyway).
        dropped = 0
        with contextlib.suppress(queue.Empty):
            while True:
                self._jobs.get_nowait()
                dropped += 1
        self.core.on_batches_dropped(dropped)

    def _to_broker(self, frames: list[Any]) -> bool:
        if self._outbox is not None:
            self._outbox.append(frames)
            return True
        if self._link_path is not None:
            return self._to_link(frames)
        if self.dealer is None:
            return False  # waiting to connect again: heartbeats go nowhere meanwhile
        try:
            send_frames(self.dealer, frames, NOBLOCK)
        except zmq.Again:
            # The broker is not taking messages; liveness will notice and reconnect.
            logger.warning("worker %s: broker not reading, message dropped", self.core.name)
            return False
        return True

    def _to_link(self, frames: list[Any]) -> bool:
        link = self.link
        if link is None or link.closed:
            return False  # not connected: liveness starts over
        try:
            link.send(frames)  # what the socket does not take now: _flush_link, POLLOUT
        except LinkFull:
            logger.warning("worker %s: broker not reading, message dropped", self.core.name)
            return False
        except TooLarge as exc:
            logger.error("worker %s: message dropped: %s", self.core.name, exc)
            return False
        return True

    def _flush_link(self) -> bool:
        """Before the poll: write what waits. True when whole messages already read wait
        in the link's buffer (``Link.pending``): the poll must not wait."""
        link = self.link
        if link is None:
            return False
        if link.wants_write:
            link.flush()
            if link.closed:
                self._reconnect(f"the broker closed the link ({link.error})")
                return False
            if link.wants_write:
                self.poller.modify(link.fileno(), zmq.POLLIN | zmq.POLLOUT)
        return link.pending

    def _drain_link(self, flags: int) -> int:
        link = self.link
        assert link is not None
        n = 0
        if flags & zmq.POLLOUT:
            link.flush()
            if not link.wants_write:
                self.poller.modify(link.fileno(), zmq.POLLIN)
        if flags & (zmq.POLLIN | zmq.POLLERR) or link.pending:
            for frames in link.receive():
                n += 1
                if not self._on_broker(frames):
                    return n  # started over: the rest belonged to the old link
        if link.closed:
            self._reconnect(f"the broker closed the link ({link.error or 'end of stream'})")
        return n

    # ------------------------------------------------------------------ loop

    def step(self, timeout_s: float | None = None) -> int:
        """One loop turn: wait (bounded by ``timeout_s`` and the next heartbeat), handle
        broker messages and finished batches, send heartbeats. Returns messages handled."""
        now = self.clock.now()
        if self._rejoin_at is not None and now >= self._rejoin_at:
            self.dealer = self._connect()
        # Not connected (backing off): nothing is due but connecting again; the core's
        # heartbeats and its count of the broker's silence wait for the connection.
        waiting = self._rejoin_at is not None
        wake = self._rejoin_at if waiting else self.core.next_wakeup(now)
        wait_s = None if wake is None else wake - now
        if timeout_s is not None:
            wait_s = timeout_s if wait_s is None else min(wait_s, timeout_s)
        wait_ms = None if wait_s is None else max(0, math.ceil(wait_s * 1000))
        if self._flush_link():
            wait_ms = 0  # whole messages wait in the link's buffer: no poll would say so
        events = dict(self.poller.poll(wait_ms))
        handled = 0
        if self._results in events:
            handled += self._drain_results()
        if self.dealer in events:
            handled += self._drain_broker()
        link = self.link
        if link is not None and (link.fileno() in events or link.pending):
            handled += self._drain_link(events.get(link.fileno(), 0))
        if self._wake.fd in events:
            self._wake.clear()
        if waiting:
            return handled
        messages, reconnect = self.core.on_tick(self.clock.now())
        if messages:  # heartbeats: about once a second
            self._shm.sweep()
        for frames in messages:
            self._to_broker(frames)
        if reconnect is not None:
            self._reconnect(reconnect.reason)
        return handled

    def _drain_broker(self) -> int:
        n = 0
        dealer = self.dealer
        assert dealer is not None
        for frames in waiting(dealer):
            n += 1
            if not self._on_broker(frames):
                return n
        return n

    def _on_broker(self, frames: list[Any]) -> bool:
        """One message from the broker; False when the connection was started over."""
        action = self.core.on_broker(self.clock.now(), frames)
        if isinstance(action, RunBatch):
            inline = self._runs_inline(action)
            self.core.on_batch_queued(self.clock.now())
            if inline:
                header, out = run_job(self._engines, action, self.clock, self._shm, self._ring)
                return self._finish_job(header, out)
            self._jobs.put(action)
        elif isinstance(action, Answer):
            self._to_broker(action.frames)
        elif isinstance(action, Reconnect):
            self._reconnect(action.reason)
            return False
        return True

    # ------------------------------------------------------------------ embedded

    def deliver(self, frames: list[Any]) -> list[list[Any]]:
        """Embedded: a message from the broker's core; returns the messages for it (a
        short batch runs right here, on the broker's thread, and its RESULT comes back)."""
        assert self._outbox is not None, "not an embedded worker"
        if self._rejoin_at is None:  # else not registered: nothing is ours to answer
            self._on_broker(frames)
        return self.take_outbox()

    def service(self, results_ready: bool) -> list[list[Any]]:
        """Embedded, once per broker loop turn: finished batches of the inference thread
        (when its socket is readable) and heartbeats due; returns the messages for the
        broker's core."""
        assert self._outbox is not None, "not an embedded worker"
        if results_ready:  # always: a readable socket left unread would spin the broker
            self._drain_results()
        if self._rejoin_at is not None:
            if self.clock.now() < self._rejoin_at:
                self._outbox.clear()  # results of the old epoch: dropped already
                return []
            self._connect()
        messages, reconnect = self.core.on_tick(self.clock.now())
        if messages:
            self._shm.sweep()
        for frames in messages:
            self._to_broker(frames)
        if reconnect is not None:
            self._reconnect(reconnect.reason)
        return self.take_outbox()

    def next_wakeup(self, now: float) -> float | None:
        """Embedded: when :meth:`service` is next due (a heartbeat, or READY again)."""
        if self._rejoin_at is not None:
            return self._rejoin_at
        return self.core.next_wakeup(now)

    def take_outbox(self) -> list[list[Any]]:
        assert self._outbox is not None, "not an embedded worker"
        out, self._outbox = self._outbox, []
        return out

    @property
    def local_metas(self) -> bool:
        """Embedded: BATCH arrives as a BatchMeta and RESULT leaves as a ResultMeta (the
        broker's core and this worker's share the process: no msgpack in between)."""
        return self.core.local

    @property
    def results_socket(self) -> zmq.Socket[bytes]:
        """Readable when the inference thread has finished a batch (embedded: the broker
        polls it)."""
        return self._results

    def _runs_inline(self, job: RunBatch) -> bool:
        """Run a batch on this thread when that is safe and cheaper than the hand-off: the
        engine is not bound to its thread (TensorRT's CUDA context is), the inference thread
        is idle, and this model's batches have been short (heartbeats cannot be late)."""
        engine = self._engines.get(job.batch.model)
        return (
            engine is not None
            and not getattr(engine, "thread_bound", True)
            and self.core.idle_thread
            and self._run_ewma_s.get(job.batch.model, math.inf) * job.batch.total_samples
            < INLINE_MAX_S
        )

    def _drain_results(self) -> int:
        n = 0
        for parts in waiting(self._results):
            n += 1
            if not self._finish_job(codec.unpack(parts[0].buffer), parts[1:]):
                return n
        return n

    def _finish_job(self, info: dict[str, Any], frames: list[Any]) -> bool:
        """Report a finished batch to the broker; False if it had to reconnect."""
        now = self.clock.now()
        model = info.get("model")
        samples = info.get("samples")
        if isinstance(model, str) and isinstance(samples, int) and samples > 0:
            per_sample = (info["end"] - info["start"]) / samples
            last = self._run_ewma_s.get(model, per_sample)
            self._run_ewma_s[model] = last + 0.2 * (per_sample - last)
        if "error" in info:
            code, message = info["error"]
            msg = self.core.on_batch_failed(
                now,
                info["epoch"],
                info["batch"],
                info["start"],
                info["end"],
                ErrorCode(code),
                message,
            )
        else:
            msg = self.core.on_batch_done(
                now,
                info["epoch"],
                info["batch"],
                info["start"],
                info["end"],
                info["counts"],
                frames,
                timed=not info.get("untimed", False),
            )
        if msg is not None and not self._to_broker(msg):
            # A lost RESULT would hold its credit at the broker for good while heartbeats
            # still arrive: start over, so the broker requeues what this worker held.
            self._reconnect("a result could not be sent")
            return False
        return True

    def serve(self) -> None:
        """Loop until :meth:`stop`; then say DISCONNECT to the broker."""
        while not self._stopping:
            self.step()

    @property
    def signal_fd(self) -> int:
        """A descriptor whose write wakes :meth:`serve`'s poll, for
        ``signal.set_wakeup_fd`` (a process's signal may land on any of its threads)."""
        return self._wake.write_fd

    def stop(self) -> None:
        """Ask :meth:`serve` to return (safe from any thread or a signal handler)."""
        self._stopping = True
        self._wake.wake()

    # ------------------------------------------------------------------ inference thread

    def _inference_loop(self, factories: dict[str, EngineFactory], warmup: bool) -> None:
        engines: dict[str, Engine] = {}
        try:
            for name, factory in factories.items():
                engines[name] = factory()
                if warmup:
                    warm_up(engines[name], name)
            specs = [engine.info.spec(name) for name, engine in engines.items()]
            _check_specs(specs)
            self._engines = engines  # published to the loop thread by the startup queue
        except BaseException as exc:
            for engine in engines.values():
                engine.close()
            with self._close_lock:
                self._thread_done = True
            self._startup.put(exc)
            return
        self._startup.put(specs)
        sock = self.context.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._inproc)
        try:
            while (job := self._jobs.get()) is not None:
                header, frames = run_job(engines, job, self.clock, self._shm, self._ring)
                if self._closed:
                    continue  # closed while it ran: nobody reads results (nor would the
                    # send to the closed peer ever return)
                send_frames(sock, [codec.pack(header), *frames])
        finally:
            sock.close(linger=0)
            for engine in engines.values():
                engine.close()
            with self._close_lock:
                self._thread_done = True
                left_behind = self._left_behind
            if left_behind:  # close() returned while this batch ran: finish its work
                self._release()

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
        self._to_broker(self.core.on_stop())
        # Batches not started yet are dropped: the broker requeues them on DISCONNECT.
        with contextlib.suppress(queue.Empty):
            while True:
                self._jobs.get_nowait()
        self._jobs.put(None)
        if wait_s is None:
            wait_s = _CLOSE_WAIT_EMBEDDED_S if self._outbox is not None else _CLOSE_WAIT_S
        self._thread.join(timeout=wait_s)
        if self.dealer is not None:
            self.dealer.close(linger=100)  # give DISCONNECT a moment to leave
        if self.link is not None:
            self.link.flush()  # DISCONNECT, into the kernel's buffer if it takes it
            self.link.close()
        self._results.close(linger=0)
        self._wake.close()
        with self._close_lock:
            if not self._thread_done:
                # A batch still runs: it may still use the regions, and its results
                # socket keeps the context open (term() would wait for the batch). The
                # inference thread lets them go when it ends (or the process exits).
                self._left_behind = True
                logger.warning("worker %s: a batch still runs; not waiting", self.core.name)
                return
        self._release()

    def _release(self) -> None:
        self._shm.close()
        self._ring.close()
        if self._own_context:
            self.context.term()

    def __enter__(self) -> WorkerServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _too_large_for_a_link(specs: Sequence[ModelSpec]) -> str | None:
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
