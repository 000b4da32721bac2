"""latency.py: LatencyModel — an online fit of batch duration ≈ fixed_cost_s + per_sample_s·n.

Pure: fed with (samples, duration) pairs from worker reports; never reads a clock.
History is bounded per batch size (the last ``per_size`` durations of each size), so
points at sizes seen rarely survive a long run of one size and the fit stays determined.
The fit is a weighted least squares over per-size medians (robust to stragglers), with
both coefficients clipped at zero: a negative fixed cost (seen on CPUs) means "none".
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """A fitted cost line. ``calibrated`` is False until two batch sizes were seen."""

    fixed_cost_s: float = 0.0
    per_sample_s: float = 0.0
    calibrated: bool = False
    # Relative spread of batch durations around the fit (one standard deviation).
    spread: float = 0.0

    def estimate(self, samples: int) -> float:
        """Predicted duration of a batch of ``samples``."""
        return self.fixed_cost_s + self.per_sample_s * samples

    def fixed_share(self, samples: int = 1) -> float:
        """The part of a batch's cost that batching amortises (0 = none, as on CPUs)."""
        total = self.estimate(samples)
        return self.fixed_cost_s / total if total > 0 else 0.0


class LatencyModel:
    """Online linear fit of batch duration against batch size.

    Args:
        per_size: durations kept per batch size.
        max_sizes: distinct batch sizes kept (least recently seen dropped first).
    """

    REFIT_EVERY = 8

    def __init__(self, *, per_size: int = 16, max_sizes: int = 64) -> None:
        self.per_size = per_size
        self.max_sizes = max_sizes
        self._by_size: dict[int, deque[float]] = {}
        self._fit = CostEstimate()
        self._dirty = False
        self.observations = 0

    def observe(self, samples: int, duration_s: float) -> None:
        """Record one finished batch."""
        if samples < 1 or not duration_s >= 0:
            return
        history = self._by_size.pop(samples, None)  # re-inserted last: recency order
        if history is None:
            history = deque(maxlen=self.per_size)
            if len(self._by_size) >= self.max_sizes:
                del self._by_size[next(iter(self._by_size))]
        history.append(duration_s)
        self._by_size[samples] = history
        self.observations += 1
        # Refit after each of the first observations, then every REFIT_EVERY: one more
        # point barely moves a fit of hundreds, and refitting is the costly part.
        if self.observations <= 64 or self.observations % self.REFIT_EVERY == 0:
            self._dirty = True

    @property
    def cost(self) -> CostEstimate:
        """The current fit (recomputed lazily after new observations)."""
        if self._dirty:
            self._fit = self._refit()
            self._dirty = False
        return self._fit

    def estimate(self, samples: int) -> float:
        return self.cost.estimate(samples)

    def _spread(self) -> float:
        """Pooled relative standard deviation of durations around each size's median."""
        deviations = [
            (x / m - 1.0) ** 2
            for d in self._by_size.values()
            if len(d) > 1 and (m := statistics.median(d)) > 0
            for x in d
        ]
        return math.sqrt(sum(deviations) / len(deviations)) if deviations else 0.0

    def _refit(self) -> CostEstimate:
        fit = self._line()
        return CostEstimate(fit.fixed_cost_s, fit.per_sample_s, fit.calibrated, self._spread())

    def _line(self) -> CostEstimate:
        points = [(n, statistics.median(d), len(d)) for n, d in self._by_size.items()]
        if not points:
            return CostEstimate()
        if len(points) == 1:
            # One size only: the split between fixed and per-sample cost is unknown. Keep
            # the total right and call it per-sample (no reason yet to wait for a batch).
            n, d, _ = points[0]
            return CostEstimate(0.0, d / n, calibrated=False)
        w_sum = sum(w for _, _, w in points)
        n_mean = sum(w * n for n, _, w in points) / w_sum
        d_mean = sum(w * d for _, d, w in points) / w_sum
        s_nn = sum(w * (n - n_mean) ** 2 for n, _, w in points)
        s_nd = sum(w * (n - n_mean) * (d - d_mean) for n, d, w in points)
        per_sample = s_nd / s_nn
        fixed = d_mean - per_sample * n_mean
        if fixed < 0:  # refit through the origin
            fixed = 0.0
            per_sample = sum(w * d for _, d, w in points) / sum(w * n for n, _, w in points)
        if per_sample < 0:  # duration does not grow with size: all of it is fixed
            per_sample = 0.0
            fixed = d_mean
        return CostEstimate(fixed, per_sample, calibrated=True)
