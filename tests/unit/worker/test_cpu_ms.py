"""RESULT ``cpu_ms`` (protocol §8.4): the worker's CPU for a batch outside the time its
``compute_ms`` covers, from the batch's receipt to its RESULT."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from carpool.common.clock import MonotonicClock
from carpool.common.protocol import BatchItem, BatchMeta, TensorMeta, WorkerResult
from carpool.common.testing import FakeClock
from carpool.worker.core import RunBatch, WorkerCore
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.run import finish_job, run_job, start_job


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


def _big_job(samples: int = 16) -> RunBatch:
    """A batch whose stacking copies 16 x 768 KiB: CPU that a measure can see."""
    shape = (3, 256, 256)
    meta = BatchMeta(
        9,
        "m",
        (TensorMeta("x", "float32", (-1, *shape)),),
        tuple(BatchItem(i, 1, False, 0.0) for i in range(samples)),
    )
    return RunBatch(1, meta, [np.ones((1, *shape), np.float32).tobytes()] * samples)


@pytest.mark.parametrize("queued_behind", [False, True])
def test_staging_counts_only_outside_the_batchs_time(queued_behind: bool) -> None:
    """compute_ms runs from the batch's start, its staging included, unless it was queued
    behind another batch and its time starts when that one ended: cpu_ms counts the
    staging only then, so no CPU is in both."""
    clock = MonotonicClock()
    engines = {"m": SyntheticEngine(item_shape=(3, 256, 256), max_batch=16)}
    before = time.thread_time()
    started = start_job(engines, _big_job(), clock)
    staging_s = time.thread_time() - before
    not_before_s = clock.now() if queued_behind else -math.inf
    outcome = finish_job(started, clock, not_before_s=not_before_s)
    assert outcome.error is None
    if queued_behind:
        assert outcome.cpu_s >= staging_s * 0.9
    else:
        assert outcome.cpu_s < staging_s / 2  # (the replies: views of the outputs)
