"""stats.py: the broker's counters, and the STATS reply built from them and its state.

Pure. :class:`BrokerStats` is counted into on the hot path (plain attributes);
:func:`snapshot` is what a STATS request answers (msgpack-friendly: str keys only). Its
per-model figures (answers and errors by model, admission refusals, the time histograms
of :class:`ModelTimings`) are kept only for models the broker knows a spec of,
and go when the model is forgotten: made-up names cannot grow them.

Per-model latency figures, cumulative histograms and a recent window (``now`` comes
in): the broker's loop counts every answered batch into its model's
:class:`ModelTimings` (:meth:`BrokerStats.answered`): each request's end-to-end time in
the broker (arrival to RESULT) and its queue wait (arrival to dispatch), and the batch's
compute time as its worker reported it. The histograms are cumulative over the broker's
life (what Prometheus scrapes); the window keeps the last :data:`WINDOW` requests'
end-to-end times, of which :meth:`ModelTimings.percentiles` reads those of the last
``window_s`` (what STATS, ``carpool status`` and ``carpool top`` show).
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from carpool.broker.adaptive import CostEstimate
from carpool.broker.config import BatchingConfig
from carpool.broker.registry import Lane, WorkerRegistry, WorkerState
from carpool.broker.requests import PendingRequest, RequestKey, RequestState
from carpool.common.histogram import TIME_BOUNDS_S, Histogram

if TYPE_CHECKING:
    from carpool.broker.inflight import InflightBatch

#: The per-batch records (DEBUG; this module logs nothing else: turn it on alone).
batch_log = logging.getLogger(__name__)


class Notes:
    """What a part did that the stats count, noted by the part and taken into
    :class:`BrokerStats` by the core (:meth:`BrokerStats.take`): the dispatcher and the
    worker events note, the core writes. Each list and count grows with the part's calls
    until the core takes it: whenever the stats are read, which the core's sweep does
    every half second (``BrokerCore.forget_unserved``)."""

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
        #: Per batch answered: :meth:`BrokerStats.answered`'s arguments.
        self.answered: list[tuple[float, str, list[PendingRequest], float, float]] = []
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

    def answered(
        self,
        now: float,
        model: str,
        requests: list[PendingRequest],
        sent_s: float,
        compute_s: float,
    ) -> int:
        """A batch of ``model`` sent at ``sent_s`` came back at ``now`` (its RESULT);
        returns how many of its requests it answered."""
        timings = self.timings.get(model)
        if timings is None:
            timings = self.timings[model] = ModelTimings()
        answered = timings.answered(now, requests, sent_s, compute_s)
        self.answers[model] += answered
        return answered

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
        """Count what a part noted, and empty its notes."""
        if notes.failed:
            errors = self.errors
            for model, code in notes.failed:
                errors[code] += 1
                self.failed(model, code)
            notes.failed.clear()
        if notes.batches:
            for model, samples in notes.batches:
                self.batch(model, samples)
            notes.batches.clear()
        if notes.answered:
            for now, model, requests, sent_s, compute_s in notes.answered:
                self.replies += self.answered(now, model, requests, sent_s, compute_s)
            notes.answered.clear()
        if notes.padded:
            for key, samples, padding in notes.padded:
                self.padded(key, samples, padding)
            notes.padded.clear()
        if notes.shed or notes.late_results or notes.requeued or notes.unhealthy:
            self.shed += notes.shed
            self.late_results += notes.late_results
            self.requeued += notes.requeued
            self.unhealthy += notes.unhealthy
            notes.shed = notes.late_results = notes.requeued = notes.unhealthy = 0


def model_table(
    stats: BrokerStats,
    registry: WorkerRegistry,
    names: Iterable[str],
    queued_samples: dict[str, list[int]],
    batching: Callable[[str], BatchingConfig],
    now: float | None,
) -> dict[str, dict[str, Any]]:
    """STATS ``models``: per model of ``names`` (those the broker knows a spec of, and
    those its configuration names), its live workers, current B_max (the largest of its
    workers' lanes), T_max, queued samples, answers, errors and recent latency."""
    table = {}
    for name in sorted(names):
        serving = registry.serving(name)
        lanes = [w.lanes[name] for w in serving if name in w.lanes]
        timings = stats.timings.get(name)
        table[name] = {
            "workers": len(serving),
            "healthy_workers": sum(1 for w in serving if w.health.value == "healthy"),
            "b_max": max((lane.batch_limit for lane in lanes), default=0),
            "max_wait_ms": round(1000 * batching(name).max_wait_s, 3),
            "queued": sum(queued_samples.get(name, ())),
            "answered": stats.answers.get(name, 0),
            "errors": dict(stats.model_errors.get(name, {})),
            "refused": dict(stats.refusals.get(name, {})),
            "latency": None if timings is None else timings.percentiles(now),
        }
    return table


def snapshot(
    stats: BrokerStats,
    registry: WorkerRegistry,
    queued: int,
    queued_bytes: int,
    inflight: int,
    transport: Callable[[bytes], str],
    models: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Counters and state for STATS replies (msgpack-friendly: str keys only);
    ``transport`` names how each worker is connected, by its id; ``models``: the
    per-model table (:func:`model_table`)."""
    return {
        "requests": stats.requests,
        "replies": stats.replies,
        "errors": dict(stats.errors),
        "batch_sizes": {
            model: {str(k): v for k, v in sorted(sizes.items())}
            for model, sizes in stats.batch_sizes.items()
        },
        "queued": queued,
        "queued_bytes": queued_bytes,
        "inflight_batches": inflight,
        "requeued": stats.requeued,
        "undeliverable": stats.undeliverable,
        "departed": stats.departed,
        "dropped_unreadable": _unreadable_snapshot(stats.unreadable),
        "core_faults": stats.core_faults,
        "resent": stats.resent,
        "cancelled": stats.cancelled,
        "late_results": stats.late_results,
        "unhealthy": stats.unhealthy,
        "shed": stats.shed,
        "shed_at_door": stats.shed_at_door,
        "buckets": {
            model: {label: _bucket_snapshot(c) for label, c in sorted(labels.items())}
            for model, labels in stats.buckets.items()
        },
        "known_models": len(registry.specs),
        "models": models or {},
        "max_batch_bound_by": bound_by(registry),
        "workers": [
            {
                "name": w.name,
                "models": sorted(w.models),
                "slots": w.slots,
                "outstanding": len(w.outstanding),
                "rho": w.rho,
                "health": w.health.value,
                "lanes": {name: _lane_snapshot(lane) for name, lane in w.lanes.items()},
                "transport": transport(w.wid),
                "telemetry": w.telemetry.to_wire() if w.telemetry is not None else {},
            }
            for w in registry.all()
        ],
    }


def bound_by(registry: WorkerRegistry) -> dict[str, str]:
    """Per model served: which limit binds its B_max (:attr:`Lane.bound_by`), on the
    worker whose B_max is largest (the fleet's batches are at most that)."""
    out: dict[str, str] = {}
    for name in registry.specs:
        lanes = [w.lanes[name] for w in registry.serving(name)]
        if lanes:
            out[name] = max(lanes, key=lambda lane: lane.batch_limit).bound_by
    return out


def _lane_snapshot(lane: Lane) -> dict[str, Any]:
    """A lane's B_max, the limit that binds it, and its fits for the shape it ran last:
    the engine's time per batch (with its relative spread) and the worker's own CPU per
    batch outside the engine (RESULT ``cpu_ms``; 0 until one came)."""
    key = lane.last_key
    cost = lane.cost(key)
    cpu = lane.overhead(key) if key is not None else CostEstimate()
    return {
        "b_max": lane.batch_limit,
        "max_batch_bound_by": lane.bound_by,
        "fixed_cost_ms": round(1000 * cost.fixed_cost_s, 3),
        "per_sample_ms": round(1000 * cost.per_sample_s, 3),
        "spread": round(cost.spread, 4),
        "calibrated": cost.calibrated,
        "cpu_fixed_ms": round(1000 * cpu.fixed_cost_s, 3),
        "cpu_per_sample_ms": round(1000 * cpu.per_sample_s, 3),
    }


def bucket_label(key: RequestKey) -> str:
    """A bucket's name in STATS: its item shape, ``3x736x1280``; for a model of several
    inputs, each input's as ``name=3x48x320``, joined by commas."""
    inputs = key[1]
    if len(inputs) == 1:
        return "x".join(map(str, inputs[0][2]))
    return ",".join(f"{name}=" + "x".join(map(str, shape)) for name, _, shape in inputs)


def _bucket_snapshot(counts: list[int]) -> dict[str, Any]:
    batches, samples, padded, elements = counts
    return {
        "batches": batches,
        "samples": samples,
        "padded_elements": padded,
        "bucket_elements": elements,
        "padded_share": round(padded / elements, 4) if elements else 0.0,
    }


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


#: STATS ``dropped_unreadable``: each endpoint's kinds (every pair, 0 or not). A message
#: could not be received, or its connection told (the frames' properties, the connection
#: or key tables), or a worker's decoded (a client's is decoded inside the core, where a
#: fault is answered or stops the broker: server.py).
UNREADABLE: dict[str, tuple[str, ...]] = {
    "frontend": ("receive", "connection"),
    "backend": ("receive", "connection", "decode"),
}


def _unreadable_snapshot(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    return {e: {k: counts[(e, k)] for k in kinds} for e, kinds in UNREADABLE.items()}


#: Requests kept per model for the percentiles.
WINDOW = 2048
#: The percentiles' window: requests answered in the last this many seconds.
WINDOW_S = 60.0
_DONE = RequestState.DONE


class ModelTimings:
    """One model's time histograms and recent end-to-end times; see the module docstring."""

    def __init__(self) -> None:
        self.latency = Histogram(TIME_BOUNDS_S)  # arrival → RESULT, per request
        self.wait = Histogram(TIME_BOUNDS_S)  # arrival → dispatch, per request
        self.compute = Histogram(TIME_BOUNDS_S)  # the worker's engine time, per batch
        self._recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (when, latency)

    def answered(
        self, now: float, requests: Iterable[PendingRequest], sent_s: float, compute_s: float
    ) -> int:
        """A batch dispatched at ``sent_s`` came back at ``now``; its requests answered by
        it (state DONE; the others were answered before, at their deadlines) are counted.
        Returns how many."""
        # Histogram.observe, inlined: a bisect and an add for each figure.
        # speed: docs/benchmarks.md "Why the hot path looks as it does"
        latency, wait, append = self.latency, self.wait, self._recent.append
        latency_counts, wait_counts, bounds = latency.counts, wait.counts, TIME_BOUNDS_S
        latency_sum = wait_sum = 0.0
        n = 0
        for req in requests:
            if req.state is _DONE:
                arrival_s = req.arrival_s
                latency_s, wait_s = now - arrival_s, sent_s - arrival_s
                latency_counts[bisect_left(bounds, latency_s)] += 1
                wait_counts[bisect_left(bounds, wait_s)] += 1
                latency_sum += latency_s
                wait_sum += wait_s
                append((now, latency_s))
                n += 1
        latency.sum += latency_sum
        wait.sum += wait_sum
        if compute_s > 0:  # 0: not the batch's engine time (run request by request)
            compute = self.compute
            compute.counts[bisect_left(bounds, compute_s)] += 1
            compute.sum += compute_s
        return n

    def percentiles(self, now: float | None, window_s: float = WINDOW_S) -> dict[str, float] | None:
        """p50, p95 and p99 of the end-to-end times answered in the last ``window_s``
        before ``now`` (None: all those kept), in milliseconds, with their count ``n``;
        None when there are none."""
        since = -math.inf if now is None else now - window_s
        values = sorted(lat for when, lat in self._recent if when >= since)
        if not values:
            return None
        figures = {f"p{q}_ms": round(1000 * _rank(values, q / 100), 3) for q in (50, 95, 99)}
        return {**figures, "n": len(values)}


def _rank(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``ordered`` (sorted, not empty)."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
