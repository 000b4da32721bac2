"""core.py with many queue keys: requests of a model with a dynamic item dim, each of its
own shape (OCR lines, crops, cameras of several resolutions), so each is a queue of its
own, and the queues share the model's worker slots. Uses harness.py (both pump
modes) on the injected clock."""

from __future__ import annotations

from collections import deque

import pytest

from carpool.broker.config import BatchingConfig
from carpool.broker.dispatcher import Dispatcher
from carpool.common.protocol import Command
from tests.unit.broker.harness import (
    C1,
    SPEC_DYN,
    T0,
    W1,
    Broker,
    Msg,
    batches,
    ids,
    parse,
    to_clients,
)

#: Each its own shape [1, k], k = 1..SHAPES: as many queues as requests.
SHAPES = 300


def test_a_flood_of_distinct_shapes_is_answered_and_a_result_pumps_one_queue_not_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flood of issue #27: every request of its own shape, 20 s timeouts, one worker of
    two slots at 1 ms a batch (alpha 1 ms, beta 0). Each is answered with its own result,
    and a batch's RESULT, which frees one slot, pumps about one queue, not every queue of
    the model: pumping them all made the broker's work per batch grow with the number of
    queues, n^2/2 queue pumps for a flood of n shapes (the live broker got through 2,000
    in 13-19 s of its 20 s timeouts, and let 2,169 of 3,000 expire)."""
    pumped = 0
    pump = Dispatcher.pump

    def counting(self: Dispatcher, *args: object) -> int:
        nonlocal pumped
        pumped += 1
        return pump(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Dispatcher, "pump", counting)
    b = Broker.make(batching=BatchingConfig(max_batch=8, policy="carpool"))
    b.ready(T0, W1, SPEC_DYN, slots=2)
    now = T0
    held: deque[Msg] = deque()  # the worker's batches, in the order it runs them
    answered: dict[int, Msg] = {}

    def take(msgs: list[Msg]) -> None:
        for batch in batches(msgs):
            (rid,) = ids(batch)  # alone: no other request has its shape
            assert batch.batch.inputs[0].shape == (-1, rid)  # request k is [1, k]
            held.append(batch)
        for m in to_clients(msgs):
            assert m.rid is not None
            assert m.rid not in answered
            answered[m.rid] = m

    for k in range(1, SHAPES + 1):
        take(b.request(now, k, model="dyn", item=(k,), timeout_ms=20_000))
    pumped_at_door = pumped
    while held:
        batch = held.popleft()
        now += 0.001
        msgs, _ = b.result(now, batch, rho=1.0, compute_ms=1.0)
        take(msgs)
    assert b.core.queued == 0
    assert sorted(answered) == list(range(1, SHAPES + 1))
    assert all(m.command is Command.REPLY for m in answered.values())
    # Back to back: each RESULT sent the next batch at once.
    assert now - T0 == pytest.approx(SHAPES * 0.001)
    # One pump per arrival at the door, then about one per RESULT (a few to spare).
    assert pumped - pumped_at_door <= 3 * SHAPES


def _busy_worker_with_three_shapes_queued(b: Broker) -> Msg:
    """One worker of one slot, busy with request 1; requests 2, 3 and 4 queued behind it,
    each of its own shape, in that order, due in 900, 300 and 600 ms. Returns the BATCH
    of request 1."""
    b.ready(T0, W1, SPEC_DYN, slots=1)
    (first,) = batches(b.request(T0, 1, model="dyn", item=(1,), timeout_ms=5_000))
    for rid, timeout_ms in ((2, 900), (3, 300), (4, 600)):
        now = T0 + 0.001 * rid
        assert b.request(now, rid, model="dyn", item=(rid,), timeout_ms=timeout_ms) == []
    return first


def test_a_freed_slot_goes_to_the_most_urgent_queue_not_the_oldest() -> None:
    """Each RESULT frees the slot for the queue whose head is due first: 3, 4, then 2.
    (The queues were asked in the order they were created: 2, 3, 4, and request 3 waited
    two batches behind requests queued after it with more time left.)"""
    b = Broker.make(batching=BatchingConfig(max_batch=8, policy="carpool"))
    batch = _busy_worker_with_three_shapes_queued(b)
    now = T0 + 0.010
    served: list[int] = []
    for _ in range(3):
        msgs, _ = b.result(now, batch, compute_ms=10.0)
        (batch,) = batches(msgs)
        served += ids(batch)
        now += 0.010
    assert served == [3, 4, 2]


def test_an_arrival_in_the_turn_a_slot_frees_does_not_take_it_first() -> None:
    """A request of shape [1, 5] (due in 800 ms) and the RESULT that frees the slot come
    in one loop turn (the tick that ends the turn forms the batches): the slot goes to
    the most urgent queue, request 3's, not to the queue the turn's arrival touched
    (pumped first, it took the slot)."""
    b = Broker.make(batching=BatchingConfig(max_batch=8, policy="carpool"))
    batch = _busy_worker_with_three_shapes_queued(b)
    now = T0 + 0.010
    frames = b.request_frames(5, model="dyn", item=(5,), timeout_ms=800)
    msgs = [parse(o) for o in b.core.on_client(now, C1, frames)]  # no tick: same turn
    more, _ = b.result(now, batch, compute_ms=10.0)  # (then the turn's tick)
    (sent,) = batches(msgs + more)
    assert ids(sent) == [3]
