"""fleet.py: what the broker knows of its workers' capacity: each model's batching policy
and what the policy is told of each worker (FleetModel).

Pure: ``now`` comes in. Per model: its batching settings ([models.X] over [batching]),
its policy (:mod:`carpool.broker.policy`), a new worker's lane (adaptive batch size and
fitted costs). Per worker: what the policy is told of it (:class:`Capacity`: batch limit,
predicted backlog, cost), its load. For the fleet: the best-case drain time of a queue
(every worker running full batches back to back), cached per request key until a cost
is refitted or a worker joins or leaves. The workers, and the batches at them, are the
registry's (:mod:`carpool.broker.registry`, :mod:`carpool.broker.inflight`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from carpool.broker.adaptive import AdaptiveConfig, BatchSizeController, CostEstimate, Lane
from carpool.broker.batcher import RequestQueue
from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.policy import (
    BatchPolicy,
    Capacity,
    DeadlinePolicy,
    FixedPolicy,
    QueueView,
)
from carpool.broker.registry import WorkerRegistry, WorkerState
from carpool.broker.requests import PendingRequest, RequestKey


@dataclass(frozen=True, slots=True)
class FleetRate:
    """What the workers of a model do together at full batches: ``samples_per_s``
    (0 while any cost is unknown), the smallest worker's ``full_batch``, and the cost of
    a last batch on the slowest of them (with the largest spread of batch times)."""

    samples_per_s: float
    full_batch: int
    last_batch: CostEstimate


_NO_RATE = FleetRate(0.0, 1, CostEstimate())

#: A predicted completion time and the cost it was predicted with; None: no prediction.
Completion = tuple[float, CostEstimate] | None


class FleetModel:
    """Policies, lanes and capacity estimates; see the module docstring."""

    def __init__(self, config: BrokerConfig, registry: WorkerRegistry) -> None:
        self.config = config
        self.registry = registry
        self._policies: dict[str, BatchPolicy] = {}
        # Each model's batching settings, merged once: the config does not change under a
        # core, and the merge is a dataclasses.replace.
        self._batching: dict[str, BatchingConfig] = {}
        # Best-case fleet throughput per key (samples/s, 0 = unknown) for admission.
        self.rates: dict[RequestKey, FleetRate] = {}

    def policy(self, model: str) -> BatchPolicy:
        policy = self._policies.get(model)
        if policy is None:
            cfg = self.batching_for(model)
            if cfg.policy == "carpool":
                policy = DeadlinePolicy(cfg.max_batch, cfg.max_wait_s, cfg.margin_s)
            else:
                policy = FixedPolicy(cfg.max_batch, cfg.max_wait_s)
            self._policies[model] = policy
        return policy

    def forget(self, model: str) -> None:
        """A model no worker serves is forgotten: drop its policy and merged settings."""
        self._policies.pop(model, None)
        self._batching.pop(model, None)
        for key in [k for k in self.rates if k[0] == model]:
            del self.rates[key]

    def batching_for(self, model: str) -> BatchingConfig:
        cfg = self._batching.get(model)
        if cfg is None:
            cfg = self._batching[model] = self.config.batching_for(model)
        return cfg

    def lane(self, model: str, engine_max: int, preferred: Sequence[int]) -> Lane:
        cfg = self.batching_for(model)
        controller = None
        if cfg.policy == "seed":  # (carpool's own policy keeps the configured B_max: §4)
            adaptive = AdaptiveConfig(
                target_rho=cfg.target_rho,
                learning_rate=cfg.learning_rate,
                interval_s=cfg.adapt_interval_s,
            )
            controller = BatchSizeController(
                min(engine_max, cfg.max_batch), preferred, config=adaptive
            )
        return Lane(controller, engine_max, min(engine_max, cfg.max_batch))

    def on_load(self, now: float, worker: WorkerState, rho: float) -> None:
        worker.rho = rho
        for lane in worker.lanes.values():
            if lane.controller is not None:  # (the seed policy's, alone)
                lane.controller.update(now, rho)

    def ready_in_s(self, now: float, worker: WorkerState) -> float:
        """Predicted time until ``worker`` has finished the batches it holds."""
        if not worker.outstanding:
            return 0.0
        # (max, as an expression) speed: docs/benchmarks.md "Why the hot path looks as it does"
        left_s = worker.free_at_s - now
        return left_s if left_s > 0.0 else 0.0

    def capacity(self, now: float, worker: WorkerState, key: RequestKey) -> Capacity:
        lane = worker.lanes[key[0]]
        return Capacity(
            lane.batch_limit,
            self.ready_in_s(now, worker),
            lane.cost(key),
            lane.max_batch,
            lane.overhead(key),
            worker.host_busy,
        )

    def drain_time_s(self, model: str, key: RequestKey, samples: int) -> float:
        """Best-case time for the fleet to get through ``samples`` of ``model``: every
        worker running full batches back to back. 0 while any cost is still unknown."""
        rate_sps = self._rate(model, key).samples_per_s
        return samples / rate_sps if rate_sps > 0 else 0.0

    def completion(
        self, now: float, model: str, key: RequestKey, samples: int, batches: int = 0
    ) -> Completion:
        """Predicted time from ``now`` until the last of ``samples`` more of ``key`` is
        answered, queued behind what waits: the soonest a worker is free of what it
        holds, ``batches`` of other keys of the model (each charged as a full batch of
        this key: keys do not share batches, and their costs are this key's best guess
        of theirs), the samples before the last batch at the fleet's full-batch rate,
        then that last batch at its own cost (the slowest worker's: however few it
        carries, it pays the whole fixed cost); with that cost, for its spread. None
        while any cost is still unknown."""
        rate = self._rate(model, key)
        if rate.samples_per_s <= 0:
            return None
        # The soonest a worker with credits is free (unhealthy ones drain nothing); an
        # idle one ends the look (a worker holding nothing is free now).
        free_s = math.inf
        for w in self.registry.admitting(key):
            if not w.credits:
                continue
            if not w.outstanding:
                free_s = 0.0
                break
            # (min and max, as tests) speed: docs/benchmarks.md "Why the hot path looks as it does"
            if w.free_at_s - now < free_s:
                free_s = w.free_at_s - now
        if free_s == math.inf or not free_s > 0.0:
            free_s = 0.0
        last = samples if samples < rate.full_batch else rate.full_batch
        cost = rate.last_batch
        ahead = batches * rate.full_batch + samples - last
        return free_s + ahead / rate.samples_per_s + cost.estimate(last), cost

    def batch_unit(self, key: RequestKey) -> int:
        """The samples of a batch of ``key`` under a backlog (the policy then takes all the
        engine allows, up to the model's B_max cap): the cap within the largest batch a
        live worker that admits the key takes; the cap alone while none does."""
        cap = self.batching_for(key[0]).max_batch
        limit = self.registry.limit(key)
        return max(1, min(cap, limit) if limit else cap)

    def _rate(self, model: str, key: RequestKey) -> FleetRate:
        rate = self.rates.get(key)
        if rate is None:
            rate = self.rates[key] = self._fleet_rate(model, key)
        return rate

    def _fleet_rate(self, model: str, key: RequestKey) -> FleetRate:
        """What the fleet of ``model`` does at full batches (no rate while any cost is
        unknown). Cached per key until a cost is refitted or a worker joins or leaves."""
        cap = self.batching_for(model).max_batch
        rate_sps = fixed_s = per_sample_s = spread = 0.0
        full = cap
        for w in self.registry.admitting(key):
            if not w.credits:  # unhealthy: it drains nothing
                continue
            lane = w.lanes[model]
            cost = lane.cost(key)
            size = min(cap, lane.max_batch)
            duration_s = cost.estimate(size)
            if not cost.calibrated or duration_s <= 0:
                return _NO_RATE
            rate_sps += size / duration_s
            fixed_s = max(fixed_s, cost.fixed_cost_s)
            per_sample_s = max(per_sample_s, cost.per_sample_s)
            spread = max(spread, cost.spread)
            full = min(full, size)
        return FleetRate(rate_sps, full, CostEstimate(fixed_s, per_sample_s, True, spread))

    @staticmethod
    def view(
        now: float, queue: RequestQueue, head: PendingRequest, urgent: PendingRequest, workers: int
    ) -> QueueView:
        """What the policy sees of a queue; its arrival rate is shared among the
        ``workers`` that admit its shapes."""
        return QueueView(
            queue.samples,
            head.arrival_s,
            urgent.deadline_s,
            # (max, as an expression) speed: docs/benchmarks.md "Why the hot path looks as it does"
            queue.arrival_sps(now) / (workers if workers > 1 else 1),
        )

    @staticmethod
    def idle_workers(
        model: str, workers: list[WorkerState], worker: WorkerState, samples: int, most: int
    ) -> int:
        """Of ``workers`` (those that admit a key's shapes), those that could start a
        batch now (``worker`` included, 1 if it is busy itself), counted only up to
        ``most``."""
        if most <= 1 or worker.outstanding or len(workers) < 2:
            return 1
        idle = 0
        for w in workers:
            if not w.outstanding and w.credits and w.lanes[model].max_batch >= samples:
                idle += 1
                if idle >= most:
                    break
        return max(1, idle)
