"""Timeouts that pass while queued or in flight are answered with DEADLINE_EXCEEDED."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from carpool.client import DeadlineExceeded
from carpool.common.clock import MonotonicClock
from carpool.worker.engines.base import Array
from carpool.worker.engines.synthetic import SyntheticEngine


class Gated(SyntheticEngine):
    """Finishes a batch only once the test opens the gate."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(item_shape=(2,), max_batch=1)
        self.gate = gate

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        assert self.gate.wait(30)
        return super().run(inputs)


@pytest.mark.timeout(30)
def test_requests_queued_behind_a_slow_worker_expire_on_time(fleet_factory: Any) -> None:
    gate = threading.Event()
    engine = Gated(gate)
    fleet = fleet_factory(max_batch=1, max_wait_s=0.0)
    fleet.add_worker({"slow": lambda: engine}, slots=1, warmup=False)
    client = fleet.ready()
    clock = MonotonicClock()

    blocker = client.submit("slow", {"x": np.zeros((1, 2), np.float32)}, timeout_s=5)
    # The blocker must hold the worker first; sent in the same loop turn as the others, EDF
    # would rightly start with an urgent one instead.
    until = clock.now() + 10
    while client.stats()["inflight_batches"] != 1:
        assert clock.now() < until, "the blocker never reached the worker"
    doomed = [
        client.submit("slow", {"x": np.full((1, 2), i, np.float32)}, timeout_s=0.1)
        for i in range(5)
    ]
    for future in doomed:
        with pytest.raises(DeadlineExceeded):
            future.result(timeout_s=10)
    # Answered at their deadline, not after the slow batch: that batch is still running
    # (the gate holds it), and the broker has answered all five.
    assert len(engine.batches) == 0
    assert client.stats()["errors"] == {"DEADLINE_EXCEEDED": 5}
    gate.set()
    np.testing.assert_array_equal(blocker.outputs(timeout_s=10)["y"], np.ones((1, 2)))
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

    # Calibrate: batches of one and of two samples (a request may carry two).
    client.infer("slow", {"x": np.zeros((1, 2), np.float32)}, timeout_s=5)
    client.infer("slow", {"x": np.zeros((2, 2), np.float32)}, timeout_s=5)
    lane = client.stats()["workers"][0]["lanes"]["slow"]
    assert lane["calibrated"]
    assert lane["fixed_cost_ms"] > 30

    runs_before = len(engine.batches)
    # Answered before the deadline, not at it: refused at the door, in the turn the
    # request came in (admission's verdict, not the queue's expiry).
    with pytest.raises(DeadlineExceeded, match="cannot meet the 30 ms deadline: predicted"):
        client.infer("slow", {"x": np.full((1, 2), 7, np.float32)}, timeout_s=0.03)
    assert len(engine.batches) == runs_before
    # A request with enough time still goes through.
    out = client.infer("slow", {"x": np.ones((1, 2), np.float32)}, timeout_s=2)
    np.testing.assert_array_equal(out["y"], np.full((1, 2), 3.0))
    assert client.stats()["shed"] == 1
