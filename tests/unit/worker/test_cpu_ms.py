"""RESULT ``cpu_ms`` (protocol §8.4): the worker's CPU for a batch outside its engine run,
from the batch's receipt to its RESULT."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from carpool.common.clock import MonotonicClock
from carpool.common.protocol import BatchItem, BatchMeta, TensorMeta, WorkerResult
from carpool.common.testing import FakeClock
from carpool.worker.core import RunBatch, WorkerCore
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.run import run_job


def _job(samples: int = 2, receipt_cpu_s: float = 0.0) -> RunBatch:
    meta = BatchMeta(
        7,
        "m",
        (TensorMeta("x", "float32", (-1, 4)),),
        tuple(BatchItem(i, 1, False, 0.0) for i in range(samples)),
    )
    frames = [np.full((1, 4), i, np.float32).tobytes() for i in range(samples)]
    return RunBatch(1, meta, frames, receipt_cpu_s)


class _Burner(SyntheticEngine):
    """A synthetic engine whose run uses 5 ms of the fake clock's CPU."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(item_shape=(4,), clock=clock)
        self.fake = clock

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        self.fake.use_cpu(0.005)
        return super().run(inputs)


def test_the_engine_run_is_left_out_and_the_receipt_counted() -> None:
    clock = FakeClock()
    outcome = run_job({"m": _Burner(clock)}, _job(receipt_cpu_s=0.002), clock)
    assert outcome.error is None
    assert outcome.timed
    assert outcome.cpu_s == pytest.approx(0.002)  # the receipt's; not the engine's 5 ms

    core = WorkerCore("w", [])
    core.on_connect(clock.now())
    result = core.on_job_done(clock.now(), outcome)
    assert isinstance(result, WorkerResult)
    assert result.result.cpu_ms == pytest.approx(2.0)
    assert result.result.to_wire()["cpu_ms"] == 2.0


def test_a_real_batch_reports_its_staging_and_replies() -> None:
    clock = MonotonicClock()
    outcome = run_job({"m": SyntheticEngine(item_shape=(4,))}, _job(samples=8), clock)
    assert outcome.error is None
    assert outcome.cpu_s > 0  # stacking the inputs and building eight replies take CPU


def test_a_batch_run_request_by_request_sends_none() -> None:
    """An engine that fails the whole batch runs each request alone: neither its time nor
    its CPU is the batch's, and the RESULT says 0 for both."""

    class Picky(SyntheticEngine):
        def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
            if inputs["x"].shape[0] > 1:
                raise ValueError("one at a time")
            return super().run(inputs)

    clock = FakeClock()
    outcome = run_job({"m": Picky(item_shape=(4,), clock=clock)}, _job(receipt_cpu_s=0.002), clock)
    assert outcome.error is None
    assert not outcome.timed
    core = WorkerCore("w", [])
    core.on_connect(clock.now())
    result = core.on_job_done(clock.now(), outcome)
    assert isinstance(result, WorkerResult)
    assert result.result.cpu_ms == 0.0
    assert "cpu_ms" not in result.result.to_wire()
