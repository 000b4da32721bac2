"""metrics.py: the broker's Prometheus figures, read from its STATS snapshot at scrape time.

One owner of the figures: :class:`~carpool.broker.stats.BrokerStats` and the STATS
snapshot. A scrape asks the loop (:class:`~carpool.common.metrics.Snapshots`); between
two turns the loop builds :meth:`BrokerCore.snapshot` plus copies of the per-model time
histograms, and :func:`broker_families` turns that into metric families on the HTTP
thread. Model labels come only from the snapshot's models (those the broker knows a spec
of, or its configuration names) and worker labels from its live workers, so requests for
made-up model names cannot grow the exposition.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from carpool.common.errors import ErrorCode
from carpool.common.histogram import BATCH_BOUNDS, Histogram
from carpool.common.metrics import MetricsEndpoint, Snapshot, Snapshots, gauges

if TYPE_CHECKING:
    from carpool.broker.core import BrokerCore


class BrokerMetrics:
    """The broker's endpoint; the server calls :meth:`on_turn` after each loop turn."""

    def __init__(
        self, address: str, core: BrokerCore, wake: Callable[[], None], ready: Callable[[], bool]
    ) -> None:
        self._core = core
        self._ready = ready
        self.snapshots = Snapshots(wake)
        self.endpoint = MetricsEndpoint(address, self.snapshots, broker_families)

    def on_turn(self, now: float) -> None:
        """(The loop thread.) Build the snapshot a scrape waits for, if one does."""
        if self.snapshots.asked:
            self.snapshots.publish(self.build(now))

    def build(self, now: float) -> Snapshot:
        core = self._core
        snapshot = core.snapshot(now)
        snapshot["ready"] = self._ready()
        snapshot["timings"] = {
            model: (t.latency.copy(), t.wait.copy(), t.compute.copy())
            for model, t in core.stats.timings.items()
        }
        return snapshot

    def close(self) -> None:
        self.endpoint.close()


def _family(kind: Callable[..., Any], name: str, text: str, labels: list[str]) -> Any:
    """A family of ``kind`` (a prometheus-client ``*MetricFamily``) with ``labels``."""
    return kind(name, text, labels=labels)


def broker_families(s: Snapshot) -> Iterator[Metric]:
    """The broker's metric families from a snapshot :meth:`BrokerMetrics.build` made."""
    models: dict[str, dict[str, Any]] = s["models"]
    requests = _family(
        CounterMetricFamily,
        "carpool_requests",
        "requests answered, by model and outcome (ok, or the error code)",
        ["model", "outcome"],
    )
    misses = _family(
        CounterMetricFamily,
        "carpool_deadline_misses",
        "requests answered DEADLINE_EXCEEDED (shed or expired), by model",
        ["model"],
    )
    refusals = _family(
        CounterMetricFamily,
        "carpool_admission_refusals",
        "requests refused on arrival, by model and code",
        ["model", "code"],
    )
    gauges = {
        key: _family(GaugeMetricFamily, f"carpool_model_{key}", text, ["model"])
        for key, text in (
            ("workers", "live workers serving the model"),
            ("healthy_workers", "live healthy workers serving the model"),
            ("b_max", "current B_max: the largest of its workers' adaptive batch limits"),
            ("queued", "samples queued for the model"),
        )
    }
    max_wait = _family(
        GaugeMetricFamily, "carpool_model_max_wait_seconds", "the model's T_max", ["model"]
    )
    for model, row in models.items():
        requests.add_metric([model, "ok"], row["answered"])
        for code, n in sorted(row["errors"].items()):
            requests.add_metric([model, code.lower()], n)
        misses.add_metric([model], row["errors"].get("DEADLINE_EXCEEDED", 0))
        for code, n in sorted(row["refused"].items()):
            refusals.add_metric([model, code.lower()], n)
        for key, family in gauges.items():
            family.add_metric([model], row[key])
        max_wait.add_metric([model], row["max_wait_ms"] / 1000)
    yield from (requests, misses, refusals, *gauges.values(), max_wait)
    yield from _histograms(s, models)
    yield from _padding(s, models)
    yield from _counters(s)
    yield from _workers(s["workers"])


def _histograms(s: Snapshot, models: dict[str, Any]) -> Iterator[Metric]:
    names = (
        ("carpool_request_latency_seconds", "broker time of a request, arrival to answer"),
        ("carpool_queue_wait_seconds", "a request's wait in the queue, arrival to dispatch"),
        ("carpool_compute_seconds", "a batch's engine time, as its worker reported it"),
    )
    families = [_family(HistogramMetricFamily, n, text, ["model"]) for n, text in names]
    timings: dict[str, tuple[Histogram, ...]] = s["timings"]
    for model in models:
        for family, histogram in zip(families, timings.get(model, ()), strict=False):
            family.add_metric([model], histogram.cumulative(), histogram.sum)
    yield from families
    sizes = _family(
        HistogramMetricFamily, "carpool_batch_size", "samples per dispatched batch", ["model"]
    )
    for model, counts in s["batch_sizes"].items():
        if model in models:
            histogram = Histogram(BATCH_BOUNDS)  # (STATS' exact sizes, into the buckets)
            for size, n in counts.items():
                histogram.observe(int(size), n)
            sizes.add_metric([model], histogram.cumulative(), histogram.sum)
    yield sizes


def _padding(s: Snapshot, models: dict[str, Any]) -> Iterator[Metric]:
    share = _family(
        GaugeMetricFamily,
        "carpool_padded_share",
        "padded elements over bucket elements of a padded model's batches",
        ["model"],
    )
    for model, labels in s["buckets"].items():
        if model in models:
            padded = sum(b["padded_elements"] for b in labels.values())
            total = sum(b["bucket_elements"] for b in labels.values())
            share.add_metric([model], padded / total if total else 0.0)
    yield share


#: STATS counters exposed as they are: (field, metric name, help).
_COUNTERS = (
    ("requests", "carpool_client_messages", "client messages received (STATS ones included)"),
    ("replies", "carpool_replies", "replies forwarded from workers"),
    ("shed", "carpool_shed", "requests shed as hopeless before reaching a worker"),
    ("shed_at_door", "carpool_shed_at_door", "of them, refused on arrival"),
    ("requeued", "carpool_requeued", "requests put back after their worker was lost"),
    ("undeliverable", "carpool_undeliverable", "replies that could not be delivered"),
    ("unhealthy", "carpool_worker_unhealthy_events", "workers marked unhealthy (watchdog)"),
    ("late_results", "carpool_late_results", "results for batches no longer held"),
    ("cancelled", "carpool_cancelled", "requests dropped by a CANCEL"),
    ("core_faults", "carpool_broker_core_faults", "messages a fault inside the core answered"),
)


_GAUGES = (
    ("queued", "carpool_queued_requests", "requests queued"),
    ("queued_bytes", "carpool_queued_bytes", "payload bytes queued"),
    ("inflight_batches", "carpool_inflight_batches", "batches at workers"),
    ("ready", "carpool_ready", "1 while the broker takes requests"),
)


def _counters(s: Snapshot) -> Iterator[Metric]:
    for key, name, text in _COUNTERS:
        yield CounterMetricFamily(name, text, value=s[key])
    errors = _family(CounterMetricFamily, "carpool_errors", "error replies, by code", ["code"])
    for code in ErrorCode:  # every code, 0 or not: a fixed set of series
        errors.add_metric([code.name.lower()], s["errors"].get(code.name, 0))
    yield errors
    unreadable = _family(
        CounterMetricFamily,
        "carpool_broker_unreadable",
        "messages dropped because they could not be read",
        ["endpoint", "kind"],
    )
    for endpoint, kinds in s["dropped_unreadable"].items():
        for kind, count in kinds.items():
            unreadable.add_metric([endpoint, kind], count)
    yield unreadable
    yield from gauges(s, _GAUGES)


def _workers(workers: list[dict[str, Any]]) -> Iterator[Metric]:
    labels = ["worker"]
    live = _family(GaugeMetricFamily, "carpool_workers", "live workers, by health", ["health"])
    rho = _family(GaugeMetricFamily, "carpool_worker_rho", "a worker's reported load", labels)
    inflight = _family(
        GaugeMetricFamily, "carpool_worker_inflight_batches", "batches at the worker", labels
    )
    slots = _family(GaugeMetricFamily, "carpool_worker_slots", "a worker's credits", labels)
    b_max = _family(
        GaugeMetricFamily,
        "carpool_worker_b_max",
        "a worker's current batch limit per model",
        ["worker", "model"],
    )
    health = Counter(w["health"] for w in workers)
    for state in ("healthy", "probation", "unhealthy"):
        live.add_metric([state], health[state])
    seen: Counter[str] = Counter()
    for w in workers:
        seen[w["name"]] += 1  # names need not be unique: the second is name#2
        name = w["name"] if seen[w["name"]] == 1 else f"{w['name']}#{seen[w['name']]}"
        rho.add_metric([name], w["rho"])
        inflight.add_metric([name], w["outstanding"])
        slots.add_metric([name], w["slots"])
        for model, lane in sorted(w["lanes"].items()):
            b_max.add_metric([name, model], lane["b_max"])
    yield from (live, rho, inflight, slots, b_max)
