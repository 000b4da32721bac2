"""backlog.py: a request joining and leaving the backlog keeps its queue, its counts (the
batches of each key included) and its deadline heap in step, whether one request moves
or a whole batch; ``take`` takes a batch's requests in arrival or EDF order while they
fit, ``shed`` the hopeless ones, ``remove`` one that leaves unbatched."""

from __future__ import annotations

import dataclasses
import random

from carpool.broker.backlog import Backlog
from carpool.broker.batcher import (
    PendingRequest,
    RequestQueue,
    RequestState,
    request_key,
)
from carpool.broker.requests import RequestBook
from carpool.common.protocol import Priority, TensorMeta
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
    assert backlog.take(queue, 2, 0.0, 0.0, edf=False) == [r]
    assert (backlog.queued, r.state) == (0, RequestState.DISPATCHED)
    backlog.requeue(r)
    assert (backlog.queued, backlog.queued_samples, r.state) == (
        1,
        {"m": [2, 0]},
        RequestState.QUEUED,
    )


def _counts(backlog: Backlog, queue: RequestQueue) -> tuple[object, ...]:
    return (
        backlog.queued,
        backlog.queued_bytes,
        backlog.queued_samples,
        backlog.queued_batches,
        queue.count,
        queue.samples,
    )


def test_take_takes_a_batch_in_arrival_order_while_it_fits_and_out_of_the_counts() -> None:
    book = RequestBook()
    backlog = Backlog(book)
    first, bulk, big = req(1, samples=2), req(2, priority=Priority.BULK), req(3, samples=4)
    queue = backlog.add(first)
    backlog.add(bulk)
    backlog.add(big)
    assert backlog.next_up(queue, 0.0, 0.0, edf=False) is first
    # 3 samples: the first two fit, the third (4) does not, and nothing overtakes it.
    assert backlog.take(queue, 3, 0.0, 0.0, edf=False) == [first, bulk]
    assert [r.state for r in (first, bulk, big)] == [
        RequestState.DISPATCHED,
        RequestState.DISPATCHED,
        RequestState.QUEUED,
    ]
    assert _counts(backlog, queue) == (1, 64, {"m": [4, 0]}, {"m": [4, 4]}, 1, 4)
    assert (list(queue), backlog.next_up(queue, 0.0, 0.0, edf=False)) == ([big], big)
    # Too small for the next: nothing leaves, nothing changes.
    assert backlog.take(queue, 3, 0.0, 0.0, edf=False) == []
    assert _counts(backlog, queue) == (1, 64, {"m": [4, 0]}, {"m": [4, 4]}, 1, 4)
    assert backlog.take(queue, 4, 0.0, 0.0, edf=False) == [big]
    assert _counts(backlog, queue) == (0, 0, {"m": [0, 0]}, {"m": [0, 0]}, 0, 0)
    assert backlog.next_up(queue, 0.0, 0.0, edf=False) is None


def test_take_with_edf_takes_the_earliest_deadlines_interactive_first() -> None:
    """Interactive requests by deadline, then bulk; a bulk request whose deadline is
    within ``promote_s`` goes first among them."""
    backlog = Backlog(RequestBook())
    late = pending_request(1, deadline_s=3.0)
    soon = pending_request(2, deadline_s=2.0)
    bulk = pending_request(3, deadline_s=1.0, priority=Priority.BULK)
    queue = backlog.add(late)
    backlog.add(soon)
    backlog.add(bulk)
    assert backlog.next_up(queue, 0.0, 0.5, edf=True) is soon
    assert backlog.take(queue, 2, 0.0, 0.5, edf=True) == [soon, late]
    assert backlog.queued_samples == {"m": [0, 1]}
    again = pending_request(4, deadline_s=2.0)
    backlog.add(again)
    # Within 1 s of its deadline, the bulk request is promoted ahead of it.
    assert backlog.next_up(queue, 0.0, 1.0, edf=True) is bulk
    assert backlog.take(queue, 8, 0.0, 1.0, edf=True) == [bulk, again]
    assert _counts(backlog, queue) == (0, 0, {"m": [0, 0]}, {"m": [0, 0]}, 0, 0)


def test_shed_and_remove_take_requests_out_of_the_queue_and_the_counts() -> None:
    book = RequestBook()
    backlog = Backlog(book)
    r1, r2, r3 = req(1), req(2, samples=2), req(3, priority=Priority.BULK)
    queue = backlog.add(r1)
    backlog.add(r2)
    backlog.add(r3)
    # Deadlines at or before 102 are hopeless: r1 (101) and r2 (102).
    assert backlog.shed(queue, 102.0) == [r1, r2]
    assert (r1.state, r2.state) == (RequestState.EXPIRED, RequestState.EXPIRED)
    assert _counts(backlog, queue) == (1, 16, {"m": [0, 1]}, {"m": [0, 1]}, 1, 1)
    backlog.remove(queue, r3)
    assert r3.state is RequestState.FAILED
    assert _counts(backlog, queue) == (0, 0, {"m": [0, 0]}, {"m": [0, 0]}, 0, 0)
    assert list(queue) == []


def test_expire_takes_every_live_request_past_its_deadline_out_once() -> None:
    """Queued ones leave their queue and the counts; one at a worker is only moved; each
    is EXPIRED and returned once, with whether it was queued."""
    book = RequestBook()
    backlog = Backlog(book)
    r1, r2, r3 = req(1), req(2), req(3)  # deadlines 101, 102, 103
    queue = backlog.add(r1)
    backlog.add(r2)
    backlog.add(r3)
    (sent,) = backlog.take(queue, 1, 0.0, 0.0, edf=False)
    assert sent is r1
    assert list(backlog.expire(102.0)) == [(r1, False), (r2, True)]
    assert (r1.state, r2.state, r3.state) == (
        RequestState.EXPIRED,
        RequestState.EXPIRED,
        RequestState.QUEUED,
    )
    assert list(queue) == [r3]
    assert backlog.queued == 1
    assert list(backlog.expire(102.0)) == []
    # Taken into a batch that would end too late: moved, nothing else.
    (late,) = backlog.take(queue, 1, 0.0, 0.0, edf=False)
    backlog.expire_taken([late])
    assert late.state is RequestState.EXPIRED
    assert list(backlog.expire(200.0)) == []


def _of_width(r: PendingRequest, width: int) -> PendingRequest:
    """``r`` as a request of item shape [width] (a queue of its own)."""
    return dataclasses.replace(r, key=request_key("m", (TensorMeta("x", "float32", (1, width)),)))


def test_queued_samples_count_as_batches_of_their_own_key() -> None:
    """Each key's samples in batches of its unit (here 4): 5 interactive samples of one
    key are 2 batches, 1 of another 1, and a bulk sample of a third 1 more for the bulk
    view. A request sees its own key's samples and the other keys' batches."""
    units = {3: 4, 5: 4, 7: 4}
    book = RequestBook()
    backlog = Backlog(book, lambda key: units[key[1][0][2][0]])
    three = [_of_width(req(i, samples=1), 3) for i in range(1, 6)]
    five = _of_width(req(6), 5)
    seven = _of_width(req(7, priority=Priority.BULK), 7)
    for r in [*three, five, seven]:
        backlog.add(r)
    assert backlog.queued_batches == {"m": [3, 4]}
    assert backlog.ahead(three[0].key, Priority.INTERACTIVE) == (5, 1)
    assert backlog.ahead(three[0].key, Priority.BULK) == (5, 2)
    assert backlog.ahead(five.key, Priority.INTERACTIVE) == (1, 2)
    assert backlog.ahead(_of_width(req(8), 9).key, Priority.BULK) == (0, 4)
    assert not backlog.alone(backlog.queues[five.key])
    # A batch of 4 leaves the first key: 1 sample, 1 batch left.
    queue = backlog.queues[three[0].key]
    backlog.take(queue, 4, 0.0, 0.0, edf=False)
    assert backlog.queued_batches == {"m": [2, 3]}
    # The unit changes (the workers changed): recounted, in batches of 1.
    units[3] = units[5] = units[7] = 1
    backlog.recount(["m"])
    assert backlog.queued_batches == {"m": [2, 3]}
    backlog.add(_of_width(req(9), 3))
    assert backlog.queued_batches == {"m": [3, 4]}
    # One by one, the rest leaves: nothing is counted; an idle queue goes with its count.
    for key, q in list(backlog.queues.items()):
        for r in list(q):
            backlog.remove(q, r)
        backlog.drop(key)
    assert backlog.queued_batches == {"m": [0, 0]}
    assert backlog.alone(RequestQueue(five.key))


def test_batch_counts_stay_those_of_a_full_recount_as_requests_come_and_go() -> None:
    """A request that joins recounts its key's batches only when its samples pass what
    the counted batches hold; after every add and removal the counts equal a recount."""
    rng = random.Random(7)
    backlog = Backlog(RequestBook(), lambda key: 4)
    queued: list[PendingRequest] = []
    for seq in range(1, 300):
        if queued and rng.random() < 0.4:
            r = queued.pop(rng.randrange(len(queued)))
            backlog.remove(backlog.queues[r.key], r)
        else:
            priority = rng.choice((Priority.INTERACTIVE, Priority.BULK))
            r = _of_width(req(seq, rng.randint(1, 6), priority), rng.choice((3, 5)))
            backlog.add(r)
            queued.append(r)
        totals = [0, 0]
        for queue in backlog.queues.values():
            tally = queue.tally
            assert tally is not None
            interactive = sum(q.samples for q in queue if not q.priority)
            every = interactive + sum(q.samples for q in queue if q.priority)
            assert (tally.interactive, tally.interactive + tally.bulk) == (interactive, every)
            assert (tally.first, tally.every) == (-(-interactive // 4), -(-every // 4))
            totals[0] += tally.first
            totals[1] += tally.every
        assert backlog.queued_batches == {"m": totals}


def test_answers_from_workers_move_the_requests_at_them_through_the_book() -> None:
    """A RESULT's requests still at their worker move to DONE (one expired meanwhile
    keeps its answer); an error moves one to FAILED; the client's hold ends with both."""
    book = RequestBook()
    backlog = Backlog(book)
    batch = [req(1), req(2), req(3)]
    for r in batch:
        backlog.add(r)
    assert backlog.take(backlog.queues[batch[0].key], 3, 0.0, 0.0, False) == batch
    backlog.expire_taken([batch[1]])
    backlog.answered(batch)
    assert [r.state for r in batch] == [RequestState.DONE, RequestState.EXPIRED, RequestState.DONE]
    failing = req(4)
    backlog.add(failing)
    backlog.take(backlog.queues[failing.key], 1, 0.0, 0.0, False)
    assert backlog.held(failing.client) == (1, 16)
    assert backlog.failed(failing)
    assert failing.state is RequestState.FAILED
    assert backlog.held(failing.client) == (0, 0)
    assert book.by_origin == {}
    assert not backlog.failed(batch[1])  # answered before (expired): left as it is
    assert batch[1].state is RequestState.EXPIRED
