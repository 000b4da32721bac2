"""registry.py: the broker's table of workers — models, credits, liveness, load, and
the batches at them (its own :class:`~carpool.broker.inflight.InflightTable`, changed
only through the registry's methods: a batch dispatched, answered, or taken back).

Pure: ``now`` is passed in. A worker is READY once it announced itself; it is GONE after it
said DISCONNECT, missed ``liveness`` heartbeat intervals, or could not be sent to.
Credits: a worker with ``slots`` = k holds at most k outstanding batches, while it is
healthy. Its ``credits``, the batches the broker may have at it, are set by
:meth:`WorkerRegistry.set_credits` alone (at its READY, and as its health changes);
those in use are its ``outstanding`` batches, kept by the registry's in-flight table.
Health (:class:`Health`, changed only by :meth:`WorkerRegistry.set_health`): a worker whose
batch outran the engine watchdog is UNHEALTHY and gets no batches; one that showed
progress since (a RESULT or FAILED, or a HEARTBEAT whose inference thread started its
batch after the trip) is on PROBATION with one credit, and HEALTHY again once it answers
a batch it still holds (docs/protocol.md §10.6).
Limits (:mod:`carpool.broker.limits`): each worker keeps its own ``max_batch`` and shape
rules; :meth:`WorkerRegistry.admitting` lists the live workers that admit a queue's
shapes, and :meth:`WorkerRegistry.limit` the largest batch one of them takes.
A model's spec outlives its last worker (its name answers UNAVAILABLE, not NOT_FOUND) until
the broker forgets it (:meth:`WorkerRegistry.unserved_for`, :meth:`WorkerRegistry.forget`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from carpool.broker.adaptive import Lane
from carpool.broker.inflight import InflightBatch, InflightTable
from carpool.broker.limits import violation
from carpool.broker.requests import PendingRequest, RequestKey, WorkerId
from carpool.common.protocol import ModelSpec, Ready, Telemetry


class Health(Enum):
    """Whether the broker trusts a worker's engine with batches, and with how many."""

    HEALTHY = "healthy"  # every credit
    PROBATION = "probation"  # one credit until it answers a batch it holds
    UNHEALTHY = "unhealthy"  # no batches: its last one outran the watchdog


#: The moves :meth:`WorkerRegistry.set_health` makes; any other is a bug.
HEALTH_MOVES = frozenset(
    {
        (Health.HEALTHY, Health.UNHEALTHY),  # a batch outran the watchdog
        (Health.PROBATION, Health.UNHEALTHY),
        (Health.UNHEALTHY, Health.PROBATION),  # it showed progress
        (Health.PROBATION, Health.HEALTHY),  # it answered a batch it held
    }
)


@dataclass(slots=True)
class WorkerState:
    """What the broker knows about one live worker."""

    wid: WorkerId
    name: str
    models: dict[str, ModelSpec]
    heartbeat_s: float
    last_seen_s: float
    next_heartbeat_s: float
    outstanding: set[int] = field(default_factory=set)  # batch ids
    rho: float = 0.0  # busy fraction the worker last reported
    lanes: dict[str, Lane] = field(default_factory=dict)  # by model name
    # Predicted time the worker finishes everything it holds (it runs batches in order).
    free_at_s: float = 0.0
    health: Health = Health.HEALTHY
    # The batches it takes at once (its READY's), and those the broker may have at it in
    # its health (slots, 1, or 0): both set by WorkerRegistry.set_credits alone.
    slots: int = 0
    credits: int = 0
    unhealthy_since_s: float = 0.0  # when it last turned UNHEALTHY
    telemetry: Telemetry | None = None  # its host and device, as last reported (§8.2)
    # Its host's CPU in use, 0..1, as last reported (0: not reported): the share of the
    # worker's CPU per batch that is taken from the engine (docs/batching.md §3).
    host_busy: float = 0.0

    def on_telemetry(self, sample: Telemetry) -> None:
        """A sample of its host and device arrived."""
        self.telemetry = sample
        pct = sample.host_cpu_pct
        self.host_busy = 0.0 if pct is None else pct / 100.0  # (none read: not counted)

    @property
    def free_slots(self) -> int:
        return self.credits - len(self.outstanding)


class WorkerRegistry:
    """Live workers by routing id, and which of them serve each model."""

    def __init__(
        self, *, liveness: int = 3, watchdog_factor: float = 5.0, watchdog_slack_s: float = 1.0
    ) -> None:
        self.liveness = liveness
        # The batches at the workers: each worker's ``outstanding`` (its credits in use)
        # and ``free_at_s`` change only through the methods of "The batches at workers".
        self._inflight = InflightTable(
            watchdog_factor=watchdog_factor, watchdog_slack_s=watchdog_slack_s
        )
        #: The earliest watchdog time of a batch at a worker (None: none): the table's
        #: own method, asked every loop turn.
        #: speed: docs/benchmarks.md "Why the hot path looks as it does"
        self.next_due_s: Callable[[], float | None] = self._inflight.next_due_s
        self._workers: dict[WorkerId, WorkerState] = {}
        self._by_model: dict[str, list[WorkerState]] = {}
        # The spec per model name: the first READY's while any live worker serves the
        # model (later workers must match it); a READY for a model no live worker serves
        # replaces it (the model was upgraded while its workers were down).
        self.specs: dict[str, ModelSpec] = {}
        # Largest batch per model over live workers, and the earliest heartbeat or expiry
        # (None: recompute). Kept up to date on add/remove/reschedule, so the per-message
        # and per-turn paths do not scan every worker.
        self._max_batch: dict[str, int] = {}
        # Per request key: the live workers of its model whose limits admit its shapes and
        # the largest batch one of them takes (a model's keys are dropped when a worker of
        # it comes or goes; bounded, since clients choose shapes).
        self._eligible: dict[RequestKey, tuple[list[WorkerState], int]] = {}
        self._event_s: float | None = None
        self._event_stale = False
        # Models whose last live worker left: since when (stamped by unserved_for, which
        # has the time), and those not stamped yet.
        self._unserved_s: dict[str, float] = {}
        self._orphans: set[str] = set()
        #: Workers registered, removed or their models forgotten so far: the core's
        #: ``changes`` reads it.
        self.changes = 0

    def __contains__(self, wid: object) -> bool:
        return wid in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, wid: WorkerId) -> WorkerState | None:
        return self._workers.get(wid)

    def all(self) -> Iterable[WorkerState]:
        return self._workers.values()

    def conflicts(self, ready: Ready) -> list[str]:
        """Models whose announced inputs (pad rules included) or outputs differ from the
        spec of the live workers that serve them (limits may differ)."""
        return [
            spec.name
            for spec in ready.models
            if self._by_model.get(spec.name) and _differs(self.specs[spec.name], spec)
        ]

    def replaced(self, ready: Ready) -> list[ModelSpec]:
        """The announced specs that will replace a registered one: models no live worker
        serves, whose inputs (pad rules included) or outputs differ from the last spec."""
        out = []
        for spec in ready.models:
            known = self.specs.get(spec.name)
            if known is not None and not self._by_model.get(spec.name) and _differs(known, spec):
                out.append(spec)
        return out

    def add(
        self,
        now: float,
        wid: WorkerId,
        ready: Ready,
        heartbeat_s: float,
        lanes: dict[str, Lane] | None = None,
    ) -> WorkerState:
        """Register a worker (replacing an earlier entry under the same id)."""
        self.remove(wid)
        self.changes += 1
        state = WorkerState(
            wid=wid,
            name=ready.name,
            models={m.name: m for m in ready.models},
            heartbeat_s=heartbeat_s,
            last_seen_s=now,
            next_heartbeat_s=now + heartbeat_s,
            lanes=lanes or {m.name: Lane(None, m.max_batch) for m in ready.models},
        )
        self.set_credits(state, ready.slots)
        self._workers[wid] = state
        for spec in ready.models:
            peers = self._by_model.setdefault(spec.name, [])
            if not peers:
                self.specs[spec.name] = spec
                self._orphans.discard(spec.name)
                self._unserved_s.pop(spec.name, None)
            peers.append(state)
        self._changed(state.models)
        return state

    def remove(self, wid: WorkerId) -> WorkerState | None:
        state = self._workers.pop(wid, None)
        if state is not None:
            self.changes += 1
            for name in state.models:
                peers = self._by_model.get(name, [])
                if state in peers:
                    peers.remove(state)
                if not peers:
                    self._by_model.pop(name, None)
                    self._orphans.add(name)
            self._changed(state.models)
        return state

    def unserved_for(self, now: float, after_s: float) -> list[str]:
        """Models no live worker has served for ``after_s`` or longer at ``now`` (counted
        from the first call that saw them unserved: call it at a steady pace)."""
        if self._orphans:
            for name in self._orphans:
                self._unserved_s.setdefault(name, now)
            self._orphans.clear()
        return [name for name, since_s in self._unserved_s.items() if now - since_s >= after_s]

    def forget(self, name: str) -> None:
        """Drop what is kept of a model no live worker serves (its spec, its limits)."""
        if self._by_model.get(name):
            raise ValueError(f"model {name!r} is served; only an unserved model is forgotten")
        self.changes += 1
        self.specs.pop(name, None)
        self._max_batch.pop(name, None)
        self._drop_keys(name)
        self._unserved_s.pop(name, None)
        self._orphans.discard(name)

    def _changed(self, models: Iterable[str]) -> None:
        for name in models:
            self._max_batch[name] = max(
                (w.lanes[name].max_batch for w in self.serving(name)), default=0
            )
            self._drop_keys(name)
        self.reschedule()

    def _drop_keys(self, model: str) -> None:
        known = self._eligible
        for key in [k for k in known if k[0] == model]:
            del known[key]

    def reschedule(self) -> None:
        """Heartbeat times changed: recompute :meth:`next_event_s` when next asked."""
        self._event_stale = True

    def set_health(self, now: float, worker: WorkerState, health: Health) -> None:
        """Move ``worker`` to ``health`` (one of :data:`HEALTH_MOVES`), with its credits."""
        if (worker.health, health) not in HEALTH_MOVES:
            raise AssertionError(f"worker health {worker.health.name} -> {health.name}")
        worker.health = health
        if health is Health.UNHEALTHY:
            worker.unhealthy_since_s = now
        self.set_credits(worker, worker.slots)

    @staticmethod
    def set_credits(worker: WorkerState, slots: int) -> None:
        """``worker`` takes ``slots`` batches at once (its READY says; a later message may
        say otherwise): its credits are those within its health, all while HEALTHY, one
        on PROBATION, none while UNHEALTHY. The one writer of ``slots`` and ``credits``;
        batches it holds beyond them stay, and it gets no more until they are answered."""
        worker.slots = slots
        health = worker.health
        if health is Health.HEALTHY:
            worker.credits = slots
        else:
            worker.credits = min(1, slots) if health is Health.PROBATION else 0

    # ------------------------------------------------------------ the batches at workers

    def dispatched(
        self,
        now: float,
        worker: WorkerState,
        requests: list[PendingRequest],
        key: RequestKey,
        samples: int,
        predicted_s: float,
    ) -> InflightBatch:
        """A batch of ``requests`` leaves for ``worker``, predicted to take
        ``predicted_s`` (0: its lane knows no cost of ``key``): numbered, watched
        (:meth:`InflightTable.limit_s`; with no prediction, the slowest estimate another
        worker of the model has, else until its last deadline, since slow cannot be told
        from hung), and held at the worker, whose predicted free time moves past it."""
        table = self._inflight
        watch_s = predicted_s
        if watch_s <= 0:
            model = key[0]
            for w in self.serving(model):
                watch_s = max(watch_s, w.lanes[model].cost(key).estimate(samples))
        if watch_s > 0:
            watch_s = table.limit_s(watch_s)
        else:
            watch_s = max(table.watchdog_slack_s, max(r.deadline_s for r in requests) - now)
        batch = InflightBatch(
            table.next_id(), worker.wid, requests, key, samples, predicted_s, watch_s, sent_s=now
        )
        table.add(now, worker, batch)
        # (max, as an expression) speed: docs/benchmarks.md "Why the hot path looks as it does"
        free_at_s = worker.free_at_s
        worker.free_at_s = (free_at_s if free_at_s > now else now) + predicted_s
        return batch

    def answered(self, now: float, worker: WorkerState, batch_id: int) -> InflightBatch | None:
        """The batch ``worker`` answered, no longer at it (None: it no longer holds it,
        :meth:`InflightTable.take`); the worker's queue restarts from ``now``."""
        table = self._inflight
        batch = table.take(now, worker, batch_id)
        if batch is not None:
            batches, ahead_s = table.batches, 0.0  # (a loop: no generator's frame)
            for held in worker.outstanding:
                other = batches.get(held)
                if other is not None:
                    ahead_s += other.predicted_s
            worker.free_at_s = now + ahead_s
        return batch

    def answered_late(self, worker: WorkerState, batch_id: int) -> InflightBatch | None:
        """The batch ``worker`` hung on, if ``batch_id`` is it (its late answer)."""
        return self._inflight.take_hung(worker, batch_id)

    def take_all(self, worker: WorkerState) -> list[InflightBatch]:
        """Every batch ``worker`` holds, no longer at it, newest first (it holds none:
        free now)."""
        worker.free_at_s = 0.0
        return self._inflight.take_all(worker)

    def overdue(self, now: float) -> list[InflightBatch]:
        """The batches whose watchdog time has come (:meth:`InflightTable.overdue`)."""
        return self._inflight.overdue(now)

    def hung(self, batch: InflightBatch) -> None:
        """``batch`` outran the watchdog and left with its worker's others: its late
        answer still teaches the lane (:meth:`answered_late`)."""
        self._inflight.remember_hung(batch)

    @property
    def batches_held(self) -> int:
        return len(self._inflight)

    @property
    def batch_changes(self) -> int:
        """Batches added or taken so far (the core's ``changes`` reads it)."""
        return self._inflight.changes

    def touch(self, now: float, wid: WorkerId) -> WorkerState | None:
        state = self._workers.get(wid)
        if state is not None:
            state.last_seen_s = now
        return state

    def serving(self, model: str) -> list[WorkerState]:
        """Live workers that serve ``model``."""
        return self._by_model.get(model, [])

    def max_batch(self, model: str) -> int:
        """The largest batch any live worker accepts for ``model`` (0 if none serves it)."""
        return self._max_batch.get(model, 0)

    #: Request keys whose admitting workers are kept (dropped all at once when full).
    MAX_KEYS = 4096

    def eligible(self, key: RequestKey) -> tuple[list[WorkerState], int]:
        """The live workers of ``key``'s model whose limits admit its shapes, and the
        largest batch of ``key`` one of them takes (0: none admits its shapes)."""
        hit = self._eligible.get(key)
        return self._eligible_of(key) if hit is None else hit

    def admitting(self, key: RequestKey) -> list[WorkerState]:
        """The live workers of ``key``'s model whose limits admit its shapes."""
        return self.eligible(key)[0]

    def limit(self, key: RequestKey) -> int:
        """The largest batch of ``key`` a live worker takes (0: none admits its shapes)."""
        return self.eligible(key)[1]

    def _eligible_of(self, key: RequestKey) -> tuple[list[WorkerState], int]:
        model = key[0]
        workers = self._by_model.get(model, [])
        if any(w.models[model].rules for w in workers):
            workers = [w for w in workers if violation(w.models[model], key) is None]
        hit = (workers, max((w.lanes[model].max_batch for w in workers), default=0))
        known = self._eligible
        if len(known) >= self.MAX_KEYS:
            known.clear()
        known[key] = hit
        return hit

    def best_free(
        self, key: RequestKey, samples: int, workers: list[WorkerState] | None = None
    ) -> WorkerState | None:
        """The worker to take the next batch of ``key``: the most free credits, then the
        lowest reported load; only workers whose limits admit its shapes and ``samples``
        (``workers``: those :meth:`admitting` gives, when the caller has them)."""
        model = key[0]
        best: WorkerState | None = None
        for w in self.admitting(key) if workers is None else workers:
            if w.free_slots <= 0 or w.lanes[model].max_batch < samples:
                continue
            if best is None or (w.free_slots, -w.rho) > (best.free_slots, -best.rho):
                best = w
        return best

    def expired(self, now: float) -> list[WorkerState]:
        """Workers silent for longer than ``liveness`` of their heartbeat intervals."""
        return [
            w
            for w in self._workers.values()
            if now - w.last_seen_s >= self.liveness * w.heartbeat_s
        ]

    def next_event_s(self) -> float | None:
        """Earliest heartbeat due or expiry among live workers. Cached: a worker heard from
        since only moves its expiry later, so the cached time is never late (at worst the
        caller looks early, finds nothing due and calls :meth:`reschedule`)."""
        if self._event_stale:
            self._event_stale = False
            self._event_s = min(
                (
                    min(w.next_heartbeat_s, w.last_seen_s + self.liveness * w.heartbeat_s)
                    for w in self._workers.values()
                ),
                default=None,
            )
        return self._event_s


def _differs(known: ModelSpec, spec: ModelSpec) -> bool:
    """Whether two specs of a model take requests of another form or give other outputs:
    inputs, outputs, or how requests are padded into buckets and cropped back. Limits
    (``max_batch``, ``preferred_batch``, shape rules) may differ between workers."""
    return (
        known.inputs != spec.inputs
        or known.outputs != spec.outputs
        or known.pads != spec.pads
        or known.crops != spec.crops
    )
