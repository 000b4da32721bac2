"""adaptive.py: what a worker's lane (:class:`Lane`: one model on one worker) learns:
the batch cost (:class:`LatencyModel`), and, under the ``seed`` comparison policy, a
B_max driven by the worker's load ρ (:class:`BatchSizeController`).

Pure: ``now`` and ρ are passed in.

* The seeds' rule (``seed`` policy only): ρ high → smaller B_max, ρ low → larger, each
  step scaled by a learning rate. It aims at latency but is backwards for capacity: with a
  batch cost α + β·B, at arrival rate λ the engine is busy ρ(B) = λ·(α/B + β), which
  *falls* as B grows. Shrinking B when ρ is high pushes a saturated engine further into
  overload. carpool's own policy keeps the configured B_max as its size and adapts the
  wait instead (docs/batching.md §4).
* Output: B_cont is rounded up to the next allowed size (a TensorRT profile size, or an
  integer); it moves down only when two steps in a row ask for it, so noise near a
  boundary does not flip it; bounded by [1, cap].

:class:`LatencyModel` fits batch duration ≈ fixed_cost_s + per_sample_s·n online, fed
with (samples, duration) pairs from worker reports. History is bounded per batch size
(the last ``per_size`` durations of each size), so points at sizes seen rarely survive a
long run of one size and the fit stays determined. The fit is a weighted least squares
over per-size medians (robust to stragglers), with both coefficients clipped at zero: a
negative fixed cost (seen on CPUs) means "none".
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from carpool.broker.requests import RequestKey


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """Knobs of the seeds' ρ rule (defaults in one place)."""

    target_rho: float = 0.5
    learning_rate: float = 0.5
    interval_s: float = 0.5  # at most one step per interval (ρ is a ~1 s moving average)


class BatchSizeController:
    """The seeds' adaptive B_max of one worker for one model (the ``seed`` policy).

    Args:
        cap: the engine's max batch (and the broker's configured B_max, if lower).
        preferred: sizes the engine prefers; empty means any size.
        initial: starting B_max (defaults to ``cap``: start permissive, adapt down).
    """

    def __init__(
        self,
        cap: int,
        preferred: Sequence[int] = (),
        *,
        initial: int | None = None,
        config: AdaptiveConfig | None = None,
    ) -> None:
        self.cap = max(1, cap)
        self.preferred = tuple(sorted(p for p in set(preferred) if 1 <= p <= self.cap))
        self.config = config or AdaptiveConfig()
        start = self.cap if initial is None else min(max(1, initial), self.cap)
        self.b_cont = float(start)
        self.batch_size = self._snap_up(start)
        self._next_update_s = -math.inf
        self._down_votes = 0
        self.updates = 0

    def update(self, now: float, rho: float) -> bool:
        """Take one step from a fresh ρ; returns True if a step was taken."""
        if now < self._next_update_s or not 0.0 <= rho <= 1.0:
            return False
        self._next_update_s = now + self.config.interval_s
        cfg = self.config
        # The seeds' rule, as written: busy → smaller batches, idle → larger.
        step = -cfg.learning_rate * (rho - cfg.target_rho) / cfg.target_rho
        self.b_cont = min(float(self.cap), max(1.0, self.b_cont * math.exp(step)))
        self._resnap()
        self.updates += 1
        return True

    def _snap_up(self, value: float) -> int:
        """The smallest allowed size >= ``value`` (the cap if none is). Values within 2%
        above a size count as that size, so that a small step does not round up past it."""
        if value >= self.cap * 0.999:
            return self.cap
        value *= 0.98
        if not self.preferred:
            return min(self.cap, max(1, math.ceil(value)))
        i = bisect.bisect_left(self.preferred, value)
        return self.preferred[i] if i < len(self.preferred) else self.cap

    def _resnap(self) -> None:
        snapped = self._snap_up(self.b_cont)
        if snapped >= self.batch_size:
            self.batch_size = snapped
            self._down_votes = 0
            return
        # Move down only when two steps in a row ask for it (hysteresis in time), so noise
        # in one ρ reading near a size boundary does not flip the size back and forth.
        self._down_votes += 1
        if self._down_votes >= 2:
            self.batch_size = snapped
            self._down_votes = 0


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

    def observe(self, samples: int, duration_s: float) -> bool:
        """Record one finished batch; True when the fit will change (it is refitted at the
        next look), False when the point only waits for a later refit."""
        if samples < 1 or not duration_s >= 0:
            return False
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
            return True
        return False

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


#: What :meth:`Lane.overhead` answers while no ``cpu_ms`` came (never written).
_NO_OVERHEAD = CostEstimate()


@dataclass(slots=True)
class Lane:
    """What the broker learns about one model on one worker."""

    # Adaptive B_max; None under policies that keep B_max fixed.
    controller: BatchSizeController | None
    max_batch: int  # the engine's limit (a request may not carry more samples)
    cap: int = 0  # the configured B_max, if lower than the engine's limit (0: none)
    latency: dict[RequestKey, LatencyModel] = field(default_factory=dict)
    # The worker's CPU per batch outside its engine (RESULT ``cpu_ms``), fitted as the
    # engine's time is: per key, against the batch's samples.
    cpu: dict[RequestKey, LatencyModel] = field(default_factory=dict)
    last_key: RequestKey | None = None

    @property
    def batch_limit(self) -> int:
        """The current B_max: the adaptive size, within the configured and engine limits."""
        # (min of two, as expressions) speed: docs/benchmarks.md "Why the hot path looks as it does"
        cap, limit = self.cap, self.max_batch
        if cap and cap < limit:
            limit = cap
        if self.controller is None:
            return limit
        size = self.controller.batch_size
        return size if size < limit else limit

    @property
    def bound_by(self) -> str:
        """Which limit sets :attr:`batch_limit`: ``"adaptive"`` (the controller's size,
        below both caps), ``"broker"`` (its max_batch, below the engine's limit) or
        ``"worker"`` (the engine's limit, which a larger broker cap cannot raise)."""
        limit = min(self.max_batch, self.cap) if self.cap else self.max_batch
        if self.controller is not None and self.controller.batch_size < limit:
            return "adaptive"
        return "broker" if self.cap and self.cap < self.max_batch else "worker"

    def cost(self, key: RequestKey | None) -> CostEstimate:
        model = self.latency.get(key) if key is not None else None
        return model.cost if model is not None else CostEstimate()

    def overhead(self, key: RequestKey) -> CostEstimate:
        """The worker's fitted CPU per batch of ``key`` outside its engine (none known:
        zero)."""
        model = self.cpu.get(key)
        return model.cost if model is not None else _NO_OVERHEAD

    #: Item shapes whose costs a lane remembers (clients choose shapes; keep it bounded).
    MAX_SHAPES = 64

    def observe(self, key: RequestKey, samples: int, duration_s: float) -> bool:
        """Teach the key's cost fit a batch; True when the fit will change."""
        self.last_key = key
        return _fit_of(self.latency, key).observe(samples, duration_s)

    def observe_cpu(self, key: RequestKey, samples: int, cpu_s: float) -> None:
        """Teach the key's overhead fit a batch's ``cpu_ms`` (in seconds)."""
        _fit_of(self.cpu, key).observe(samples, cpu_s)


def _fit_of(fits: dict[RequestKey, LatencyModel], key: RequestKey) -> LatencyModel:
    """The fit of ``key`` in ``fits``, made where there is none (the longest-known shape
    goes when :attr:`Lane.MAX_SHAPES` are known: clients choose shapes)."""
    model = fits.get(key)
    if model is None:
        if len(fits) >= Lane.MAX_SHAPES:
            del fits[next(iter(fits))]
        model = fits[key] = LatencyModel()
    return model
