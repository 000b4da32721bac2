"""Timeouts that pass while queued or in flight are answered with DEADLINE_EXCEEDED."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool.client import DeadlineExceeded
from carpool.common.clock import MonotonicClock
from carpool.worker.engines.synthetic import SyntheticEngine


@pytest.mark.timeout(30)
def test_requests_queued_behind_a_slow_worker_expire_on_time(fleet_factory: Any) -> None:
    engine = SyntheticEngine(fixed_cost_s=0.3, item_shape=(2,), max_batch=1)
    fleet = fleet_factory(max_batch=1, max_wait_s=0.0)
    fleet.add_worker({"slow": lambda: engine}, slots=1, warmup=False)
    client = fleet.ready()
    clock = MonotonicClock()

    blocker = client.submit("slow", {"x": np.zeros((1, 2), np.float32)}, timeout_s=5)
    # The blocker must hold the worker first; sent in the same loop turn as the others, EDF
    # would rightly start with an urgent one instead.
    until = clock.now() + 5
    while client.stats()["inflight_batches"] != 1:
        assert clock.now() < until, "the blocker never reached the worker"
    sent_s = clock.now()
    doomed = [
        client.submit("slow", {"x": np.full((1, 2), i, np.float32)}, timeout_s=0.1)
        for i in range(5)
    ]
    for future in doomed:
        with pytest.raises(DeadlineExceeded):
            future.result(timeout_s=5)
    answered_s = clock.now() - sent_s
    # Answered at the deadline, not after the slow batch: 0.1 s plus a generous margin.
    assert answered_s < 0.3, f"deadline errors came {answered_s:.3f} s after sending"
    np.testing.assert_array_equal(blocker.outputs(timeout_s=5)["y"], np.ones((1, 2)))
    # No expired request reached the engine: only the warm-free blocker ran.
    assert [b[0] for b in engine.batches] == [1]
    assert client.stats()["errors"] == {"DEADLINE_EXCEEDED": 5}


@pytest.mark.timeout(30)
def test_request_in_flight_past_its_deadline_gets_one_error_only(fleet_factory: Any) -> None:
    engine = SyntheticEngine(fixed_cost_s=0.3, item_shape=(2,), max_batch=1)
    fleet = fleet_factory(max_batch=1, max_wait_s=0.0)
    fleet.add_worker({"slow": lambda: engine}, slots=1, warmup=False)
    client = fleet.ready()
    future = client.submit("slow", {"x": np.zeros((1, 2), np.float32)}, timeout_s=0.1)
    with pytest.raises(DeadlineExceeded):
        future.result(timeout_s=5)
    # The late result is dropped by the broker: a follow-up request is answered normally,
    # and the client sees no second reply for the first id.
    np.testing.assert_array_equal(
        client.infer("slow", {"x": np.ones((1, 2), np.float32)}, timeout_s=5)["y"],
        np.full((1, 2), 3.0),
    )
    stats = client.stats()
    assert stats["errors"] == {"DEADLINE_EXCEEDED": 1}
    assert stats["replies"] == 1


@pytest.mark.timeout(60)
def test_hopeless_requests_are_shed_at_once_once_the_cost_is_known(fleet_factory: Any) -> None:
    """A slow GPU-like worker (60 ms + 10 ms per sample). Once the broker has fitted that
    cost, a request with a 30 ms timeout cannot be met by any batch: it is answered
    DEADLINE_EXCEEDED at once, long before its deadline, and never reaches the engine."""
    engine = SyntheticEngine(fixed_cost_s=0.06, per_sample_s=0.01, item_shape=(2,), max_batch=4)
    fleet = fleet_factory(max_batch=4, max_wait_s=0.001)
    fleet.add_worker({"slow": lambda: engine}, slots=1, warmup=False)
    client = fleet.ready()
    clock = MonotonicClock()

    # Calibrate: batches of one and of two samples (a request may carry two).
    client.infer("slow", {"x": np.zeros((1, 2), np.float32)}, timeout_s=5)
    client.infer("slow", {"x": np.zeros((2, 2), np.float32)}, timeout_s=5)
    lane = client.stats()["workers"][0]["lanes"]["slow"]
    assert lane["calibrated"]
    assert lane["fixed_cost_ms"] > 30

    runs_before = len(engine.batches)
    sent_s = clock.now()
    with pytest.raises(DeadlineExceeded, match="cannot"):
        client.infer("slow", {"x": np.full((1, 2), 7, np.float32)}, timeout_s=0.03)
    assert clock.now() - sent_s < 0.03  # answered before the deadline, not at it
    assert len(engine.batches) == runs_before
    # A request with enough time still goes through.
    out = client.infer("slow", {"x": np.ones((1, 2), np.float32)}, timeout_s=2)
    np.testing.assert_array_equal(out["y"], np.full((1, 2), 3.0))
    assert client.stats()["shed"] == 1
