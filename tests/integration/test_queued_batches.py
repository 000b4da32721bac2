"""An engine that queues batches (``enqueue``, as TensorRT's does on two execution
contexts) gets the next batch before the one before is collected, in the inference thread
and in a real worker on loopback: two batches in flight at once, never more than the
engine's ``contexts``, outcomes in the order the batches came, each once, and each
batch's error its own."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

from carpool.common.clock import MonotonicClock
from carpool.common.errors import ErrorCode
from carpool.common.protocol import BatchItem, BatchMeta, TensorMeta
from carpool.common.shm import RegionReader
from carpool.worker.core import RunBatch
from carpool.worker.engines.base import Array, BadInput, EngineInfo
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.inference import InferenceThread
from carpool.worker.run import LazyRing
from tests.conftest import Fleet
from tests.integration.test_inference_thread import collect

pytestmark = pytest.mark.timeout(60)

ITEM = (2,)


class QueuingEngine:
    """y = 2x + 1 (the synthetic engine's), through ``enqueue`` -> pending ``result()``,
    recording each call and how many batches were queued at once. Its first batch waits
    (at most 10 s) until ``waiting()`` says the next has been handed over, so that
    overlapping it is the inference thread's choice, not a race. A batch whose first value
    is in ``refuse`` is refused by enqueue, one in ``fail`` by result (BadInput)."""

    thread_bound = True
    contexts = 2

    def __init__(self) -> None:
        self.inner = SyntheticEngine(item_shape=ITEM, max_batch=4)
        self.waiting: Callable[[], int] = lambda: 1
        self.log: list[tuple[str, float]] = []
        self.queued = 0
        self.most = 0  # the most batches queued at once
        self.refuse: set[float] = set()
        self.fail: set[float] = set()

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    def enqueue(self, inputs: Mapping[str, Array]) -> Pending:
        value = float(np.asarray(inputs["x"]).flat[0])
        if not self.log:
            clock, pause = MonotonicClock(), threading.Event()
            until = clock.now() + 10.0
            while self.waiting() < 1 and clock.now() < until:
                pause.wait(0.002)
        self.log.append(("enqueue", value))
        if value in self.refuse:
            raise BadInput(f"batch {value:g} refused at enqueue")
        self.queued += 1
        self.most = max(self.most, self.queued)
        return Pending(self, inputs, value)

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        self.log.append(("run", float(np.asarray(inputs["x"]).flat[0])))
        return self.inner.run(inputs)

    def close(self) -> None:
        pass


class Pending:
    def __init__(self, engine: QueuingEngine, inputs: Mapping[str, Array], value: float) -> None:
        self.engine, self.inputs, self.value = engine, inputs, value

    def result(self) -> dict[str, Array]:
        engine = self.engine
        engine.queued -= 1
        engine.log.append(("result", self.value))
        if self.value in engine.fail:
            raise BadInput(f"batch {self.value:g} failed")
        return engine.inner.run(self.inputs)


def x(i: float) -> Array:
    return np.full((1, *ITEM), i, np.float32)


def job(i: int) -> RunBatch:
    inputs = (TensorMeta("x", "float32", (-1, *ITEM)),)
    meta = BatchMeta(i, "m", inputs, (BatchItem(i, 1, False, 0.0),))
    return RunBatch(1, meta, [x(i).tobytes()])


def test_the_inference_thread_queues_the_next_batch_and_reports_in_order() -> None:
    engine = QueuingEngine()
    engine.refuse, engine.fail = {3.0}, {5.0}
    thread = InferenceThread(
        {"m": lambda: engine},
        name="t",
        warmup=False,
        clock=MonotonicClock(),
        reader=RegionReader(),
        rings=LazyRing(0, 0o600),
    )
    engine.waiting = thread.waiting
    try:
        for i in range(1, 8):
            thread.submit(job(i))
        got = collect(thread, 7)
    finally:
        thread.stop(5)
        assert thread.release_after(lambda: None)
    assert [o.batch_id for o in got] == [1, 2, 3, 4, 5, 6, 7]  # in order, each once
    assert [o.error[0] if o.error else None for o in got] == [
        None,
        None,
        ErrorCode.INVALID_ARGUMENT,  # refused by enqueue: its own error
        None,
        ErrorCode.INVALID_ARGUMENT,  # failed in result: its own error
        None,
        None,
    ]
    assert engine.most == 2  # two in flight, never more than its contexts
    assert engine.log[:3] == [("enqueue", 1.0), ("enqueue", 2.0), ("result", 1.0)]
    assert not any(kind == "run" for kind, _ in engine.log)
    for outcome in got:
        if outcome.error is None:
            assert outcome.end_s >= outcome.start_s


def test_a_real_worker_has_two_batches_in_flight_and_answers_each_request_once(
    fleet_factory: Any,
) -> None:
    fleet: Fleet = fleet_factory(max_batch=1, max_wait_s=0.0)
    engine = QueuingEngine()
    worker = fleet.add_worker({"m": lambda: engine}, name="queues", warmup=False)
    engine.waiting = worker.batches_waiting
    client = fleet.ready()
    futures = [client.submit("m", {"x": x(i)}, timeout_s=10) for i in range(1, 7)]
    for i, future in enumerate(futures, 1):
        np.testing.assert_array_equal(future.outputs(timeout_s=10)["y"], 2 * x(i) + 1)
    assert engine.most == 2
    assert ("enqueue", 2.0) in engine.log[: engine.log.index(("result", 1.0))]
    stats = client.stats()
    assert stats["replies"] == 6
    assert stats["late_results"] == 0
