"""pumps.py: Pumps — which queues are pumped, when, and in which order.

Pure: ``now`` comes in; no sockets or clocks. What one pump of a queue does (shed,
decide, dispatch) is :meth:`Dispatcher.pump <carpool.broker.dispatcher.Dispatcher.pump>`,
which the caller passes in as ``pump``; this decides which queues it runs for after each
event, and in which order.

Events only mark what changed; :meth:`Pumps.pump_dirty`, in the tick that ends each
loop turn, forms the batches for everything that arrived in it (a burst of arrivals
leaves as one batch, and the policy runs once per queue per turn instead of once per
message), with the queues whose wake-up has come.

The queues of a model (one per item shape or bucket) share its workers' slots, and a
slot goes to the most urgent queue first (:class:`~carpool.broker.urgency.QueueOrder`:
priority, then the deadline at its head, as EDF reads it within a queue):

- a change of a model's workers (one joined, left, or changed health) pumps every queue
  of the model, most urgent first (:meth:`Pumps.mark_models`);
- a batch that ends frees a slot (:meth:`Pumps.mark_freed`): it is offered to the
  model's queues most urgent first, until no worker of the model has a slot free (a
  queue pumped then could only shed, and shedding keeps its own time, ``wake_s``);
- a queue pumped for its own reason (an arrival, its wake-up, an expiry ahead of it)
  first has the free slot offered to the more urgent queues, unless all of them were
  offered one since the model's workers last took or freed a slot (the model is
  ``settled``); queues pumped together are pumped most urgent first.

Work conserving: a queue whose policy waits (for the batch to fill, or for the worker
to be nearly free) does not hold the slot; the next queue is asked. A queue that waits
has slack by its own countdown, and its wake-up, or the next slot that frees, asks it
first again. A free slot costs O(log K) a queue asked in a model of K queues; asking
them all again happens at most once per slot taken or freed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from carpool.broker.backlog import Backlog
from carpool.broker.batcher import RequestQueue
from carpool.broker.fleet import FleetModel
from carpool.broker.policy import promotion_s
from carpool.broker.registry import WorkerRegistry
from carpool.broker.replies import Outgoing
from carpool.broker.requests import RequestKey
from carpool.broker.urgency import rank_of

#: One pump of a queue (:meth:`Dispatcher.pump <carpool.broker.dispatcher.Dispatcher.pump>`):
#: ``(now, queue, out)``, returns how many batches left.
Pump = Callable[[float, RequestQueue, list[Outgoing]], int]


@dataclass(slots=True, eq=False, repr=False)
class Pumps:
    """When and in which order queues are pumped; see the module docstring."""

    backlog: Backlog
    registry: WorkerRegistry
    fleet: FleetModel
    # The queues events touched since the last turn, the models whose workers changed
    # (every queue), and those a worker freed a slot of (while one is free).
    dirty: dict[RequestKey, None] = field(init=False, default_factory=dict)
    dirty_models: set[str] = field(init=False, default_factory=set)
    freed_models: set[str] = field(init=False, default_factory=set)
    # Models whose queues (those holding requests) have all been offered a free slot, most
    # urgent first, since a worker of theirs last took or freed a slot, joined or left: a
    # queue pumped for its own reason need not offer the slot to the others first.
    settled: set[str] = field(init=False, default_factory=set)

    def stop(self) -> None:
        """The broker is stopping: nothing waits to be pumped any more."""
        self.dirty.clear()
        self.dirty_models.clear()
        self.freed_models.clear()
        self.settled.clear()

    def mark_models(self, models: Iterable[str]) -> None:
        """The workers of ``models`` changed (one joined, left, or changed health): recount
        their queued batches (limits may have changed); the turn's end pumps every queue
        of them, most urgent first (a queue whose shapes no live worker takes now is
        answered)."""
        names = set(models)
        self.backlog.recount(names)
        self.settled -= names
        self._mark(names, self.dirty_models)

    def mark_freed(self, models: Iterable[str]) -> None:
        """A worker of ``models`` finished a batch (it has a slot free): the turn's end
        offers the slot to their queues, most urgent first, while a worker of the model
        has one free."""
        if self.settled:
            self.settled.difference_update(models)
        self._mark(models, self.freed_models)

    def _mark(self, models: Iterable[str], marked: set[str]) -> None:
        # Only models with requests waiting: an arrival marks its own queue, and a model
        # marked with nothing queued would cost the loop an empty turn.
        queued = self.backlog.queued_samples
        for model in models:
            waiting = queued.get(model)
            if waiting is not None and (waiting[0] or waiting[1]):
                marked.add(model)

    def pump_queue(
        self,
        now: float,
        queue: RequestQueue,
        out: list[Outgoing],
        pump: Pump,
        pumped: set[RequestKey] | None = None,
    ) -> None:
        """Pump ``queue`` (a request arrived, its wake-up came, or one ahead of it expired).
        If a worker of its model has a slot free that the model's queues have not all been
        offered since (its model is not ``settled``) and another queue is more urgent, the
        slot is offered to the model's queues, most urgent first, before: a queue pumped
        for its own reason does not overtake a more urgent one. ``pumped``: queues pumped
        already in this turn (each is pumped once)."""
        model = queue.key[0]
        backlog = self.backlog
        if model not in self.settled and not backlog.alone(queue) and self._slot_free(model):
            first = backlog.order.first(model, now, self.promote_s)
            if first is not None and first is not queue:
                if pumped is None:
                    pumped = set()
                self._offer(now, model, out, pump, pumped)
                if queue.key in pumped:
                    return
        if pumped is not None:
            pumped.add(queue.key)
        if pump(now, queue, out):
            # It took a slot: a waiting queue's latest start may have moved earlier.
            self.settled.discard(model)

    def pump_dirty(
        self, now: float, out: list[Outgoing], pump: Pump, due: Iterable[RequestKey] = ()
    ) -> None:
        """At the tick that ends each turn: with ``pump``, pump every queue of the models
        whose workers changed, offer the slots freed since to the queues of their models,
        then :meth:`pump_queue` the queues messages touched and those ``due`` (a wake-up
        came, or a request ahead expired), most urgent first; each queue once."""
        pumped: set[RequestKey] | None = None
        if self.dirty_models or self.freed_models:
            pumped = set()
            models, self.dirty_models = self.dirty_models, set()
            freed, self.freed_models = self.freed_models - models, set()
            for model in models:  # (every queue of theirs)
                self._offer(now, model, out, pump, pumped, every=True)
            for model in freed:
                self._offer(now, model, out, pump, pumped)
        keys = self.dirty
        if keys:
            self.dirty = {}
        if due:
            keys = {**keys, **dict.fromkeys(due)}
        if not keys:
            return
        known = self.backlog.queues
        if len(keys) == 1:  # (most turns: nothing to order)
            for key in keys:
                queue = known.get(key)
                if queue is not None and (pumped is None or key not in pumped):
                    self.pump_queue(now, queue, out, pump, pumped)
            return
        if pumped is None:
            pumped = set()
        queues = [q for k in keys if k not in pumped and (q := known.get(k)) is not None]
        queues.sort(key=lambda q: rank_of(q, now, self.promote_s))
        for queue in queues:
            if queue.key not in pumped:
                self.pump_queue(now, queue, out, pump, pumped)

    def _offer(
        self,
        now: float,
        model: str,
        out: list[Outgoing],
        pump: Pump,
        pumped: set[RequestKey],
        every: bool = False,
    ) -> None:
        """Pump the queues of ``model`` (but those in ``pumped``) most urgent first, while
        a worker of it has a slot free (a queue pumped then could send nothing), or all of
        them with ``every``. A queue whose policy waits does not hold the slot: the next
        is asked. The model is ``settled`` then, until one of its workers takes or frees a
        slot, or changes."""
        workers = self.registry.serving(model)
        order = self.backlog.order
        first = order.first(model, now, self.promote_s)
        if first is not None and self.backlog.alone(first):
            # One queue holds requests (one shape, say): no order to keep.
            if first.key not in pumped and (every or any(w.free_slots > 0 for w in workers)):
                pumped.add(first.key)
                pump(now, first, out)
            self.settled.add(model)
            return

        def visit(queue: RequestQueue) -> bool:
            if not every and not any(w.free_slots > 0 for w in workers):
                return False
            if queue.key not in pumped:
                pumped.add(queue.key)
                pump(now, queue, out)
            return True

        if first is not None:
            order.offer(model, now, self.promote_s, visit)
        self.settled.add(model)

    def _slot_free(self, model: str) -> bool:
        return any(w.free_slots > 0 for w in self.registry.serving(model))

    def promote_s(self, now: float, queue: RequestQueue) -> float:
        """The promotion window of ``queue``'s bulk requests at ``now``, as its pump would
        read it with the worker that would take its batch (0 while none has a slot)."""
        worker = self.registry.best_free(queue.key, 1)
        if worker is None:
            return 0.0
        return promotion_s(self.fleet.capacity(now, worker, queue.key))
