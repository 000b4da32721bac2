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

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from carpool.common.histogram import BATCH_BOUNDS, TIME_BOUNDS_S, Histogram
from carpool.common.metrics import MetricsEndpoint, Snapshot, Snapshots, gauges
from carpool.common.protocol import Telemetry
from carpool.worker.core import JobOutcome, WorkerCore

#: Telemetry fields (docs/protocol.md §8.2) as gauges: field -> (metric, help).
_TELEMETRY = {
    "host_cpu_pct": ("carpool_worker_host_cpu_percent", "the host's CPU use, 0..100"),
    "host_mem_used_mib": ("carpool_worker_host_memory_used_mib", "the host's memory in use"),
    "host_mem_total_mib": ("carpool_worker_host_memory_total_mib", "the host's memory"),
    "gpu_util_pct": ("carpool_worker_gpu_utilization_percent", "the GPU's use, 0..100"),
    "gpu_mem_used_mib": ("carpool_worker_gpu_memory_used_mib", "device memory in use"),
    "gpu_mem_total_mib": ("carpool_worker_gpu_memory_total_mib", "device memory"),
}


class _ModelCounts:
    __slots__ = ("compute", "failed", "ok", "sizes")

    def __init__(self) -> None:
        self.ok = 0
        self.failed = 0
        self.sizes = Histogram(BATCH_BOUNDS)
        self.compute = Histogram(TIME_BOUNDS_S)


class WorkerMetrics:
    """A worker's endpoint; its server calls :meth:`on_job` for every finished batch,
    and :meth:`on_turn` after each turn."""

    def __init__(
        self, address: str, core: WorkerCore, wake: Callable[[], None], models: Iterable[str]
    ) -> None:
        self._core = core
        self._counts = {name: _ModelCounts() for name in models}
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

    def on_turn(self, now: float) -> None:
        """(The loop thread.) Build the snapshot a scrape waits for, if one does."""
        if self.snapshots.asked:
            self.snapshots.publish(self.build(now))

    def build(self, now: float) -> Snapshot:
        core = self._core
        return {
            "ready": core.registered,
            "rho": core.rho(now),
            "in_thread": core.in_thread,
            "slots": core.slots,
            "models": {
                name: (c.ok, c.failed, c.sizes.copy(), c.compute.copy())
                for name, c in self._counts.items()
            },
            "telemetry": _telemetry(core.last_telemetry),
            "unreadable": {kind: core.unreadable[kind] for kind in UNREADABLE_KINDS},
        }

    def close(self) -> None:
        self.endpoint.close()


_GAUGES = (
    ("ready", "carpool_worker_ready", "1 while engines are warm and the broker registered it"),
    ("rho", "carpool_worker_load", "the engine's busy share of the last second"),
    ("in_thread", "carpool_worker_thread_batches", "batches with the inference thread"),
    ("slots", "carpool_worker_credits", "batches the broker may have outstanding here"),
)


#: The kinds of ``carpool_worker_unreadable_total`` (WorkerCore.unreadable), each 0 or not.
UNREADABLE_KINDS = ("receive", "decode", "malformed")


def _telemetry(sample: Telemetry | None) -> dict[str, float]:
    """The host and device figures of the worker's latest telemetry sample."""
    if sample is None:
        return {}
    return {name: float(v) for name in _TELEMETRY if (v := getattr(sample, name)) is not None}


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
    unreadable = CounterMetricFamily(
        "carpool_worker_unreadable",
        "messages from the broker's side dropped: unreadable, or breaking the protocol",
        labels=["kind"],
    )
    for kind, count in s["unreadable"].items():
        unreadable.add_metric([kind], count)
    yield unreadable
    yield from gauges(s, _GAUGES)
    for field, value in sorted(s["telemetry"].items()):
        name, text = _TELEMETRY[field]
        yield GaugeMetricFamily(name, text, value=value)
