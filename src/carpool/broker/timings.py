"""timings.py: per-model latency figures: cumulative histograms and a recent window.

Pure: ``now`` comes in. The broker's loop counts every answered batch into its model's
:class:`ModelTimings` (:meth:`BrokerStats.answered`): each request's end-to-end time in
the broker (arrival to RESULT) and its queue wait (arrival to dispatch), and the batch's
compute time as its worker reported it. The histograms are cumulative over the broker's
life (what Prometheus scrapes); the window keeps the last :data:`WINDOW` requests'
end-to-end times, of which :meth:`ModelTimings.percentiles` reads those of the last
``window_s`` (what STATS, ``carpool status`` and ``carpool top`` show).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence

from carpool.broker.requests import PendingRequest, RequestState
from carpool.common.histogram import TIME_BOUNDS_S, Histogram

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
