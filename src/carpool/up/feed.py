"""feed.py: what the fleet page shows, from the broker's STATS and the supervisor's table.

:class:`FleetFeed` is pure: :meth:`FleetFeed.on_stats` takes one STATS answer and its
time, :meth:`FleetFeed.view` returns the page's JSON. Rates and distributions are over
the last ``window_s`` of answers: QPS is the samples the workers ran per second (from
STATS ``batch_sizes``, so every client's requests count, not only the built-in
traffic's), the batch sizes those batches had. Latency percentiles are those the
built-in clients measured (STATS carries none), null without traffic.

:class:`StatsPoller` is its shell: a thread with its own :class:`~carpool.client.Client`
that asks STATS about once a second.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carpool.client import Client, RequestError
from carpool.up.processes import FleetStatus

logger = logging.getLogger(__name__)

WINDOW_S = 10.0
POLL_S = 1.0


def _sizes(stats: Mapping[str, Any]) -> Counter[int]:
    """Batches by size, every model together."""
    out: Counter[int] = Counter()
    for sizes in (stats.get("batch_sizes") or {}).values():
        for size, count in sizes.items():
            out[int(size)] += int(count)
    return out


@dataclass(slots=True)
class FleetFeed:
    """The page's figures, from the STATS answers of the last ``window_s``."""

    window_s: float = WINDOW_S
    answers: deque[tuple[float, dict[str, Any]]] = field(default_factory=deque)
    broker_up: bool = False

    def on_stats(self, now: float, stats: dict[str, Any] | None) -> None:
        """One STATS answer at ``now`` (None: the broker did not answer)."""
        self.broker_up = stats is not None
        if stats is None:
            return
        self.answers.append((now, stats))
        while len(self.answers) > 2 and self.answers[1][0] <= now - self.window_s:
            self.answers.popleft()

    def view(
        self,
        fleet: FleetStatus,
        latencies_ms: Sequence[float] = (),
        traffic: Mapping[str, Any] | None = None,
        max_workers: int = 0,
    ) -> dict[str, Any]:
        """The page's JSON: broker, workers (STATS and the supervisor's table merged by
        name), QPS, batch sizes and latency percentiles over the window."""
        latest = self.answers[-1][1] if self.answers else {}
        sizes: Counter[int] = Counter()
        qps = 0.0
        if len(self.answers) >= 2:
            (t0, first), (t1, last) = self.answers[0], self.answers[-1]
            sizes = _sizes(last)
            sizes.subtract(_sizes(first))
            sizes = +sizes  # (drop sizes of no batch in the window; a restart's negatives)
            if t1 > t0:
                qps = sum(s * n for s, n in sizes.items()) / (t1 - t0)
        batches = sum(sizes.values())
        p50, p95, p99 = (
            (float(v) for v in np.percentile(latencies_ms, [50, 95, 99]))
            if len(latencies_ms)
            else (None, None, None)
        )
        return {
            "broker": {
                "up": self.broker_up,
                "queued": latest.get("queued", 0),
                "inflight_batches": latest.get("inflight_batches", 0),
                "errors": latest.get("errors", {}),
                "shed": latest.get("shed", 0),
            },
            "qps": round(qps, 2),
            "latency_ms": {"p50": p50, "p95": p95, "p99": p99},
            "batch_sizes": {str(s): n for s, n in sorted(sizes.items())},
            "mean_batch": round(sum(s * n for s, n in sizes.items()) / batches, 2)
            if batches
            else None,
            "workers": _workers(latest.get("workers", []), fleet),
            "live_workers": len(latest.get("workers", [])),
            "desired": fleet.desired,
            "max_workers": max_workers,
            "stopping": fleet.stopping,
            "traffic": dict(traffic) if traffic is not None else None,
            "window_s": self.window_s,
        }


def _workers(reported: Sequence[Mapping[str, Any]], fleet: FleetStatus) -> list[dict[str, Any]]:
    """One entry per worker the broker lists or the supervisor runs, by name."""
    table = {c.name: c for c in fleet.workers()}
    out = []
    for w in reported:
        name = str(w.get("name", ""))
        child = table.pop(name, None)
        lanes = w.get("lanes", {})
        out.append(
            {
                "name": name,
                "registered": True,
                "rho": float(w.get("rho", 0.0)),
                "b_max": {m: lane.get("b_max") for m, lane in sorted(lanes.items())},
                "slots": w.get("slots", 0),
                "outstanding": w.get("outstanding", 0),
                "health": w.get("health", ""),
                "models": list(w.get("models", [])),
                "state": child.state if child else "outside",  # not one of ours
                "pid": child.pid if child else None,
                "restarts": child.restarts if child else 0,
            }
        )
    out.extend(  # started (or waiting to be), not registered (yet, or any more)
        {
            "name": c.name,
            "registered": False,
            "rho": 0.0,
            "b_max": {},
            "slots": 0,
            "outstanding": 0,
            "health": "",
            "models": [],
            "state": c.state,
            "pid": c.pid,
            "restarts": c.restarts,
        }
        for c in table.values()
    )
    return sorted(out, key=lambda w: str(w["name"]))


class StatsPoller:
    """Ask the broker for STATS every ``POLL_S`` and hand each answer to ``on_stats``.

    Args:
        client: a client of the broker's frontend (this thread's own).
        on_stats: called with the answer, or None when there is none.
    """

    def __init__(self, client: Client, on_stats: Callable[[dict[str, Any] | None], None]) -> None:
        self.client = client
        self.on_stats = on_stats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="carpool-up-stats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self.client.clock.now()
            try:
                stats: dict[str, Any] | None = self.client.stats(timeout_s=POLL_S)
            except (TimeoutError, RequestError) as exc:
                logger.debug("no STATS answer: %s", exc)
                stats = None
            self.on_stats(stats)
            self._stop.wait(max(0.0, POLL_S - (self.client.clock.now() - started)))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.client.close()
