"""compare.py: run one workload under several batching policies; find the best fixed one.

The policies compared are the ones a user could deploy:

* no batching — B_max 1, T_max 0;
* fixed — B_max and T_max as Triton configures them (FIFO, no deadline awareness);
* seed ρ-gradient — fixed T_max, B_max moved by the seeds' rule (busy → smaller);
* carpool — the deadline-aware adaptive policy (the broker's default);
* oracle — the best fixed (B_max, T_max) on a grid, found by replaying the workload: the
  bound a perfectly tuned static configuration reaches, which carpool must approach
  without being told the workload.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from carpool.broker.config import BatchingConfig
from carpool.sim.simulator import SimResult, SimWorker, simulate
from carpool.sim.workload import Arrival

GRID_BATCH = (1, 2, 4, 8, 16, 32, 64)
GRID_WAIT_MS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0)


@dataclass(frozen=True, slots=True)
class GridPoint:
    max_batch: int
    max_wait_s: float
    result: SimResult


def _rank(r: SimResult) -> tuple[int, float, float]:
    # Most requests answered in time first (every point replays the same arrivals: the
    # same order as goodput, with no rate to divide); then the lower p99 (none: last);
    # then the smaller batches (less waiting for nothing).
    p99 = r.percentile_ms(99)
    return (-r.on_time, math.inf if math.isnan(p99) else p99, r.mean_batch)


def grid_search(
    arrivals: Sequence[Arrival],
    workers: Sequence[SimWorker],
    *,
    batch_sizes: Sequence[int] = GRID_BATCH,
    waits_ms: Sequence[float] = GRID_WAIT_MS,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> list[GridPoint]:
    """Every fixed (B_max, T_max) on the grid, best first."""
    cap = min(w.max_batch for w in workers)
    # Where the engine's limit cuts the grid short, the limit itself is a candidate too
    # (an engine of 48 is tried at 48, not only at 32).
    sizes = sorted(
        {b for b in batch_sizes if b <= cap} | ({cap} if max(batch_sizes) > cap else set())
    )
    combos = [(b, t) for b in sizes for t in waits_ms if b > 1 or t == 0]
    points = []
    for i, (b, t_ms) in enumerate(combos):
        cfg = BatchingConfig(max_batch=b, max_wait_s=t_ms / 1000, policy="fixed")
        label = f"fixed B={b} T={t_ms:g}ms"
        points.append(
            GridPoint(b, t_ms / 1000, simulate(arrivals, workers, cfg, label=label, seed=seed))
        )
        if progress is not None:
            progress(i + 1, len(combos))
    points.sort(key=lambda p: _rank(p.result))
    return points


def compare(
    arrivals: Sequence[Arrival],
    workers: Sequence[SimWorker],
    *,
    fixed_batch: int = 8,
    fixed_wait_s: float = 0.005,
    carpool_wait_s: float = 0.005,
    oracle: bool = True,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> list[SimResult]:
    """The policies of the module docstring on one workload, in table order."""
    cap = min(w.max_batch for w in workers)
    policies = [
        ("no batching", BatchingConfig(max_batch=1, max_wait_s=0.0, policy="fixed")),
        (
            f"fixed B={fixed_batch} T={1000 * fixed_wait_s:g}ms",
            BatchingConfig(max_batch=fixed_batch, max_wait_s=fixed_wait_s, policy="fixed"),
        ),
        (
            "seed rho-gradient",
            BatchingConfig(max_batch=cap, max_wait_s=fixed_wait_s, policy="seed"),
        ),
        ("carpool", BatchingConfig(max_batch=cap, max_wait_s=carpool_wait_s, policy="carpool")),
    ]
    results = [simulate(arrivals, workers, cfg, label=label, seed=seed) for label, cfg in policies]
    if oracle:
        best = grid_search(arrivals, workers, seed=seed, progress=progress)[0]
        best.result.label = f"oracle: {best.result.label}"
        results.append(best.result)
    return results


def table(results: Sequence[SimResult]) -> str:
    """A plain-text table of results."""
    head = (
        f"{'policy':<28} {'thru/s':>8} {'good/s':>8} {'p50 ms':>7} {'p95 ms':>7} "
        f"{'p99 ms':>7} {'miss %':>7} {'mean B':>7} {'busy %':>7}"
    )
    rows = [
        f"{r.label:<28} {r.throughput_rps:8.1f} {r.goodput_rps:8.1f} "
        f"{r.percentile_ms(50):7.1f} {r.percentile_ms(95):7.1f} {r.percentile_ms(99):7.1f} "
        f"{100 * r.miss_rate:7.2f} {r.mean_batch:7.2f} {100 * r.busy_share:7.1f}"
        for r in results
    ]
    return "\n".join([head, "-" * len(head), *rows])


def as_records(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """One JSON-ready map per result (a percentile of no answers is NaN: see
    ``commands.write_json``)."""
    return [
        {
            "policy": r.label,
            "sent": r.sent,
            "throughput_rps": r.throughput_rps,
            "goodput_rps": r.goodput_rps,
            "p50_ms": r.percentile_ms(50),
            "p95_ms": r.percentile_ms(95),
            "p99_ms": r.percentile_ms(99),
            "miss_rate": r.miss_rate,
            "mean_batch": r.mean_batch,
            "busy_share": r.busy_share,
            "errors": dict(r.errors),
        }
        for r in results
    ]


def as_json(results: Sequence[SimResult]) -> str:
    return json.dumps(as_records(results), indent=2)
