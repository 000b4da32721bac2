"""snapshot.py: the STATS reply, built from the broker's stats and its state.

Pure. :func:`snapshot` is what a STATS request answers (msgpack-friendly: str keys
only), with the per-model table of :func:`model_table`; the counters are
:class:`~carpool.broker.stats.BrokerStats`'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from carpool.broker.adaptive import CostEstimate, Lane
from carpool.broker.config import BatchingConfig
from carpool.broker.registry import WorkerRegistry
from carpool.broker.stats import BrokerStats


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


def _bucket_snapshot(counts: list[int]) -> dict[str, Any]:
    batches, samples, padded, elements = counts
    return {
        "batches": batches,
        "samples": samples,
        "padded_elements": padded,
        "bucket_elements": elements,
        "padded_share": round(padded / elements, 4) if elements else 0.0,
    }


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
