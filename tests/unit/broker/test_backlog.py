"""backlog.py: a request joining and leaving the backlog keeps its queue, its counts and
its deadline heap in step, whether one request moves or a whole batch."""

from __future__ import annotations

from carpool.broker.backlog import Backlog
from carpool.broker.batcher import (
    PendingRequest,
    RequestQueue,
    RequestState,
)
from carpool.broker.requests import RequestBook
from carpool.common.protocol import Priority
from tests.unit.broker.pending import pending_request


def req(seq: int, samples: int = 1, priority: Priority = Priority.INTERACTIVE) -> PendingRequest:
    return pending_request(seq, samples, 100.0 + seq, float(seq), priority, 16 * samples)


def test_add_queues_counts_and_indexes_the_deadline_of_a_new_request() -> None:
    backlog = Backlog(RequestBook())
    first, bulk = req(1, samples=2), req(2, samples=3, priority=Priority.BULK)
    queue = backlog.add(first)
    assert backlog.add(bulk) is queue is backlog.queues[first.key]
    assert (queue.count, queue.samples, list(queue)) == (2, 5, [first, bulk])
    # Each counts as an arrival at its own time, as push and note_arrival count it.
    reference = RequestQueue(first.key)
    for r in (first, bulk):
        reference.push(r)
        reference.note_arrival(r.arrival_s, r.samples)
    assert queue.arrival_sps(2.0) == reference.arrival_sps(2.0) == 3 / queue.SHORT_WINDOW_S
    assert (backlog.queued, backlog.queued_bytes) == (2, 80)
    assert backlog.queued_samples == {"m": [2, 3]}
    assert backlog.deadlines.earliest() == first.deadline_s


def test_dequeued_all_takes_a_batch_out_of_the_counts_as_dequeued_does_one_by_one() -> None:
    one_by_one, batched = Backlog(RequestBook()), Backlog(RequestBook())
    batch: list[PendingRequest] = []
    for backlog in (one_by_one, batched):
        batch = [req(1, 2), req(2, 1, Priority.BULK), req(3, 4)]
        for r in [*batch, req(4, 1, Priority.BULK)]:
            backlog.add(r)
    for r in batch:
        one_by_one.dequeued(r)
    batched.dequeued_all(batch)
    for backlog in (one_by_one, batched):
        assert (backlog.queued, backlog.queued_bytes) == (1, 16)
        assert backlog.queued_samples == {"m": [0, 1]}


def test_a_requeued_request_is_counted_again() -> None:
    book = RequestBook()
    backlog = Backlog(book)
    r = req(1, samples=2)
    queue = backlog.add(r)
    taken = queue.take(2, book.move)
    backlog.dequeued_all(taken)
    assert (backlog.queued, r.state) == (0, RequestState.DISPATCHED)
    backlog.requeue(r)
    assert (backlog.queued, backlog.queued_samples, r.state) == (
        1,
        {"m": [2, 0]},
        RequestState.QUEUED,
    )
