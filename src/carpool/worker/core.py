"""core.py: WorkerCore — the worker's side of the protocol as a pure state machine.

It decides what to send (READY, HEARTBEAT, RESULT, FAILED, DISCONNECT), when the broker
counts as lost and when to connect again (:class:`Backoff`), which batches run on the
loop thread rather than the inference thread (:meth:`WorkerCore.runs_inline`), and how
busy the engine has been (ρ: :class:`BusyMeter`, from the spans of the batches it ran,
unless the engines report their own busy time, :class:`~.engines.base.ReportedBusy`).
``now`` is always an argument; no sockets or threads here.
``server.py`` owns the connection to the broker, ``inference.py`` the inference thread.

Connection epochs: every (re)connection starts a new epoch, and so does every loss of
one. Batches received in an older epoch are finished but their results are dropped,
since the broker has already requeued them; this keeps "exactly one reply per request"
across reconnects.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    BatchInputCache,
    BatchMeta,
    BrokerBatch,
    BrokerDisconnect,
    BrokerHeartbeat,
    BrokerMalformed,
    FailedMeta,
    Frame,
    FromBroker,
    ModelSpec,
    Ready,
    ResultMeta,
    Telemetry,
    WorkerDisconnect,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerReady,
    WorkerResult,
)
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog
from carpool.worker.engines.base import ReportedBusy

logger = logging.getLogger(__name__)
#: Batches of thread-free engines predicted to take less than this run on the loop
#: thread, with no hand-off to the inference thread.
# speed: docs/benchmarks.md "Why the hot path looks as it does"
INLINE_MAX_S = 0.002
#: Weight of the newest batch in the smoothed engine time per sample.
_RUN_EWMA_WEIGHT = 0.2


class WorkerState(Enum):
    CONNECTING = "connecting"  # socket open, READY not yet sent
    READY = "ready"  # registered; batches may arrive
    STOPPED = "stopped"


@dataclass(slots=True)
class RunBatch:
    """Hand this batch to the inference thread. Not frozen, for speed:
    docs/benchmarks.md "Why the hot path looks as it does"."""

    epoch: int
    batch: BatchMeta
    frames: Sequence[Frame]
    cpu_s: float = 0.0  # the loop's CPU for it so far (its receipt; RESULT ``cpu_ms``)


@dataclass(frozen=True, slots=True)
class Reconnect:
    """Close the socket, open a new one, and send READY (MDP's rule after DISCONNECT)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Send this message to the broker (FAILED for a batch that could not be read)."""

    message: WorkerFailed


Action = RunBatch | Reconnect | Answer


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """A batch the engine has finished, as the thread that ran it reports it to the loop:
    its replies (``counts`` frames per request, in batch order), or ``error`` for the
    whole batch."""

    epoch: int  # the connection epoch the batch arrived in
    batch_id: int
    model: str
    start_s: float
    end_s: float
    counts: Sequence[int] = ()
    frames: Sequence[Any] = ()
    # Samples the engine ran as one batch: what runs_inline learns from (0: it did not).
    samples: int = 0
    # end_s - start_s is the batch's engine time (False: answered without the engine, or
    # run again request by request; the RESULT then says 0, which the broker ignores).
    timed: bool = True
    error: tuple[ErrorCode, str] | None = None
    # A padded model's batch: RESULT ``padding`` (§8.4), (padded, bucket) elements.
    padding: tuple[int, int] | None = None
    # The CPU its threads spent on it outside end_s - start_s, receipt included (RESULT
    # ``cpu_ms``, §8.4; sent only with ``timed``).
    cpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Backoff:
    """When to connect again after the connection is lost (protocol §10.4, back-off).

    Lost within ``min_s`` of joining (refused, or dropped at once): wait ``min_s`` after
    that join the first time, doubling on each such loss up to ``max_s``, rather than a
    new connection and READY a thousand times a second. Lost later: connect at once when
    ``at_once``, else ``min_s`` after the join.
    """

    min_s: float = 1.0
    max_s: float = 10.0
    at_once: bool = True


#: A worker in its broker's process: it says READY again from the broker's next turn, at
#: most once a second, never inside the turn that refused it (not in a loop with it).
EMBEDDED_BACKOFF = Backoff(min_s=1.0, max_s=1.0, at_once=False)


class BusyMeter:
    """ρ: the fraction of the last ``window_s`` the engine spent running batches.

    Finished batches are exact spans reported by the inference thread; a batch still
    running counts from ``running_since`` (when the idle thread was handed work). A running
    total of the spans in the window keeps ``rho`` cheap however many batches there are.
    """

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()
        self._total_s = 0.0  # summed length of the spans in _spans
        self.running_since: float | None = None

    def add(self, start: float, end: float) -> None:
        if end > start:
            self._spans.append((start, end))
            self._total_s += end - start

    def rho(self, now: float) -> float:
        begin = now - self.window_s
        spans = self._spans
        while spans and spans[0][1] <= begin:
            start, end = spans.popleft()
            self._total_s -= end - start
        busy = self._total_s
        if spans and spans[0][0] < begin:  # the oldest span straddles the window's start
            busy -= begin - spans[0][0]
        if spans and spans[-1][1] > now:  # reported with a later clock than ours
            busy -= spans[-1][1] - max(now, spans[-1][0])
        if self.running_since is not None:
            busy += max(0.0, now - max(self.running_since, begin))
        return min(1.0, max(0.0, busy / self.window_s))


class WorkerCore:
    """Protocol state of one worker serving ``specs``.

    Args:
        name: a human-readable worker name for logs and stats.
        specs: the models served.
        slots: batches the broker may have outstanding here (credits).
        heartbeat_s: heartbeat interval, announced to the broker.
        liveness: intervals of broker silence before reconnecting.
        rho_window_s: the window of ρ.
        backoff: when to connect again after the connection is lost.
        thread_free: the models whose engines may run on any thread (not TensorRT's,
            whose CUDA context is bound to the inference thread): their short batches
            may run on the loop thread.
        telemetry: takes a sample of the host and device (worker/telemetry); asked at
            heartbeat cadence, and the sample rides on the next HEARTBEAT or RESULT.
        busy_s: the engines' own busy seconds so far (CUDA-event time), where they
            report them: ρ is then their share of the window, not wall-clock batch time.
    """

    def __init__(
        self,
        name: str,
        specs: Sequence[ModelSpec],
        *,
        slots: int = 2,
        heartbeat_s: float = 1.0,
        liveness: int = 3,
        rho_window_s: float = 1.0,
        backoff: Backoff = Backoff(),
        thread_free: Iterable[str] = (),
        telemetry: Callable[[], Telemetry] | None = None,
        busy_s: Callable[[], float] | None = None,
    ) -> None:
        self.name = name
        self.specs = {s.name: s for s in specs}
        # BATCH input lists validated once each (the same few come in every batch).
        self.batch_inputs = BatchInputCache()
        self.slots = slots
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.meter = BusyMeter(rho_window_s)
        self.reported = ReportedBusy(busy_s, rho_window_s) if busy_s is not None else None
        self._telemetry = telemetry
        self.last_telemetry: Telemetry | None = None  # the latest sample sent
        self._next_sample_s = -math.inf
        self.state = WorkerState.CONNECTING
        self.registered = False  # the broker answered this connection's READY
        self.epoch = 0
        self._last_heard_s = 0.0
        self._next_heartbeat_s = 0.0
        self.batches_done = 0
        self.batches_failed = 0
        self._in_thread = 0  # batches handed to the inference thread, not yet finished
        self.backoff = backoff
        self.last_join_s = 0.0  # when the last connection started
        self.backoff_s = 0.0  # how long the last wait before connecting again was
        self.rejoin_at_s: float | None = None  # not connected: when to connect again
        self.thread_free = frozenset(thread_free)
        # Smoothed engine time per sample, per model: a batch's time is predicted from its
        # size (a large batch of a fast model is not short).
        self._run_ewma_s: dict[str, float] = {}
        #: Messages from the broker's side dropped, by kind: "receive" and "decode"
        #: (a fault while reading one: the shell counts those), "malformed" (one that
        #: breaks the protocol and names no batch: not a broker's word).
        self.unreadable: Counter[str] = Counter()
        # (A peer posing as the broker can send junk at any rate.)
        self._log_malformed = RateLimitedLog(logger, PEER_LINES_PER_MIN)

    # ------------------------------------------------------------------ connection

    def on_connect(self, now: float) -> WorkerReady:
        """A fresh socket is connected: returns the READY message."""
        self.last_join_s = now
        self.rejoin_at_s = None
        self.epoch += 1
        self.state = WorkerState.READY
        self.registered = False  # until the broker's first word on this connection
        self._last_heard_s = now
        self._next_heartbeat_s = now + self.heartbeat_s
        return WorkerReady(
            Ready(self.name, self.slots, tuple(self.specs.values()), round(self.heartbeat_s * 1000))
        )

    def on_broker(self, now: float, msg: FromBroker) -> Action | None:
        """A message from the broker (``decode_from_broker``'s, or the broker's own object
        in its process). Returns what the shell must do, if anything."""
        if isinstance(msg, BrokerMalformed):
            return self._on_malformed(now, msg)
        self._last_heard_s = now
        # Any word but DISCONNECT after READY: the broker has registered this worker (it
        # sends heartbeats and batches only to workers it holds).
        self.registered = not isinstance(msg, BrokerDisconnect)
        if isinstance(msg, BrokerBatch):
            return RunBatch(self.epoch, msg.batch, msg.payloads)
        if isinstance(msg, BrokerHeartbeat):
            return None
        return Reconnect(f"broker said DISCONNECT: {msg.reason}")

    def _on_malformed(self, now: float, msg: BrokerMalformed) -> Answer | None:
        """A message that breaks the protocol. One that names no batch is not a
        broker's word (what a peer posing as one sends): dropped, it neither keeps the
        connection alive nor says that the broker registered this worker. A BATCH it
        cannot read is answered FAILED, so the broker gets its credit back and replies
        to clients."""
        if msg.batch_id is None:
            self.unreadable["malformed"] += 1
            self._log_malformed("bad message from broker: %s; dropped", msg.error, now=now)
            return None
        self._last_heard_s = now
        self.registered = True
        self._log_malformed("bad BATCH from broker: %s", msg.error, now=now)
        failed = FailedMeta(msg.batch_id, ErrorCode.INVALID_ARGUMENT, msg.error, self.rho(now))
        return Answer(WorkerFailed(failed))

    def on_tick(self, now: float) -> tuple[list[WorkerHeartbeat], Reconnect | None]:
        """Heartbeats due, and whether the broker has gone silent for too long (nothing
        while waiting to connect again: the silence counts from the next READY)."""
        if self.state is not WorkerState.READY or self.rejoin_at_s is not None:
            return [], None
        if now - self._last_heard_s >= self.liveness * self.heartbeat_s:
            return [], Reconnect("broker silent for too long")
        out = []
        if now >= self._next_heartbeat_s:
            self._next_heartbeat_s = now + self.heartbeat_s
            beat = WorkerHeartbeat(round(self.rho(now), 4), self.busy_ms(now), self._sample(now))
            out.append(beat)
        return out, None

    def rho(self, now: float) -> float:
        """ρ over the last window: from the engines' own busy seconds where they report
        them, else from the wall-clock spans of the batches the worker ran."""
        return self.reported.rho(now) if self.reported is not None else self.meter.rho(now)

    def _sample(self, now: float) -> Telemetry | None:
        """A telemetry sample, once per heartbeat interval (None between)."""
        if self._telemetry is None or now < self._next_sample_s:
            return None
        self._next_sample_s = now + self.heartbeat_s
        self.last_telemetry = self._telemetry()
        return self.last_telemetry

    def busy_ms(self, now: float) -> int:
        """How long the inference thread has been running its current batch (0: idle):
        what HEARTBEAT reports, so that the broker can tell a wedged engine from a live
        loop (docs/protocol.md §10.6)."""
        since = self.meter.running_since
        if self._in_thread == 0 or since is None:
            return 0
        return max(0, round(1000 * (now - since)))

    def next_wakeup(self, now: float) -> float | None:
        """When :meth:`on_tick` (or connecting again) is next due; None: nothing is."""
        if self.rejoin_at_s is not None:
            return self.rejoin_at_s
        if self.state is not WorkerState.READY:
            return None
        lost_at = self._last_heard_s + self.liveness * self.heartbeat_s
        return max(now, min(self._next_heartbeat_s, lost_at))

    # ------------------------------------------------------------------ reconnecting

    @property
    def rejoining(self) -> bool:
        """Not connected: waiting until ``rejoin_at_s`` to connect again."""
        return self.rejoin_at_s is not None

    def on_lost(self, now: float) -> bool:
        """The connection is gone (the broker said DISCONNECT or went silent, a RESULT
        could not be sent). Starts a new epoch: what still runs answers nobody, since the
        broker requeues it. Returns True to connect again at once; else wait until
        ``rejoin_at_s``."""
        self.epoch += 1
        self.registered = False
        backoff = self.backoff
        if now - self.last_join_s < backoff.min_s:
            self.backoff_s = min(backoff.max_s, max(backoff.min_s, 2 * self.backoff_s))
            self.rejoin_at_s = self.last_join_s + self.backoff_s
            return False
        self.backoff_s = 0.0
        if backoff.at_once:
            return True
        self.rejoin_at_s = self.last_join_s + backoff.min_s
        return False

    def rejoin_due(self, now: float) -> bool:
        """Waiting to connect again, and it is time."""
        return self.rejoin_at_s is not None and now >= self.rejoin_at_s

    # ------------------------------------------------------------------ batches

    def runs_inline(self, job: RunBatch) -> bool:
        """Run this batch on the loop thread: its engine is not bound to its thread, the
        inference thread is idle, and this model's batches have been short enough that
        heartbeats cannot be late (:data:`INLINE_MAX_S`); cheaper than the hand-off."""
        batch = job.batch
        return (
            batch.model in self.thread_free
            and self._in_thread == 0
            and self._run_ewma_s.get(batch.model, math.inf) * batch.total_samples < INLINE_MAX_S
        )

    def on_job_done(self, now: float, outcome: JobOutcome) -> WorkerResult | WorkerFailed | None:
        """The RESULT or FAILED for a finished batch (None when its epoch has passed: it
        is still accounted), once its time per sample has taught :meth:`runs_inline`."""
        if outcome.samples > 0:
            per_sample = (outcome.end_s - outcome.start_s) / outcome.samples
            last = self._run_ewma_s.get(outcome.model, per_sample)
            self._run_ewma_s[outcome.model] = last + _RUN_EWMA_WEIGHT * (per_sample - last)
        self._finished(outcome.start_s, outcome.end_s)
        error = outcome.error
        if error is None:
            self.batches_done += 1
        else:
            self.batches_failed += 1
        if outcome.epoch != self.epoch:
            return None
        rho = self.rho(now)
        if error is not None:
            code, message = error
            return WorkerFailed(FailedMeta(outcome.batch_id, code, message, rho))
        # Not ``timed``: not the batch's engine time (it ran again request by request);
        # the RESULT says 0, which the broker's cost model ignores.
        compute_ms = 1000.0 * (outcome.end_s - outcome.start_s) if outcome.timed else 0.0
        counts, padding = tuple(outcome.counts), outcome.padding
        cpu_ms = 1000.0 * outcome.cpu_s if outcome.timed else 0.0
        telemetry = self._sample(now)
        meta = ResultMeta(outcome.batch_id, rho, compute_ms, counts, padding, telemetry, cpu_ms)
        return WorkerResult(meta, outcome.frames)

    def on_batch_queued(self, now: float) -> None:
        """A batch was handed to the inference thread."""
        if self._in_thread == 0:
            self.meter.running_since = now
        self._in_thread += 1

    @property
    def in_thread(self) -> int:
        """Batches handed to the inference thread and not finished yet."""
        return self._in_thread

    @property
    def idle_thread(self) -> bool:
        """No batch is with the inference thread."""
        return self._in_thread == 0

    def on_batches_dropped(self, count: int) -> None:
        """Batches handed over but taken back before they started (on reconnect)."""
        self._in_thread = max(0, self._in_thread - count)
        if self._in_thread == 0:
            self.meter.running_since = None

    def _finished(self, started_s: float, ended_s: float) -> None:
        self.meter.add(started_s, ended_s)
        self._in_thread = max(0, self._in_thread - 1)
        # The thread goes straight on to the next queued batch, if any.
        self.meter.running_since = ended_s if self._in_thread else None

    def on_stop(self) -> WorkerDisconnect:
        """The DISCONNECT to send when shutting down."""
        self.state = WorkerState.STOPPED
        return WorkerDisconnect("worker shutting down")
