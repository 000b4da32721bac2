"""stats.py: the broker's counters (the STATS reply built from them is snapshot.py's).

Pure. :class:`BrokerStats` is counted into in two ways: directly, where a count is one
add (plain attributes: the core, the door's refusals, resends, held requests, the
frontend), and through :class:`Notes`, which the dispatcher and the worker events keep
and the core takes into the stats when they are read on the loop's thread (its sweep
reads them every half second): a batch's counts, and the answered requests' times,
which are then binned many at a time. Its per-model figures (answers and errors by
model, admission refusals, the time histograms of :class:`ModelTimings`) are kept only
for models the broker knows a spec of, and go when the model is forgotten: made-up names
cannot grow them.

Per-model latency figures, cumulative histograms and a recent window (``now`` comes
in): every answered batch is counted into its model's :class:`ModelTimings`
(:meth:`BrokerStats.answered`, when the core takes the worker events' notes): each
request's end-to-end time in the broker (arrival to RESULT) and its queue wait (arrival
to dispatch), and the batch's compute time as its worker reported it. The histograms
are cumulative over the broker's life (what Prometheus scrapes); the window keeps the
last :data:`WINDOW` requests' end-to-end times, of which
:meth:`ModelTimings.percentiles` reads those of the last ``window_s`` (what STATS,
``carpool status`` and ``carpool top`` show).
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from carpool.broker.registry import WorkerState
from carpool.broker.requests import PendingRequest, RequestKey, RequestState
from carpool.common.histogram import TIME_BOUNDS_S, Histogram

if TYPE_CHECKING:
    from carpool.broker.inflight import InflightBatch

#: The per-batch records (DEBUG; this module logs nothing else: turn it on alone).
batch_log = logging.getLogger(__name__)


#: A batch answered, as the stats count it: (now, model, requests, sent_s, compute_s).
Answered = tuple[float, str, list[PendingRequest], float, float]


class Notes:
    """What a part did that the stats count, noted by the part and taken into
    :class:`BrokerStats` by the core (:meth:`BrokerStats.take`): the dispatcher and the
    worker events note, the core writes. Each list and count grows with the part's calls
    until the core takes it: whenever the stats are read on the loop's thread
    (``BrokerCore.stats``), which the core's sweep does every half second."""

    __slots__ = (
        "answered",
        "batches",
        "failed",
        "late_results",
        "padded",
        "requeued",
        "shed",
        "unhealthy",
    )

    def __init__(self) -> None:
        #: Per error answered to an admitted request: (its model, the code's name).
        self.failed: list[tuple[str, str]] = []
        #: Per batch dispatched: (model, samples).
        self.batches: list[tuple[str, int]] = []
        #: Per batch answered: (now, model, requests, sent_s, compute_s).
        self.answered: list[Answered] = []
        #: Per bucket batch answered with its ``padding``: (key, samples, padding).
        self.padded: list[tuple[RequestKey, int, tuple[int, int]]] = []
        self.shed = 0  # of the failed, those shed as hopeless
        self.late_results = 0
        self.requeued = 0
        self.unhealthy = 0


class BrokerStats:
    """Counters for STATS replies and tests."""

    def __init__(self) -> None:
        self.requests = 0
        self.replies = 0
        self.errors: Counter[str] = Counter()
        self.batch_sizes: dict[str, Counter[int]] = {}
        self.undeliverable = 0
        # replies dropped because the client's connection had closed (frontend.py)
        self.departed = 0
        # Messages dropped because they could not be read, by (endpoint, kind) (the
        # server counts them: server.py); and messages whose handling raised inside the
        # core without changing its state, answered (a client's INTERNAL).
        self.unreadable: Counter[tuple[str, str]] = Counter()
        self.core_faults = 0
        self.requeued = 0
        # copies of requests the broker held, answered once on the copy's connection
        self.resent = 0
        self.cancelled = 0  # requests dropped by a CANCEL (answered CANCELLED)
        self.late_results = 0  # RESULT/FAILED for a batch the sender no longer holds
        self.unhealthy = 0  # workers marked unhealthy by the engine watchdog
        self.shed = 0  # answered DEADLINE_EXCEEDED before reaching a worker (hopeless)
        self.shed_at_door = 0  # ... of them refused on arrival, never queued
        # Per padded model, per bucket label: [batches, samples, padded elements, bucket
        # elements], from the RESULTs that carry ``padding`` (§8.4).
        self.buckets: dict[str, dict[str, list[int]]] = {}
        # Per model: its time histograms and answered count; its error replies by code
        # (admitted requests; those refused at the door are in ``refusals`` as well).
        self.timings: dict[str, ModelTimings] = {}
        self.answers: Counter[str] = Counter()
        self.model_errors: dict[str, Counter[str]] = {}
        self.refusals: dict[str, Counter[str]] = {}  # refused on arrival, by code name

    def forget(self, model: str) -> None:
        """A model no worker serves is forgotten: its counters go too."""
        for table in (self.batch_sizes, self.buckets, self.timings, self.model_errors):
            table.pop(model, None)
        self.refusals.pop(model, None)
        self.answers.pop(model, None)

    def answered(self, batches: Iterable[Answered]) -> int:
        """Batches came back, each ``(now, model, requests, sent_s, compute_s)``: sent at
        ``sent_s``, answered at ``now`` (their RESULTs). Counted a model at a time;
        returns how many requests they answered."""
        by_model: dict[str, list[tuple[float, list[PendingRequest], float, float]]] = {}
        for now, model, requests, sent_s, compute_s in batches:
            mine = by_model.get(model)
            if mine is None:
                mine = by_model[model] = []
            mine.append((now, requests, sent_s, compute_s))
        total = 0
        for model, mine in by_model.items():
            timings = self.timings.get(model)
            if timings is None:
                timings = self.timings[model] = ModelTimings()
            answered = timings.answered(mine)
            self.answers[model] += answered
            total += answered
        return total

    def failed(self, model: str, code: str) -> None:
        """An admitted request of ``model`` was answered with the error ``code``."""
        errors = self.model_errors.get(model)
        if errors is None:
            errors = self.model_errors[model] = Counter()
        errors[code] += 1

    def refused(self, model: str, code: str, shed: bool) -> None:
        """A request of ``model`` (a known one) was refused on arrival (admission)."""
        if shed:
            self.shed += 1
            self.shed_at_door += 1
        self.failed(model, code)
        refusals = self.refusals.get(model)
        if refusals is None:
            refusals = self.refusals[model] = Counter()
        refusals[code] += 1

    def padded(self, key: RequestKey, samples: int, padding: tuple[int, int]) -> None:
        """A batch of queue ``key`` (a bucket) came back with its RESULT's ``padding``."""
        model = key[0]
        label = bucket_label(key)
        counts = self.buckets.setdefault(model, {}).setdefault(label, [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += samples
        counts[2] += padding[0]
        counts[3] += padding[1]

    def batch(self, model: str, samples: int) -> None:
        sizes = self.batch_sizes.get(model)
        if sizes is None:  # (setdefault would build a Counter every call)
            sizes = self.batch_sizes[model] = Counter()
        sizes[samples] += 1

    def take(self, notes: Notes) -> None:
        """Count what a part noted, and empty its notes (each list is taken before it
        is counted: a count that raises loses its list, it never counts it twice)."""
        if notes.failed:
            failed, notes.failed = notes.failed, []
            errors = self.errors
            for model, code in failed:
                errors[code] += 1
                self.failed(model, code)
        if notes.batches:
            batches, notes.batches = notes.batches, []
            for model, samples in batches:
                self.batch(model, samples)
        if notes.answered:
            answered, notes.answered = notes.answered, []
            self.replies += self.answered(answered)
        if notes.padded:
            padded, notes.padded = notes.padded, []
            for key, samples, padding in padded:
                self.padded(key, samples, padding)
        if notes.shed or notes.late_results or notes.requeued or notes.unhealthy:
            self.shed += notes.shed
            self.late_results += notes.late_results
            self.requeued += notes.requeued
            self.unhealthy += notes.unhealthy
            notes.shed = notes.late_results = notes.requeued = notes.unhealthy = 0


def bucket_label(key: RequestKey) -> str:
    """A bucket's name in STATS: its item shape, ``3x736x1280``; for a model of several
    inputs, each input's as ``name=3x48x320``, joined by commas."""
    inputs = key[1]
    if len(inputs) == 1:
        return "x".join(map(str, inputs[0][2]))
    return ",".join(f"{name}=" + "x".join(map(str, shape)) for name, _, shape in inputs)


def batch_record(now: float, worker: WorkerState, batch: InflightBatch, compute_ms: float) -> None:
    """One finished batch at DEBUG: model, size, bucket (item shape), the oldest request's
    queue wait, the worker's compute time, the round trip and the worker (a batch log
    without patching anything: ``--log-level DEBUG``)."""
    oldest_s = min((r.arrival_s for r in batch.requests), default=batch.sent_s)
    batch_log.debug(
        "batch model=%s size=%d bucket=%s wait_ms=%.2f compute_ms=%.2f round_trip_ms=%.2f "
        "worker=%s b_max=%d bound_by=%s",
        batch.key[0],
        batch.samples,
        bucket_label(batch.key),
        1000 * (batch.sent_s - oldest_s),
        compute_ms,
        1000 * (now - batch.sent_s),
        worker.name,
        worker.lanes[batch.key[0]].batch_limit,
        worker.lanes[batch.key[0]].bound_by,
    )


#: Requests kept per model for the percentiles.
WINDOW = 2048
#: The percentiles' window: requests answered in the last this many seconds.
WINDOW_S = 60.0
_DONE = RequestState.DONE


class ModelTimings:
    """One model's time histograms and recent end-to-end times; see the module docstring.

    The requests' times are counted a batch of RESULTs at a time (:meth:`answered`, from
    the notes the core takes): their bins found and their sums added by numpy, so that
    a request costs a list item, not two bisects and a deque append.
    speed: docs/benchmarks.md "Why the hot path looks as it does"
    """

    def __init__(self) -> None:
        self.latency = Histogram(TIME_BOUNDS_S)  # arrival → RESULT, per request
        self.wait = Histogram(TIME_BOUNDS_S)  # arrival → dispatch, per request
        self.compute = Histogram(TIME_BOUNDS_S)  # the worker's engine time, per batch
        # The last WINDOW requests' (when answered, end-to-end time), a ring: entry
        # ``kept % WINDOW`` is written next.
        self._when = np.zeros(WINDOW)
        self._latency = np.zeros(WINDOW)
        self._kept = 0

    def answered(self, batches: Iterable[tuple[float, list[PendingRequest], float, float]]) -> int:
        """Batches came back, each ``(now, requests, sent_s, compute_s)``: dispatched at
        ``sent_s``, answered at ``now``; the requests each answered (state DONE; the
        others were answered before, at their deadlines) are counted. Returns how many."""
        arrivals: list[float] = []  # per request answered
        ends: list[float] = []  # per batch that answered any: when, when sent, how many
        sent: list[float] = []
        counts: list[int] = []
        compute, bounds = self.compute, TIME_BOUNDS_S
        for now, requests, sent_s, compute_s in batches:
            done = [r.arrival_s for r in requests if r.state is _DONE]
            if done:
                arrivals += done
                ends.append(now)
                sent.append(sent_s)
                counts.append(len(done))
            if compute_s > 0:  # 0: not the batch's engine time (run request by request)
                compute.counts[bisect_left(bounds, compute_s)] += 1
                compute.sum += compute_s
        if not arrivals:
            return 0
        arrived = np.fromiter(arrivals, np.float64, len(arrivals))
        answered_s = np.repeat(np.array(ends), counts)  # (a batch's time for each request)
        latency = answered_s - arrived
        _observe(self.latency, latency)
        _observe(self.wait, np.repeat(np.array(sent), counts) - arrived)
        self._keep(answered_s, latency)
        return len(arrivals)

    def _keep(self, when: npt.NDArray[np.float64], latency: npt.NDArray[np.float64]) -> None:
        """The newest of ``latency`` (answered at ``when``) into the ring."""
        n = min(len(latency), WINDOW)
        when, latency = when[len(when) - n :], latency[len(latency) - n :]
        at = self._kept % WINDOW
        first = min(n, WINDOW - at)
        self._when[at : at + first] = when[:first]
        self._latency[at : at + first] = latency[:first]
        self._when[: n - first] = when[first:]
        self._latency[: n - first] = latency[first:]
        self._kept += n

    def percentiles(self, now: float | None, window_s: float = WINDOW_S) -> dict[str, float] | None:
        """p50, p95 and p99 of the end-to-end times answered in the last ``window_s``
        before ``now`` (None: all those kept), in milliseconds, with their count ``n``;
        None when there are none."""
        kept = min(self._kept, WINDOW)
        when, latency = self._when[:kept], self._latency[:kept]
        if now is not None:
            latency = latency[when >= now - window_s]
        values = np.sort(latency).tolist()
        if not values:
            return None
        figures = {f"p{q}_ms": round(1000 * _rank(values, q / 100), 3) for q in (50, 95, 99)}
        return {**figures, "n": len(values)}


#: The time histograms' bounds, for numpy.
_BOUNDS = np.array(TIME_BOUNDS_S)


def _observe(histogram: Histogram, values: npt.NDArray[np.float64]) -> None:
    """``values`` into ``histogram``, as :meth:`Histogram.observe` puts each (a value on
    a bound counts in that bound's bucket)."""
    bins = np.bincount(np.searchsorted(_BOUNDS, values, side="left"), minlength=len(_BOUNDS) + 1)
    counts = histogram.counts
    for i, n in enumerate(bins.tolist()):
        if n:
            counts[i] += n
    histogram.sum += float(values.sum())


def _rank(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``ordered`` (sorted, not empty)."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
