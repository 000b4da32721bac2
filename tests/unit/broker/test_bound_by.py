"""Which limit binds a model's B_max (STATS ``max_batch_bound_by``, the join log), and the
per-batch record at DEBUG."""

from __future__ import annotations

import logging

import pytest

from carpool.broker.adaptive import BatchSizeController, Lane
from tests.unit.broker.harness import T0, W1, Broker, batches


@pytest.mark.parametrize(
    ("engine", "cap", "adaptive", "b_max", "bound_by"),
    [
        (4096, 16, None, 16, "broker"),  # a worker left at its engine's limit
        (8, 8, None, 8, "worker"),  # the broker asked for 16, the engine takes 8
        (16, 16, None, 16, "worker"),  # both the same: raising the cap alone does nothing
        (4096, 16, 4, 4, "adaptive"),  # the controller steered below the cap
        (4096, 16, 16, 16, "broker"),  # the controller at the cap
    ],
)
def test_the_limit_that_binds(
    engine: int, cap: int, adaptive: int | None, b_max: int, bound_by: str
) -> None:
    controller = None
    if adaptive is not None:
        controller = BatchSizeController(cap, ())
        controller.batch_size = adaptive
    lane = Lane(controller, engine, cap)
    assert (lane.batch_limit, lane.bound_by) == (b_max, bound_by)


def test_each_finished_batch_is_one_debug_record(caplog: pytest.LogCaptureFixture) -> None:
    b = Broker.make(max_batch=2)
    b.ready(T0, W1, slots=1)
    b.request(T0, 1)
    (batch,) = batches(b.request(T0 + 0.001, 2))
    with caplog.at_level(logging.DEBUG, logger="carpool.broker.stats"):
        b.result(T0 + 0.011, batch)
    (record,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch ")]
    assert "model=m size=2 bucket=" in record
    assert "wait_ms=1.00" in record  # the oldest request's queue wait
    assert "round_trip_ms=10.00" in record
    assert "worker=w1 b_max=2 bound_by=broker" in record
