"""worker/inference.py: the inference thread hands typed outcomes back and wakes the poll."""

from __future__ import annotations

import select
import threading
from typing import Any

import numpy as np
import pytest

from carpool.common.clock import MonotonicClock
from carpool.common.errors import ErrorCode
from carpool.common.protocol import BatchItem, BatchMeta, TensorMeta
from carpool.common.shm import RegionReader
from carpool.worker.core import JobOutcome, RunBatch
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.inference import InferenceThread
from carpool.worker.run import LazyRing

pytestmark = pytest.mark.timeout(30)

INPUTS = (TensorMeta("x", "float32", (-1, 4)),)


def started(**factories: Any) -> InferenceThread:
    return InferenceThread(
        factories,
        name="test",
        warmup=False,
        clock=MonotonicClock(),
        reader=RegionReader(),
        rings=LazyRing(0, 0o600),
    )


def job(batch_id: int, model: str = "m") -> RunBatch:
    items = (BatchItem(batch_id, 1, False, 0.0),)
    return RunBatch(
        3, BatchMeta(batch_id, model, INPUTS, items), [np.ones((1, 4), np.float32).tobytes()]
    )


def collect(thread: InferenceThread, count: int) -> list[JobOutcome]:
    got: list[JobOutcome] = []
    while len(got) < count:
        assert select.select([thread.wake_fd], [], [], 5)[0], "no wake-up"
        got.extend(thread.finished())
    return got


def test_outcomes_come_back_in_order_and_wake_the_poll() -> None:
    thread = started(m=lambda: SyntheticEngine(item_shape=(4,)))
    try:
        for i in (1, 2, 3):
            thread.submit(job(i))
        thread.submit(job(4, "other"))
        got = collect(thread, 4)
        assert [(o.epoch, o.batch_id, o.model) for o in got] == [
            (3, 1, "m"),
            (3, 2, "m"),
            (3, 3, "m"),
            (3, 4, "other"),
        ]
        assert all(o.error is None and o.samples == 1 and o.timed for o in got[:3])
        assert got[3].error is not None
        assert got[3].error[0] is ErrorCode.NOT_FOUND
    finally:
        thread.stop(5)
        assert thread.release_after(lambda: None)


def test_a_failing_engine_factory_fails_the_start_and_closes_the_others() -> None:
    closed: list[str] = []

    class Closing(SyntheticEngine):
        def close(self) -> None:
            closed.append("a")

    def broken() -> SyntheticEngine:
        raise RuntimeError("no device")

    with pytest.raises(RuntimeError, match="no device"):
        started(a=lambda: Closing(item_shape=(4,)), b=broken)
    assert closed == ["a"]


def test_release_waits_for_the_batch_that_runs() -> None:
    running, release = threading.Event(), threading.Event()

    class Gate(SyntheticEngine):
        def run(self, inputs: Any) -> dict[str, Any]:
            running.set()
            release.wait(10)
            return super().run(inputs)

    thread = started(m=lambda: Gate(item_shape=(4,)))
    released = threading.Event()
    thread.submit(job(1))
    thread.submit(job(2))  # never starts: dropped by stop()
    assert running.wait(5)
    thread.stop(0.01)
    assert not thread.release_after(released.set)
    assert not released.is_set()
    release.set()
    assert released.wait(5)
