"""inflight.py: InflightTable — the batches at workers, and the engine watchdog's timers.

Pure: ``now`` comes in. The table is the worker registry's own, changed only through
its methods (:meth:`~carpool.broker.registry.WorkerRegistry.dispatched`, ``answered``,
``take_all``): it keeps the batches at workers, by batch id and per worker. A batch
enters when it is dispatched and leaves when its worker answers it, when the worker is
lost or turns unhealthy, or when the broker stops; each worker's ``outstanding`` set
(its credits in use) changes only here.

The watchdog: a worker runs its batches in the order they came, so only the oldest batch
at each worker (its head) is running. The head gets its ``watch_s`` (``max(factor ×
predicted, predicted + slack_s)``, :meth:`InflightTable.limit_s`, with the dispatcher's
prediction) from when it became the head (its dispatch, or the answer to the batch
before it) to be answered; :meth:`InflightTable.overdue` returns the heads past that. The
cost is a heap push per batch, and a pop when its time comes or when it reaches the top
already answered.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from carpool.broker.requests import PendingRequest, RequestKey, WorkerId


class Holder(Protocol):
    """A worker as the table reads and writes it: the registry's ``WorkerState``."""

    wid: WorkerId
    outstanding: set[int]  # the ids of the batches at it: its credits in use


@dataclass(slots=True)
class InflightBatch:
    batch_id: int
    worker: WorkerId
    requests: list[PendingRequest]
    key: RequestKey  # key[0] is the model
    samples: int
    predicted_s: float  # the cost model's duration estimate at dispatch
    watch_s: float  # how long it may run once it is the oldest at its worker (watchdog)
    # When the watchdog gives up on it: set once it is the oldest batch at its worker.
    due_s: float = math.inf
    head_s: float = 0.0  # when it became the oldest batch at its worker
    sent_s: float = 0.0  # when it was dispatched (its requests' queue wait ends)


class InflightTable:
    """The batches at workers, and the watchdog's timers; see the module docstring."""

    def __init__(self, *, watchdog_factor: float = 5.0, watchdog_slack_s: float = 1.0) -> None:
        self.batches: dict[int, InflightBatch] = {}
        self._batch_seq = 0
        self.watchdog_factor = watchdog_factor
        self.watchdog_slack_s = watchdog_slack_s
        # Each worker's batch ids in dispatch order (ids answered out of order linger
        # until they reach the front); a worker holding nothing has no entry.
        self._order: dict[WorkerId, deque[int]] = {}
        self._due: list[tuple[float, int]] = []  # (due_s, batch_id): a heap of the heads
        # The batch each unhealthy worker hung on, out of the table: its late RESULT is
        # still dropped, but its time teaches the worker's lane.
        self._hung: dict[WorkerId, InflightBatch] = {}
        #: Batches added or taken so far: the core's ``changes`` reads it.
        self.changes = 0

    def __len__(self) -> int:
        return len(self.batches)

    def next_id(self) -> int:
        self._batch_seq += 1
        return self._batch_seq

    def limit_s(self, predicted_s: float) -> float:
        """How long a batch predicted to take ``predicted_s`` may run before the watchdog
        gives up on its worker."""
        scaled, slack = self.watchdog_factor * predicted_s, predicted_s + self.watchdog_slack_s
        # (max, as an expression) speed: docs/benchmarks.md "Why the hot path looks as it does"
        return slack if slack > scaled else scaled

    def add(self, now: float, worker: Holder, batch: InflightBatch) -> None:
        self.changes += 1
        self.batches[batch.batch_id] = batch
        worker.outstanding.add(batch.batch_id)
        order = self._order.get(batch.worker)
        if order is None:
            order = self._order[batch.worker] = deque()
        order.append(batch.batch_id)
        if len(worker.outstanding) == 1:
            self._arm(now, batch)

    def _arm(self, now: float, batch: InflightBatch) -> None:
        batch.head_s = now
        batch.due_s = now + batch.watch_s
        heapq.heappush(self._due, (batch.due_s, batch.batch_id))

    def take(self, now: float, worker: Holder, batch_id: int) -> InflightBatch | None:
        """The batch ``worker`` answered, out of the table; None if it no longer owns it
        (it was requeued after a presumed loss, or the watchdog gave up on it). When it
        was the head, the next batch's watchdog starts now."""
        batch = self.batches.get(batch_id)
        if batch is None or batch.worker != worker.wid:
            return None
        self.changes += 1
        del self.batches[batch_id]
        outstanding = worker.outstanding
        outstanding.discard(batch_id)
        if not outstanding:
            self._order.pop(worker.wid, None)
        elif batch.due_s != math.inf:
            order = self._order[worker.wid]
            while order[0] not in outstanding:
                order.popleft()
            self._arm(now, self.batches[order[0]])
        return batch

    def take_all(self, worker: Holder) -> list[InflightBatch]:
        """Every batch ``worker`` holds, out of the table, newest first."""
        self.changes += 1
        taken = []
        for batch_id in sorted(worker.outstanding, reverse=True):
            batch = self.batches.pop(batch_id, None)
            if batch is not None:
                taken.append(batch)
        worker.outstanding.clear()
        self._order.pop(worker.wid, None)
        self._hung.pop(worker.wid, None)
        return taken

    def remember_hung(self, batch: InflightBatch) -> None:
        """``batch`` outran the watchdog and was taken with its worker's others: keep it
        (one a worker) for :meth:`take_hung`."""
        self._hung[batch.worker] = batch

    def take_hung(self, worker: Holder, batch_id: int) -> InflightBatch | None:
        """The batch ``worker`` hung on, if ``batch_id`` is it (out of the memory)."""
        batch = self._hung.get(worker.wid)
        if batch is None or batch.batch_id != batch_id:
            return None
        self.changes += 1
        del self._hung[worker.wid]
        return batch

    def overdue(self, now: float) -> list[InflightBatch]:
        """The heads whose watchdog time has come, out of the timers (still in the table:
        the caller decides what becomes of their workers)."""
        due = self._due
        batches = self.batches
        late = []
        while due and due[0][0] <= now:
            due_s, batch_id = heapq.heappop(due)
            batch = batches.get(batch_id)
            if batch is not None and batch.due_s == due_s:
                late.append(batch)
        return late

    def next_due_s(self) -> float | None:
        """The earliest watchdog time of a batch still at its worker (None: none)."""
        due = self._due
        batches = self.batches
        while due:
            due_s, batch_id = due[0]
            batch = batches.get(batch_id)
            if batch is not None and batch.due_s == due_s:
                return due_s
            heapq.heappop(due)  # answered already
        return None
