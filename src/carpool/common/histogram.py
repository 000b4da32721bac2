"""histogram.py: Histogram — counts per bucket and their sum, as Prometheus keeps them.

Pure, and cheap to observe into on a loop's hot path (a bisect and an add); copied whole
for a snapshot. The bucket bounds the broker and workers use are here, so their
histograms line up on one dashboard.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

#: Upper bounds of the time histograms' buckets, in seconds (+Inf follows): from a CPU
#: model's sub-millisecond batches to a detector's seconds on a 1080p frame.
TIME_BOUNDS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Upper bounds of the batch-size histograms' buckets, in samples.
BATCH_BOUNDS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Histogram:
    """``counts[i]``: observations in ``(bounds[i-1], bounds[i]]``, the last one above
    every bound; ``sum``: their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus's buckets: (``le`` as text, observations at or below it), ending
        with ("+Inf", count)."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            out.append(("+Inf" if math.isinf(bound) else f"{bound:g}", float(total)))
        return out

    def copy(self) -> Histogram:
        other = Histogram(self.bounds)
        other.counts = list(self.counts)
        other.sum = self.sum
        return other
