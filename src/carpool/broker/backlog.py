"""backlog.py: Backlog — every request the broker holds that has not left for a worker.

Pure: no sockets, threads or clocks. The queues by request key, the deadline heap of every
live request (queued or in flight), and the counts the door and the STATS reply read:
requests and payload bytes queued, and samples queued per model and priority.
"""

from __future__ import annotations

import math

from carpool.broker.batcher import DeadlineHeap, RequestQueue
from carpool.broker.requests import (
    ClientId,
    PendingRequest,
    RequestBook,
    RequestKey,
    RequestState,
)

_QUEUED = RequestState.QUEUED


class Backlog:
    """The queued requests and their counts; see the module docstring."""

    def __init__(self, book: RequestBook) -> None:
        self._book = book
        self.queues: dict[RequestKey, RequestQueue] = {}
        self.deadlines = DeadlineHeap()
        self.queued = 0
        self.queued_bytes = 0  # payload bytes of the queued requests
        # Queued samples per model, by priority (interactive, bulk): admission estimates.
        self.queued_samples: dict[str, list[int]] = {}
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
        self._book.enter(req)
        self.queued += 1
        self.queued_bytes += req.nbytes
        per_model = self.queued_samples.setdefault(req.model, [0, 0])
        per_model[req.priority] += req.samples
        self.deadlines.push(req)
        return queue

    def enqueued(self, req: PendingRequest) -> None:
        self.queued += 1
        self.queued_bytes += req.nbytes
        per_model = self.queued_samples.setdefault(req.model, [0, 0])
        per_model[req.priority] += req.samples

    def dequeued(self, req: PendingRequest) -> None:
        self.queued -= 1
        self.queued_bytes -= req.nbytes
        self.queued_samples[req.model][req.priority] -= req.samples

    def dequeued_all(self, requests: list[PendingRequest]) -> None:
        """:meth:`dequeued` for each of ``requests`` (a batch taken from one queue)."""
        nbytes = 0
        per_model = self.queued_samples
        for req in requests:
            nbytes += req.nbytes
            per_model[req.model][req.priority] -= req.samples
        self.queued -= len(requests)
        self.queued_bytes -= nbytes

    def forget_model(self, model: str) -> list[RequestKey]:
        """Drop a model's queues and counts, none of which holds a request (the model is
        forgotten); returns the keys of the queues dropped."""
        keys = [k for k, q in self.queues.items() if k[0] == model]
        for key in keys:
            if self.queues[key].count:
                raise ValueError(f"queue {key} still holds requests")
            del self.queues[key]
        self.queued_samples.pop(model, None)
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
        self.queue(req.key).push_front(req)
        self.enqueued(req)
