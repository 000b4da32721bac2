"""core.py with many queue keys: requests of a model with a dynamic item dim, each of its
own shape (OCR lines, crops, cameras of several resolutions), so each is a queue of its
own. Uses test_core's harness (both pump modes) on the injected clock."""

from __future__ import annotations

from collections import deque

import pytest

from carpool.broker.config import BatchingConfig
from carpool.broker.dispatcher import Dispatcher
from carpool.common.protocol import Command
from tests.unit.broker.test_core import (  # noqa: F401  (pump_mode: autouse, both modes)
    SPEC_DYN,
    T0,
    W1,
    Broker,
    Msg,
    batches,
    ids,
    pump_mode,
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

    def counting(self: Dispatcher, *args: object) -> None:
        nonlocal pumped
        pumped += 1
        pump(self, *args)  # type: ignore[arg-type]

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
