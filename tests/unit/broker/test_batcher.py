"""batcher.py: request keys, the per-key FIFO, the deadline heap."""

from __future__ import annotations

import pytest

from carpool.broker.batcher import (
    DeadlineHeap,
    PendingRequest,
    RequestQueue,
    RequestState,
    request_key,
)
from carpool.broker.requests import RequestBook
from carpool.common.protocol import Priority, TensorMeta
from tests.unit.broker.pending import pending_request

#: Moves the requests these tests take, shed or answer, as the broker's book does.
BOOK = RequestBook()
MOVE = BOOK.move
X = (TensorMeta("x", "float32", (1, 4)),)
KEY = request_key("m", X)


#: A request of model "m" (tests/unit/broker/pending.py).
req = pending_request


# --------------------------------------------------------------------------- keys


def test_request_key_ignores_dim_0() -> None:
    assert request_key("m", X) == request_key("m", (TensorMeta("x", "float32", (7, 4)),))
    assert request_key("m", X) == ("m", (("x", "float32", (4,)),))


@pytest.mark.parametrize(
    "inputs",
    [
        (TensorMeta("x", "float32", (1, 5)),),
        (TensorMeta("x", "float16", (1, 4)),),
        (TensorMeta("y", "float32", (1, 4)),),
        (TensorMeta("x", "float32", (1, 4, 1)),),
        (TensorMeta("x", "float32", (1, 4)), TensorMeta("z", "uint8", (1,))),
    ],
)
def test_request_key_separates_item_shapes_dtypes_and_names(inputs: tuple[TensorMeta, ...]) -> None:
    assert request_key("m", inputs) != KEY


def test_request_key_separates_models() -> None:
    assert request_key("n", X) != KEY


# --------------------------------------------------------------------------- queue


def test_queue_fifo_and_counts() -> None:
    q = RequestQueue(KEY)
    assert q.head() is None
    a, b, c = req(1), req(2, samples=3), req(3)
    for r in (a, b, c):
        q.push(r)
    assert (q.count, q.samples) == (3, 5)
    assert q.head() is a
    assert list(q) == [a, b, c]
    assert q.take(4, MOVE) == [a, b]
    assert (q.count, q.samples) == (1, 1)
    assert q.head() is c
    assert q.take(10, MOVE) == [c]
    assert (q.count, q.samples) == (0, 0)
    assert q.head() is None
    assert q.take(10, MOVE) == []


def test_take_never_skips_ahead() -> None:
    # FIFO: a request that does not fit blocks the ones behind it.
    q = RequestQueue(KEY)
    big, small = req(1, samples=5), req(2, samples=1)
    q.push(big)
    q.push(small)
    assert q.take(4, MOVE) == []
    assert (q.count, q.samples) == (2, 6)
    assert q.head() is big


@pytest.mark.parametrize(
    ("sizes", "room", "taken"),
    [
        ([1, 1, 1, 1, 1], 3, 3),
        ([2, 2, 2], 5, 2),
        ([2, 2, 2], 6, 3),
        ([3, 1, 4], 4, 2),
        ([4], 4, 1),
        ([1], 0, 0),
    ],
)
def test_take_respects_max_samples(sizes: list[int], room: int, taken: int) -> None:
    q = RequestQueue(KEY)
    reqs = [req(i, samples=s) for i, s in enumerate(sizes)]
    for r in reqs:
        q.push(r)
    got = q.take(room, MOVE)
    assert got == reqs[:taken]
    assert sum(r.samples for r in got) <= room
    assert q.count == len(sizes) - taken
    assert q.samples == sum(sizes[taken:])


def test_forget_and_lazy_removal() -> None:
    q = RequestQueue(KEY)
    a, b, c = req(1), req(2, samples=2), req(3)
    for r in (a, b, c):
        q.push(r)
    MOVE(a, RequestState.EXPIRED)
    q.forget(a)
    MOVE(b, RequestState.EXPIRED)
    q.forget(b)
    assert (q.count, q.samples) == (1, 1)
    assert list(q) == [c]
    assert q.head() is c
    assert q.take(1, MOVE) == [c]
    assert q.head() is None


def test_take_skips_stale_entries_in_the_middle() -> None:
    q = RequestQueue(KEY)
    a, b, c = req(1), req(2), req(3)
    for r in (a, b, c):
        q.push(r)
    MOVE(b, RequestState.EXPIRED)
    q.forget(b)
    assert q.take(2, MOVE) == [a, c]
    assert (q.count, q.samples) == (0, 0)


def test_push_front_for_requeue() -> None:
    q = RequestQueue(KEY)
    a, b, c = req(1), req(2), req(3)
    q.push(c)
    q.push_front(b)
    q.push_front(a)
    assert list(q) == [a, b, c]
    assert (q.count, q.samples) == (3, 3)


# --------------------------------------------------------------------------- EDF views

BULK = Priority.BULK


def queue_of(*reqs: PendingRequest) -> RequestQueue:
    q = RequestQueue(KEY)
    for r in reqs:
        q.push(r)
    return q


def test_earliest_deadline_across_priorities() -> None:
    a, b, c = req(1, deadline_s=5.0), req(2, deadline_s=3.0, priority=BULK), req(3, deadline_s=4.0)
    q = queue_of(a, b, c)
    assert q.earliest_deadline() is b
    MOVE(b, RequestState.EXPIRED)
    q.forget(b)
    assert q.earliest_deadline() is c
    assert q.head() is a  # arrival order is a separate view
    assert RequestQueue(KEY).earliest_deadline() is None


@pytest.mark.parametrize(
    ("now", "promote_s", "expected"),
    [
        (0.0, 0.5, 3),  # bulk has slack: the interactive request goes first
        (2.6, 0.5, 2),  # bulk deadline (3.0) within 0.5 s: promoted
        (0.0, 3.0, 2),
    ],
)
def test_next_edf_prefers_interactive_until_bulk_is_urgent(
    now: float, promote_s: float, expected: int
) -> None:
    q = queue_of(
        req(1, deadline_s=9.0), req(2, deadline_s=3.0, priority=BULK), req(3, deadline_s=4.0)
    )
    got = q.next_edf(now, promote_s)
    assert got is not None
    assert got.seq == expected


def test_next_edf_between_urgent_bulk_and_earlier_interactive_is_plain_edf() -> None:
    q = queue_of(req(1, deadline_s=2.0), req(2, deadline_s=3.0, priority=BULK))
    assert q.next_edf(2.9, 1.0).seq == 1  # type: ignore[union-attr]


def test_next_edf_serves_bulk_when_no_interactive_waits() -> None:
    q = queue_of(req(1, deadline_s=50.0, priority=BULK))
    assert q.next_edf(0.0, 0.0).seq == 1  # type: ignore[union-attr]


def test_take_edf() -> None:
    a = req(1, deadline_s=9.0)
    b = req(2, samples=2, deadline_s=3.0)
    c = req(3, deadline_s=4.0, priority=BULK)
    d = req(4, samples=3, deadline_s=5.0)
    q = queue_of(a, b, c, d)
    taken = q.take_edf(4, now=0.0, promote_before_s=0.1, move=MOVE)
    assert taken == [b]  # then d (3 samples) does not fit in the 2 left: stop, no skipping
    assert b.state is RequestState.DISPATCHED
    assert (q.count, q.samples) == (3, 5)
    assert q.take_edf(4, now=0.0, promote_before_s=0.1, move=MOVE) == [d, a]
    assert q.take_edf(4, now=0.0, promote_before_s=0.1, move=MOVE) == [c]
    assert (q.count, q.samples) == (0, 0)
    assert q.head() is None


def test_shed_pops_what_is_due_at_or_before_the_limit() -> None:
    a = req(1, deadline_s=1.0)
    b = req(2, deadline_s=2.0, priority=BULK)
    c = req(3, deadline_s=3.0)
    q = queue_of(a, b, c)
    assert q.shed(0.99, MOVE) == []
    assert q.shed(1.0, MOVE) == [a]  # no slack left is hopeless
    assert q.shed(2.5, MOVE) == [b]
    assert (q.count, q.samples) == (1, 1)
    # shed() pops, counts and moves them to EXPIRED (so that the queue can drop them at
    # once); the caller answers them.
    assert a.state is RequestState.EXPIRED


def test_arrival_rate_over_two_windows() -> None:
    q = RequestQueue(KEY)
    assert q.arrival_sps(0.0) == 0.0
    q.note_arrival(10.0, 2)
    q.note_arrival(10.05, 3)
    assert q.arrival_sps(10.05) == pytest.approx(50.0)  # 5 samples in the short 0.1 s window
    assert q.arrival_sps(10.5) == pytest.approx(5.0)  # only the 1 s window still holds them
    assert q.arrival_sps(11.06) == 0.0


# --------------------------------------------------------------------------- deadlines


def test_deadline_heap_orders_by_deadline() -> None:
    h = DeadlineHeap()
    assert h.earliest() is None
    a, b, c = req(1, deadline_s=5.0), req(2, deadline_s=3.0), req(3, deadline_s=4.0)
    for r in (a, b, c):
        h.push(r)
    assert len(h) == 3
    assert h.earliest() == 3.0
    assert h.pop_expired(2.99) == []
    assert h.pop_expired(4.0) == [b, c]  # inclusive: a deadline at `now` has passed
    assert h.earliest() == 5.0
    assert h.pop_expired(100.0) == [a]
    assert h.earliest() is None
    assert len(h) == 0


def test_deadline_heap_ties_break_by_arrival() -> None:
    h = DeadlineHeap()
    reqs = [req(s, deadline_s=1.0) for s in (3, 1, 2)]
    for r in reqs:
        h.push(r)
    assert [r.seq for r in h.pop_expired(1.0)] == [1, 2, 3]


_DISPATCHED = RequestState.DISPATCHED


@pytest.mark.parametrize(
    ("path", "live"),
    [
        ((), True),
        ((_DISPATCHED,), True),
        ((_DISPATCHED, RequestState.DONE), False),
        ((RequestState.EXPIRED,), False),
        ((RequestState.FAILED,), False),
    ],
)
def test_deadline_heap_skips_finished_requests(path: tuple[RequestState, ...], live: bool) -> None:
    h = DeadlineHeap()
    r, later = req(1, deadline_s=1.0), req(2, deadline_s=2.0)
    h.push(r)
    h.push(later)
    for state in path:
        MOVE(r, state)
    assert h.earliest() == (1.0 if live else 2.0)
    assert h.pop_expired(1.5) == ([r] if live else [])
    assert h.earliest() == 2.0


def test_deadline_heap_drops_answered_entries_before_their_deadlines() -> None:
    """A stream of answered requests with long deadlines keeps the heap near the number
    of live requests, and what is live stays in deadline order."""
    h = DeadlineHeap()
    live = []
    for seq in range(1, 20_001):
        r = req(seq, deadline_s=10.0 + seq * 1e-4)
        h.push(r)
        if seq % 1000 == 0:
            live.append(r)  # one in a thousand still waits
        else:
            MOVE(r, _DISPATCHED)
            MOVE(r, RequestState.DONE)
    assert len(h) < 2 * DeadlineHeap.MIN_COMPACT
    assert h.earliest() == live[0].deadline_s
    assert h.pop_expired(100.0) == live


def test_shedding_a_full_queue_rebuilds_it_once_not_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shedding 10,000 queued requests rebuilds the arrival order once, not once per
    forgotten request (~n/2 rebuilds would be seconds of the broker's loop)."""
    queue = RequestQueue(KEY)
    for i in range(10_000):
        queue.push(req(i, deadline_s=1.0 + i * 1e-6))
    rebuilt = 0
    compact = RequestQueue._compact

    def counting(self: RequestQueue) -> None:
        nonlocal rebuilt
        before = self._arrivals
        compact(self)
        rebuilt += self._arrivals is not before

    monkeypatch.setattr(RequestQueue, "_compact", counting)
    out = queue.shed(10.0, MOVE)
    assert len(out) == 10_000
    assert queue.count == 0
    assert all(r.state is RequestState.EXPIRED for r in out)
    assert rebuilt <= 1
    assert len(queue._arrivals) == 0
