"""metrics.py: a worker's Prometheus figures: its batches, load and the host's resources.

The loop thread counts each finished batch (:meth:`WorkerMetrics.on_job`: per model, its
outcome, size and engine time) and, when a scrape asks, builds a snapshot of those counts
and of :class:`~carpool.worker.core.WorkerCore`'s state (ρ, batches with the inference
thread, registration) between two turns (:class:`~carpool.common.metrics.Snapshots`).
Labels are the models the worker serves, fixed at its start. Device figures appear when
the worker's HEARTBEAT carries them (numeric fields besides ``rho`` and ``busy_ms``, each
exposed as ``carpool_worker_<field>``); a worker that reports none exposes none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from carpool.common.histogram import BATCH_BOUNDS, TIME_BOUNDS_S, Histogram
from carpool.common.metrics import MetricsEndpoint, Snapshot, Snapshots, gauges
from carpool.common.protocol import WorkerHeartbeat
from carpool.worker.core import JobOutcome, WorkerCore

#: HEARTBEAT fields that are not device telemetry.
_PROTOCOL_FIELDS = frozenset({"rho", "busy_ms"})


class _ModelCounts:
    __slots__ = ("compute", "failed", "ok", "sizes")

    def __init__(self) -> None:
        self.ok = 0
        self.failed = 0
        self.sizes = Histogram(BATCH_BOUNDS)
        self.compute = Histogram(TIME_BOUNDS_S)


class WorkerMetrics:
    """A worker's endpoint; its server calls :meth:`on_job` for every finished batch,
    :meth:`on_heartbeat` for every HEARTBEAT sent and :meth:`on_turn` after each turn."""

    def __init__(
        self, address: str, core: WorkerCore, wake: Callable[[], None], models: Iterable[str]
    ) -> None:
        self._core = core
        self._counts = {name: _ModelCounts() for name in models}
        self._telemetry: dict[str, float] = {}
        self.snapshots = Snapshots(wake)
        self.endpoint = MetricsEndpoint(address, self.snapshots, worker_families)

    def on_job(self, outcome: JobOutcome) -> None:
        counts = self._counts.get(outcome.model)
        if counts is None:
            return
        if outcome.error is not None:
            counts.failed += 1
            return
        counts.ok += 1
        if outcome.samples > 0:
            counts.sizes.observe(outcome.samples)
        if outcome.timed:
            counts.compute.observe(outcome.end_s - outcome.start_s)

    def on_heartbeat(self, beat: WorkerHeartbeat) -> None:
        self._telemetry = {
            f.name: float(value)
            for f in dataclasses.fields(beat)
            if f.name not in _PROTOCOL_FIELDS
            and isinstance(value := getattr(beat, f.name), int | float)
            and not isinstance(value, bool)
        }

    def on_turn(self, now: float) -> None:
        """(The loop thread.) Build the snapshot a scrape waits for, if one does."""
        if self.snapshots.asked:
            self.snapshots.publish(self.build(now))

    def build(self, now: float) -> Snapshot:
        core = self._core
        return {
            "ready": core.registered,
            "rho": core.meter.rho(now),
            "in_thread": core.in_thread,
            "slots": core.slots,
            "models": {
                name: (c.ok, c.failed, c.sizes.copy(), c.compute.copy())
                for name, c in self._counts.items()
            },
            "telemetry": dict(self._telemetry),
        }

    def close(self) -> None:
        self.endpoint.close()


_GAUGES = (
    ("ready", "carpool_worker_ready", "1 while engines are warm and the broker registered it"),
    ("rho", "carpool_worker_load", "the engine's busy share of the last second"),
    ("in_thread", "carpool_worker_thread_batches", "batches with the inference thread"),
    ("slots", "carpool_worker_credits", "batches the broker may have outstanding here"),
)


def worker_families(s: Snapshot) -> Iterator[Metric]:
    batches = CounterMetricFamily(
        "carpool_worker_batches", "batches run, by model and outcome", labels=["model", "outcome"]
    )
    sizes = HistogramMetricFamily(
        "carpool_worker_batch_size", "samples per batch run", labels=["model"]
    )
    compute = HistogramMetricFamily(
        "carpool_worker_compute_seconds", "engine time of a batch", labels=["model"]
    )
    for model, (ok, failed, size_h, compute_h) in s["models"].items():
        batches.add_metric([model, "ok"], ok)
        batches.add_metric([model, "failed"], failed)
        sizes.add_metric([model], size_h.cumulative(), size_h.sum)
        compute.add_metric([model], compute_h.cumulative(), compute_h.sum)
    yield from (batches, sizes, compute)
    yield from gauges(s, _GAUGES)
    for field, value in sorted(s["telemetry"].items()):
        yield GaugeMetricFamily(f"carpool_worker_{field}", f"HEARTBEAT {field}", value=value)
