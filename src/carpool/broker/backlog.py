"""backlog.py: Backlog — every request the broker holds that has not left for a worker.

Pure: no sockets, threads or clocks. The queues by request key, each model's queues in
urgency order (:class:`~carpool.broker.urgency.QueueOrder`), the deadline heap of every
live request (queued or in flight), and the counts the door and the STATS reply read:
requests and payload bytes queued, samples queued per model and priority, and the
batches each model's queues will form (:meth:`Backlog.ahead`).

Batches are counted per request key, in units of the batch its queue forms under a
backlog (``batch_unit``: its model's B_max cap within the largest batch a live worker
of it takes), and kept per model incrementally as requests come and go: O(1) a request.
``recount`` recounts a model's keys when its workers change (their limits may).

Requests leave a queue through the backlog, which keeps the counts in step: a batch's
requests through :meth:`Backlog.take` alone (in :meth:`Backlog.next_up`'s order, which
the dispatcher reads to size the batch), hopeless ones through :meth:`Backlog.shed`,
one that leaves unbatched (cancelled, answered) through :meth:`Backlog.remove`, and
every live request whose deadline has passed through :meth:`Backlog.expire`. Each of
these moves the request in the request book too, so that no request leaves a queue
without its move, and every move of a queued request out of QUEUED leaves its queue.
The answers that come for requests at workers move them through the backlog as well
(:meth:`Backlog.answered`, :meth:`Backlog.failed`, :meth:`Backlog.requeue`): the book
is the backlog's, and no other part moves a request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from heapq import heappush

from carpool.broker.batcher import BatchTally, DeadlineHeap, RequestQueue
from carpool.broker.requests import (
    ClientId,
    PendingRequest,
    RequestBook,
    RequestKey,
    RequestState,
)
from carpool.broker.urgency import QueueOrder

_QUEUED, _EXPIRED, _FAILED = RequestState.QUEUED, RequestState.EXPIRED, RequestState.FAILED
_DISPATCHED, _DONE = RequestState.DISPATCHED, RequestState.DONE

#: What :meth:`Backlog.expire` returns when nothing is due.
_NONE: tuple[tuple[PendingRequest, bool], ...] = ()


def _one_sample(key: RequestKey) -> int:
    return 1


class Backlog:
    """The queued requests and their counts; see the module docstring."""

    def __init__(
        self, book: RequestBook, batch_unit: Callable[[RequestKey], int] = _one_sample
    ) -> None:
        self._book = book
        #: Per client: [requests held, their payload bytes] (the book's own table, which
        #: :meth:`held` reads; the door reads it directly).
        self.held_by = book.held
        #: The samples of a batch of ``key`` under a backlog (the core's FleetModel says).
        self.batch_unit = batch_unit
        self.queues: dict[RequestKey, RequestQueue] = {}
        self.order = QueueOrder()
        self.deadlines = DeadlineHeap()
        self.queued = 0
        self.queued_bytes = 0  # payload bytes of the queued requests
        # Queued samples per model, by priority (interactive, bulk): admission estimates.
        self.queued_samples: dict[str, list[int]] = {}
        # Per model, the batches its queues will form: of interactive samples, of all.
        self.queued_batches: dict[str, list[int]] = {}
        # Set by begin_stop: new requests are refused and nothing is requeued.
        self.stopping = False
        # While stopping: when the broker closes its frontend at the latest (the core's
        # begin_stop and finish_stop set it from the server's schedule).
        self.closes_s = math.inf

    def retry_after_ms(self, now: float) -> int | None:
        """The ``retry_after_ms`` of an answer with ``retry`` at ``now``: the time left
        before the stopping broker closes (at least 1); None when it is not stopping or
        sets no time."""
        if not self.stopping or self.closes_s == math.inf:
            return None
        return max(1, math.ceil(1000 * (self.closes_s - now)))

    def queue(self, key: RequestKey) -> RequestQueue:
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = RequestQueue(key)
        return queue

    def add(self, req: PendingRequest) -> RequestQueue:
        """A new request joins its queue (which it returns), the counts and the deadline
        heap."""
        queue = self.queues.get(req.key)
        if queue is None:
            queue = self.queues[req.key] = RequestQueue(req.key)
        queue.arrive(req)
        priority, samples = req.priority, req.samples
        rank = queue.ranks[priority]
        if rank is None or req.deadline_s <= rank[0]:  # (QueueOrder.arrived, its test first)
            self.order.arrived(queue, req)
        self._book.enter(req)
        self.queued += 1
        self.queued_bytes += req.nbytes
        per_model = self.queued_samples.get(req.model)
        if per_model is None:
            per_model = self.queued_samples[req.model] = [0, 0]
        per_model[priority] += samples
        tally = queue.tally or self._tally(queue)
        # (BatchTally.add, inlined, recounting only a count that grows past its batches'
        # samples) speed: docs/benchmarks.md "Why the hot path looks as it does"
        unit = tally.unit
        if priority:
            tally.bulk = bulk = tally.bulk + samples
            interactive = tally.interactive
        else:
            tally.interactive = interactive = tally.interactive + samples
            bulk = tally.bulk
            if interactive > tally.first * unit:
                first = -(-interactive // unit)
                tally.totals[0] += first - tally.first
                tally.first = first
        if interactive + bulk > tally.every * unit:
            every = -(-(interactive + bulk) // unit)
            tally.totals[1] += every - tally.every
            tally.every = every
        # (DeadlineHeap.push, inlined) speed: docs/benchmarks.md "Why the hot path looks as it does"
        deadlines = self.deadlines
        heap = deadlines.entries
        heappush(heap, (req.deadline_s, req))
        if len(heap) >= deadlines.compact_at:
            deadlines.compact()
        return queue

    def enqueued(self, req: PendingRequest) -> None:
        self.queued += 1
        self.queued_bytes += req.nbytes
        per_model = self.queued_samples.get(req.model)
        if per_model is None:
            per_model = self.queued_samples[req.model] = [0, 0]
        per_model[req.priority] += req.samples
        queue = self.queues[req.key]
        tally = queue.tally or self._tally(queue)
        if req.priority:
            tally.add(0, req.samples)
        else:
            tally.add(req.samples, 0)

    def dequeued(self, req: PendingRequest) -> None:
        self.queued -= 1
        self.queued_bytes -= req.nbytes
        self.queued_samples[req.model][req.priority] -= req.samples
        tally = self.queues[req.key].tally
        assert tally is not None  # (counted when it joined)
        if req.priority:
            tally.add(0, -req.samples)
        else:
            tally.add(-req.samples, 0)

    def _tally(self, queue: RequestQueue) -> BatchTally:
        model = queue.key[0]
        totals = self.queued_batches.get(model)
        if totals is None:
            totals = self.queued_batches[model] = [0, 0]
        tally = queue.tally = BatchTally(self.batch_unit(queue.key), totals)
        return tally

    def recount(self, models: Iterable[str]) -> None:
        """The workers of ``models`` changed: count their keys' batches in their units now."""
        names = set(models)
        for key, queue in self.queues.items():
            if key[0] in names and queue.tally is not None:
                queue.tally.unit = self.batch_unit(key)
                queue.tally.recount()

    def alone(self, queue: RequestQueue) -> bool:
        """Whether no queue of its model but ``queue`` holds a request."""
        tally = queue.tally
        if tally is None:
            totals = self.queued_batches.get(queue.key[0])
            return totals is None or totals[1] == 0
        return tally.totals[1] == tally.every

    def ahead(self, key: RequestKey, priority: int) -> tuple[int, int]:
        """What a new request of ``key`` and ``priority`` waits behind (at most): the
        queued samples of its own key, and the batches the model's other keys will form
        (their samples of its priority or higher, in batches of each key's unit)."""
        queue = self.queues.get(key)
        tally = None if queue is None else queue.tally
        if tally is None:
            totals = self.queued_batches.get(key[0])
            return 0, 0 if totals is None else totals[1 if priority else 0]
        if priority:
            return tally.interactive + tally.bulk, tally.totals[1] - tally.every
        return tally.interactive, tally.totals[0] - tally.first

    def dequeued_all(self, requests: list[PendingRequest]) -> None:
        """:meth:`dequeued` for each of ``requests`` (a batch taken from one queue)."""
        if not requests:
            return
        nbytes = interactive = bulk = 0
        for req in requests:
            nbytes += req.nbytes
            if req.priority:
                bulk += req.samples
            else:
                interactive += req.samples
        self.queued -= len(requests)
        self.queued_bytes -= nbytes
        first = requests[0]
        per_model = self.queued_samples[first.model]
        per_model[0] -= interactive
        per_model[1] -= bulk
        tally = self.queues[first.key].tally
        assert tally is not None  # (counted when they joined)
        tally.add(-interactive, -bulk)

    def next_up(
        self, queue: RequestQueue, now: float, promote_s: float, edf: bool
    ) -> PendingRequest | None:
        """The request :meth:`take` takes first from ``queue`` (None: it is empty): with
        ``edf``, the earliest deadline first, interactive before bulk (a bulk request goes
        first too once its deadline is within ``promote_s`` of ``now``); else the oldest."""
        return queue.next_edf(now, promote_s) if edf else queue.head()

    def take(
        self, queue: RequestQueue, max_samples: int, now: float, promote_s: float, edf: bool
    ) -> list[PendingRequest]:
        """The requests of a batch, taken out of ``queue`` in :meth:`next_up`'s order while
        their samples fit in ``max_samples``: each moves to DISPATCHED and out of the
        counts. The one way a request leaves a queue for a worker."""
        move = self._book.move
        if edf:
            taken = queue.take_edf(max_samples, now, promote_s, move)
        else:
            taken = queue.take(max_samples, move)
        self.dequeued_all(taken)
        return taken

    def shed(self, queue: RequestQueue, before_s: float) -> list[PendingRequest]:
        """Take out of ``queue`` every request whose deadline is at or before ``before_s``
        (hopeless): each moves to EXPIRED and out of the counts; the caller answers it."""
        shed = queue.shed(before_s, self._book.move)
        for req in shed:
            self.dequeued(req)
        return shed

    def remove(self, queue: RequestQueue, req: PendingRequest) -> None:
        """``req``, queued in ``queue``, leaves it unbatched (cancelled or answered with
        an error): out of the queue and the counts, and FAILED. The caller answers it."""
        queue.forget(req)
        self.dequeued(req)
        self._book.move(req, _FAILED)

    def expire(self, now: float) -> Sequence[tuple[PendingRequest, bool]]:
        """Every live request whose deadline has passed by ``now``, queued or at a worker:
        each leaves its queue (if queued) and moves to EXPIRED. Returns them, each with
        whether it was queued, for the caller to answer."""
        heap = self.deadlines.entries
        if not heap or heap[0][0] > now:
            return _NONE  # (the common case, once per pump: nothing due)
        expired: list[tuple[PendingRequest, bool]] = []
        move = self._book.move
        for req in self.deadlines.pop_expired(now):
            queued = req.state is _QUEUED
            if queued:
                self.queues[req.key].forget(req)
                self.dequeued(req)
            move(req, _EXPIRED)
            expired.append((req, queued))
        return expired

    def expire_taken(self, requests: Iterable[PendingRequest]) -> None:
        """Requests taken into a batch that would finish past their deadlines (the
        dispatcher drops them before it sends the batch): each moves to EXPIRED."""
        self._book.move_all(requests, _DISPATCHED, _EXPIRED)

    def answered(self, requests: Iterable[PendingRequest]) -> None:
        """A batch's RESULT came: those of its ``requests`` still at their worker (not
        expired meanwhile) move to DONE. The caller answers them."""
        self._book.move_all(requests, _DISPATCHED, _DONE)

    def failed(self, req: PendingRequest) -> bool:
        """``req`` is answered with an error where it is still at its worker (its batch
        failed, its worker was lost, or the broker stopped): it moves to FAILED, and the
        caller answers it. False: it was answered before (expired), and stays as it is."""
        if req.state is not _DISPATCHED:
            return False
        self._book.move(req, _FAILED)
        return True

    def drop(self, key: RequestKey) -> None:
        """Forget an idle queue (it holds no request)."""
        queue = self.queues.pop(key)
        # Out of the urgency index: its stale views may hold a request that a new queue of
        # its key takes back later (a lost worker's).
        queue.ranks[0] = queue.ranks[1] = None
        tally = queue.tally
        if tally is not None:  # (it counts nothing, unless a count went wrong: undo that)
            tally.interactive = tally.bulk = 0
            tally.recount()

    def forget_model(self, model: str) -> list[RequestKey]:
        """Drop a model's queues and counts, none of which holds a request (the model is
        forgotten); returns the keys of the queues dropped."""
        keys = [k for k, q in self.queues.items() if k[0] == model]
        for key in keys:
            if self.queues[key].count:
                raise ValueError(f"queue {key} still holds requests")
            self.drop(key)
        self.queued_samples.pop(model, None)
        self.queued_batches.pop(model, None)
        self.order.forget(model)
        return keys

    def held(self, client: ClientId) -> tuple[int, int]:
        """The requests ``client`` has the broker hold (queued or at workers) and their
        payload bytes."""
        held = self._book.held.get(client)
        return (0, 0) if held is None else (held[0], held[1])

    def samples_ahead(self, model: str, priority: int) -> int:
        """Queued samples a new request of ``priority`` waits behind (at most)."""
        interactive, bulk = self.queued_samples.get(model, (0, 0))
        return interactive if priority == 0 else interactive + bulk

    def requeue(self, req: PendingRequest) -> None:
        """Put a dispatched request back at the front of its queue (its worker was lost)."""
        self._book.move(req, _QUEUED)
        queue = self.queue(req.key)
        queue.push_front(req)
        self.order.arrived(queue, req)
        self.enqueued(req)
