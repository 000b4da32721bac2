"""urgency.py: QueueOrder, a model's queues in the order a free slot is offered to them
(priority, then the deadline at the queue's head, as EDF reads a queue), kept lazily."""

from __future__ import annotations

import dataclasses

from carpool.broker.batcher import PendingRequest, RequestQueue, RequestState, request_key
from carpool.broker.requests import RequestBook
from carpool.broker.urgency import QueueOrder, rank_of
from carpool.common.protocol import Priority, TensorMeta
from tests.unit.broker.pending import pending_request

BOOK = RequestBook()
INTERACTIVE, BULK = Priority.INTERACTIVE, Priority.BULK


def never(now: float, queue: RequestQueue) -> float:
    """No promotion window: a bulk head goes after every interactive one."""
    return 0.0


def queue_of(width: int) -> RequestQueue:
    return RequestQueue(request_key("m", (TensorMeta("x", "float32", (1, width)),)))


def arrive(
    order: QueueOrder,
    queue: RequestQueue,
    seq: int,
    deadline_s: float,
    priority: Priority = INTERACTIVE,
) -> PendingRequest:
    req = dataclasses.replace(
        pending_request(seq, deadline_s=deadline_s, priority=priority), key=queue.key
    )
    queue.push(req)
    order.arrived(queue, req)
    return req


def walk(order: QueueOrder, now: float = 0.0, stop_after: int = 99) -> list[RequestQueue]:
    seen: list[RequestQueue] = []

    def visit(queue: RequestQueue) -> bool:
        seen.append(queue)
        return len(seen) < stop_after

    order.offer("m", now, never, visit)
    return seen


def test_queues_are_offered_by_the_deadline_at_their_head_each_once() -> None:
    order = QueueOrder()
    a, b, c = queue_of(1), queue_of(2), queue_of(3)
    arrive(order, a, 1, 5.0)
    arrive(order, b, 2, 1.0)
    arrive(order, c, 3, 3.0)
    arrive(order, b, 4, 0.5)  # ahead of its queue's head: b moves up
    arrive(order, a, 5, 9.0)  # behind it: nothing changes
    assert order.first("m", 0.0, never) is b
    assert walk(order) == [b, c, a]
    # A walk leaves every queue indexed as it found it; a stopped one too.
    assert walk(order, stop_after=1) == [b]
    assert walk(order) == [b, c, a]


def test_a_queue_whose_head_left_is_offered_by_its_next_request() -> None:
    order = QueueOrder()
    a, b = queue_of(1), queue_of(2)
    first = arrive(order, a, 1, 1.0)
    arrive(order, a, 2, 9.0)
    arrive(order, b, 3, 5.0)
    assert order.first("m", 0.0, never) is a
    BOOK.move(first, RequestState.DISPATCHED)  # (taken: nothing tells the index)
    assert order.first("m", 0.0, never) is b
    assert walk(order) == [b, a]
    for req in list(a) + list(b):
        BOOK.move(req, RequestState.EXPIRED)
    assert order.first("m", 0.0, never) is None
    assert walk(order) == []


def test_a_bulk_head_comes_after_interactive_ones_until_its_deadline_is_near() -> None:
    """As within a queue (``next_edf``): bulk after interactive, unless its deadline is
    within the promotion window and no later than theirs."""
    order = QueueOrder()
    bulk, interactive = queue_of(1), queue_of(2)
    arrive(order, bulk, 1, 2.0, BULK)
    arrive(order, interactive, 2, 4.0)

    def window(seconds: float) -> list[RequestQueue]:
        def promote_s(now: float, queue: RequestQueue) -> float:
            return seconds

        seen: list[RequestQueue] = []

        def visit(queue: RequestQueue) -> bool:
            seen.append(queue)
            return True

        order.offer("m", 0.0, promote_s, visit)
        # Queues pumped together are sorted the same way.
        assert sorted(seen, key=lambda q: rank_of(q, 0.0, promote_s)) == seen
        return seen

    assert window(1.0) == [interactive, bulk]
    assert window(2.0) == [bulk, interactive]
    assert rank_of(bulk, 0.0, never) == (1, 2.0)
    assert rank_of(queue_of(3), 0.0, never)[0] == 2  # empty


def test_entries_an_earlier_arrival_superseded_do_not_pile_up() -> None:
    """Each arrival ahead of its queue's head adds an entry; the ones it supersedes are
    dropped in bulk once they are half the heap, not kept until they reach its top."""
    order = QueueOrder()
    queue = queue_of(1)
    for seq in range(1, 10_001):
        arrive(order, queue, seq, 1e6 - seq)
    heap = order._models["m"].heaps[0]
    assert len(heap) <= 2 * 64
    assert walk(order) == [queue]
