"""policy.py: when a queue's batch leaves, and how big it is. Pure: never reads a clock or
touches a socket; the broker core and the simulator call the same code.

A policy looks at one queue (its size, oldest arrival, most urgent deadline) and at the
worker that would take the batch (its batch limit, when it will be free, its fitted cost)
and answers ``Dispatch(max_samples)`` now or ``WaitUntil(t)``. It also says which requests
are hopeless (``shed_before``) and in which order a queue is served.

The value objects here are plain slotted dataclasses, not frozen; treat them as immutable
all the same (speed: docs/benchmarks.md "Why the hot path looks as it does").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from carpool.broker.adaptive import CostEstimate

#: Why a batch leaves (:attr:`Dispatch.reason`; the broker logs it at DEBUG).
FULL = "full"  # B_max aboard
WAITED = "waited"  # the oldest waited T_max (or, below the sustainable floor, its fill time)
DEADLINE = "deadline"  # the most urgent request's latest start
COST = "cost"  # batching buys nothing at the fitted cost (or the cost is not known yet)


@dataclass(slots=True)
class Dispatch:
    """Send a batch now, of at most ``max_samples`` samples; ``reason``: why it leaves
    now (one of the constants above; not part of equality)."""

    max_samples: int
    reason: str = field(default=FULL, compare=False)


@dataclass(slots=True)
class WaitUntil:
    """Nothing to do before monotonic time ``t``."""

    t: float


Decision = Dispatch | WaitUntil


@dataclass(slots=True)
class QueueView:
    """What a policy may know about a queue."""

    samples: int  # samples still queued
    oldest_arrival_s: float  # arrival of the oldest queued request
    earliest_deadline_s: float = float("inf")  # most urgent queued request
    # Arrival rate this worker must keep up with: the queue's rate / workers serving it.
    arrival_sps: float = 0.0


@dataclass(slots=True)
class Capacity:
    """The worker that would take the batch."""

    max_batch: int  # its current B_max for this model (engine limit and adaptive size)
    ready_in_s: float = 0.0  # predicted time until it has finished what it already holds
    cost: CostEstimate = field(default_factory=CostEstimate)
    # The engine's hard limit (>= max_batch); 0 means the same as max_batch.
    engine_max: int = 0
    # The worker's CPU per batch outside its engine (RESULT ``cpu_ms``), and the share of
    # it that is taken from the engine: its host's CPU in use, 0..1 (telemetry; 0 where
    # not reported, as on a host with cores to spare it costs the engine nothing).
    overhead: CostEstimate = field(default_factory=CostEstimate)
    host_busy: float = 0.0

    @property
    def hard_max(self) -> int:
        # (max, as an expression) speed: docs/benchmarks.md "Why the hot path looks as it does"
        return self.engine_max if self.engine_max > self.max_batch else self.max_batch

    def batch_cost(self) -> tuple[float, float]:
        """What a batch costs the worker's capacity, fixed and per sample: the engine's
        fitted time plus the share of the worker's own CPU per batch that its busy host
        takes from the engine."""
        cost, overhead, share = self.cost, self.overhead, self.host_busy
        return (
            cost.fixed_cost_s + share * overhead.fixed_cost_s,
            cost.per_sample_s + share * overhead.per_sample_s,
        )


class BatchPolicy(Protocol):
    @property
    def edf(self) -> bool:
        """Serve a queue earliest-deadline-first (with priorities) rather than by arrival."""
        ...

    @property
    def share_idle(self) -> bool:
        """Split what may leave now among the workers idle at that moment."""
        ...

    def decide(self, now: float, queue: QueueView, capacity: Capacity) -> Decision:
        """Decide for one non-empty queue."""
        ...

    def shed_before(self, now: float, capacity: Capacity) -> float:
        """Requests with a deadline before this time cannot be answered in time by the
        worker ``capacity`` describes (it depends on the worker, not on the queue)."""
        ...

    def refuses(self, predicted_s: float, cost: CostEstimate, budget_s: float) -> bool:
        """At the door: a request predicted to be answered in ``predicted_s`` (by batches
        of ``cost``) cannot make it within ``budget_s``."""
        ...


@dataclass(frozen=True, slots=True)
class FixedPolicy:
    """The minibus rule with fixed knobs, as Triton configures it: leave when full
    (B_max) or when the oldest has waited T_max; FIFO; deadlines are only enforced once
    they have passed. With ``max_batch=1`` it is "no batching"."""

    max_batch: int
    max_wait_s: float
    edf: bool = False
    # Triton's batcher gives a formed batch to one free instance; so does this baseline.
    share_idle: bool = False

    def decide(self, now: float, queue: QueueView, capacity: Capacity) -> Decision:
        # (min, as a test) speed: docs/benchmarks.md "Why the hot path looks as it does"
        limit = capacity.max_batch
        if self.max_batch <= limit:
            limit = self.max_batch
        if queue.samples >= limit:
            return Dispatch(limit, FULL)
        leave_at = queue.oldest_arrival_s + self.max_wait_s
        if now >= leave_at:
            return Dispatch(limit, WAITED)
        return WaitUntil(leave_at)

    def shed_before(self, now: float, capacity: Capacity) -> float:
        return now

    def refuses(self, predicted_s: float, cost: CostEstimate, budget_s: float) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class DeadlinePolicy:
    """carpool's policy: the minibus rule bounded by the SLA countdown.

    * Size: the worker's B_max (the configured cap within its engine's limit), shrunk
      until the batch fits in the most urgent request's slack (its deadline − the worker's
      backlog − the batch's predicted time − ``margin_s``), never below one request, nor
      below the floor that keeps up with the arrival rate (or what is queued, if less)
      where that floor is within reach.
    * Wait: none where batching buys nothing (the fixed cost, the engine's and the share
      of the worker's own CPU that its busy host takes from it, is under
      ``min_fixed_share`` of a single-sample batch, as for CPU models on a host with cores
      to spare, or the cost is not known yet). Otherwise until the earliest of T_max
      after the oldest arrival and the most urgent request's latest start; while the
      worker is still busy, the batch may keep filling until shortly before it is free,
      since leaving earlier would only queue there.
    * Sharing (``share_idle``): what leaves at once while several workers are idle is
      split among them by the broker (workers run in parallel: a batch each ends sooner).
    * Shedding: a request whose deadline comes before the earliest possible completion
      (the best worker's backlog + a one-sample batch) is hopeless.
    """

    max_batch: int
    max_wait_s: float
    margin_s: float = 0.002
    # Predictions are stretched by the measured spread of batch times (one standard
    # deviation, at least this much) before they are held against a deadline: batch times
    # jitter, and a worker's backlog is itself a prediction.
    min_jitter_share: float = 0.02
    min_fixed_share: float = 0.2
    edf: bool = True
    share_idle: bool = True

    #: Capacity kept above the measured arrival rate by the sustainable-size floor.
    headroom: float = 1.0

    def batch_limit(self, now: float, queue: QueueView, capacity: Capacity) -> int:
        """The batch size (:meth:`sized`'s, without whether the guard shrank it)."""
        return self.sized(now, queue, capacity)[0]

    def sized(
        self, now: float, queue: QueueView, capacity: Capacity, floor: int | None = None
    ) -> tuple[int, bool]:
        """The batch size, and whether the deadline guard shrank it (``floor``:
        :meth:`floor`'s, where the caller has it).

        * Backlog (more queued than the target below): take as many as the engine allows.
          A backlog means throughput is what is short, and with a fixed cost the largest
          batch has the most of it; members that this batch would finish too late are shed
          by the broker rather than served late.
        * Otherwise the target: B_max, never below the floor that keeps up with the arrival
          rate (where the engine takes more than B_max), shrunk so the most urgent
          request's SLA countdown still holds: the wait for a fuller batch
          must not cost that request its deadline.
          Where the floor is below the engine's limit (some size keeps up), the shrink
          stops at the floor, or at what is queued if that is less: a batch below the
          floor leaves the queue growing, each next most urgent request has less slack
          and shrinks the next batch further, down to batches of one that shed nearly
          everything. A request the floor's batch cannot finish in time is shed instead.
        """
        if floor is None:
            floor = self.floor(queue, capacity)
        return self._sized(now, queue, capacity, floor, self._stretch(capacity.cost))

    def _sized(
        self, now: float, queue: QueueView, capacity: Capacity, floor: int, stretch: float
    ) -> tuple[int, bool]:
        """:meth:`sized`, with the floor and the cost's stretch (:meth:`_stretch`) given."""
        # (min and max, as tests) speed: docs/benchmarks.md "Why the hot path looks as it does"
        hard = capacity.hard_max
        if self.max_batch < hard:
            hard = self.max_batch
        target = floor if floor > capacity.max_batch else capacity.max_batch
        if hard < target:
            target = hard
        if queue.samples > target:
            return (hard if hard < queue.samples else queue.samples), False
        cost = capacity.cost
        if not cost.calibrated:
            return target, False
        # Largest n with stretch·(ready_in + fixed + per_sample·n) <= slack, at least 1.
        slack = queue.earliest_deadline_s - now - self.margin_s
        ready_s = capacity.ready_in_s
        if _finish_s(stretch, ready_s, cost, target) <= slack:
            return target, False
        # Where a size keeps up with the arrivals, never below it (see above); in overload
        # none does, and the guard serves the most urgent requests that can still make it.
        least = max(1, min(floor, queue.samples)) if floor < hard else 1
        budget = slack / stretch - ready_s - cost.fixed_cost_s
        if cost.per_sample_s <= 0:
            return least, least < target
        fits = budget / cost.per_sample_s
        if not math.isfinite(fits):  # a vanishing per-sample cost
            return (target, False) if fits > 0 else (least, least < target)
        size = max(least, min(target, math.floor(fits + 1e-9)))
        return size, size < target

    def floor(self, queue: QueueView, capacity: Capacity) -> int:
        """The smallest batch whose throughput n / (fixed + per_sample·n), at
        :meth:`Capacity.batch_cost`, keeps up with ``headroom`` × the arrival rate, within
        [1, B_max]. Below it a batch waits for it to fill."""
        if not capacity.cost.calibrated:
            return 1
        return self._floor(queue.arrival_sps, capacity, *capacity.batch_cost())

    def _floor(
        self, arrival_sps: float, capacity: Capacity, fixed_s: float, per_sample_s: float
    ) -> int:
        """:meth:`floor` of a calibrated cost, with its batch cost given."""
        demand = self.headroom * arrival_sps
        if demand <= 0 or fixed_s <= 0:
            return 1
        # (min and max, as tests) speed: docs/benchmarks.md "Why the hot path looks as it does"
        cap = capacity.hard_max
        if self.max_batch < cap:
            cap = self.max_batch
        room = 1.0 - demand * per_sample_s
        if room <= 0:
            return cap
        least = math.ceil(demand * fixed_s / room)
        if least < 1:
            least = 1
        return least if least < cap else cap

    def decide(self, now: float, queue: QueueView, capacity: Capacity) -> Decision:
        cost = capacity.cost
        if not cost.calibrated:  # (floor 1; batching cannot be shown to pay)
            return Dispatch(self._sized(now, queue, capacity, 1, 1.0)[0], COST)
        # What floor, sizing and the cost test share, worked out once (one call each: a
        # decision is made at every arrival): speed: docs/benchmarks.md "Why the hot path
        # looks as it does"
        fixed_s, per_sample_s = capacity.batch_cost()
        floor = self._floor(queue.arrival_sps, capacity, fixed_s, per_sample_s)
        stretch = self._stretch(cost)
        limit, shrunk = self._sized(now, queue, capacity, floor, stretch)
        if not self._pays(fixed_s, per_sample_s):
            return Dispatch(limit, COST)  # waiting would buy no throughput, only latency
        ready_s = capacity.ready_in_s
        busy = ready_s > self.margin_s
        if queue.samples >= limit and not busy:
            return Dispatch(limit, DEADLINE if shrunk else FULL)
        # The last moment the batch that is aboard may leave and still end by the most urgent
        # deadline. Sized by who is aboard now (every arrival re-decides): sized by the
        # limit instead, the guard would shrink the limit at that moment, push the moment
        # later, and wake the broker again and again for one batch.
        # (min and max, as tests) speed: docs/benchmarks.md "Why the hot path looks as it does"
        aboard = queue.samples if queue.samples < limit else limit
        if aboard < 1:
            aboard = 1
        latest_start = (
            queue.earliest_deadline_s - _finish_s(stretch, ready_s, cost, aboard) - self.margin_s
        )
        if queue.samples >= limit:
            # Full, but the worker is still busy: leaving now would only queue there, while
            # staying lets the batch grow (up to the engine's limit) until it is nearly free.
            leave_at = now + ready_s - self.margin_s
            if latest_start < leave_at:
                leave_at = latest_start
            return Dispatch(limit, DEADLINE) if now >= leave_at else WaitUntil(leave_at)
        leave_at = queue.oldest_arrival_s + self.max_wait_s
        if busy:
            free_s = now + ready_s - self.margin_s
            if free_s > leave_at:
                leave_at = free_s
        if queue.samples < floor and queue.arrival_sps > 0:
            # Too few aboard to keep up with the arrivals: wait for the floor to fill, as
            # long as filling it should take at the measured rate, counted from the oldest
            # arrival (a fixed moment: re-deciding does not push it on).
            filled_s = queue.oldest_arrival_s + floor / queue.arrival_sps
            if filled_s > leave_at:
                leave_at = filled_s
        until = latest_start if latest_start < leave_at else leave_at
        if now < until:
            return WaitUntil(until)
        return Dispatch(limit, WAITED if now >= leave_at else DEADLINE)

    def batching_pays(self, capacity: Capacity) -> bool:
        """A batch's fixed cost (the engine's, and the worker's CPU its busy host takes
        from the engine) is at least ``min_fixed_share`` of a one-sample batch's."""
        if not capacity.cost.calibrated:
            return False
        return self._pays(*capacity.batch_cost())

    def _pays(self, fixed_s: float, per_sample_s: float) -> bool:
        """:meth:`batching_pays`, of a calibrated cost's fixed and per-sample parts."""
        one_s = fixed_s + per_sample_s
        return one_s > 0 and fixed_s >= self.min_fixed_share * one_s

    def refuses(self, predicted_s: float, cost: CostEstimate, budget_s: float) -> bool:
        # The prediction stretched as the countdown stretches it.
        return self._stretch(cost) * predicted_s > budget_s

    def _stretch(self, cost: CostEstimate) -> float:
        # (max, as an expression) speed: docs/benchmarks.md "Why the hot path looks as it does"
        spread = cost.spread
        return 1.0 + (spread if spread > self.min_jitter_share else self.min_jitter_share)

    def finish_in_s(self, capacity: Capacity, samples: int) -> float:
        """Predicted time from now to the end of a batch sent now, with a jitter allowance."""
        cost = capacity.cost
        return _finish_s(self._stretch(cost), capacity.ready_in_s, cost, samples)

    def shed_before(self, now: float, capacity: Capacity) -> float:
        if not capacity.cost.calibrated:
            return now
        # Even a batch of one, started as soon as the worker is free, would end too late.
        return now + capacity.ready_in_s + capacity.cost.estimate(1)


def _finish_s(stretch: float, ready_s: float, cost: CostEstimate, samples: int) -> float:
    """A batch of ``samples`` sent now to a worker free in ``ready_s``: its predicted end,
    stretched by ``stretch`` (:meth:`DeadlinePolicy._stretch`) for jitter."""
    return stretch * (ready_s + cost.estimate(samples))


def promotion_s(capacity: Capacity) -> float:
    """How long before its deadline a bulk request goes ahead of interactive ones (EDF
    with priorities), with the worker ``capacity`` describes: twice its backlog and a
    full batch, plus 10 ms."""
    return 2 * (capacity.cost.estimate(capacity.max_batch) + capacity.ready_in_s) + 0.01
