"""worker/inference.py: the inference thread hands typed outcomes back and wakes the poll."""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from carpool.common.clock import MonotonicClock
from carpool.common.errors import ConfigError, ErrorCode
from carpool.common.protocol import BatchItem, BatchMeta, TensorMeta
from carpool.common.shm import RegionReader
from carpool.worker import inference
from carpool.worker.config import ModelConfig, WorkerConfig
from carpool.worker.core import JobOutcome, RunBatch
from carpool.worker.cuda.base import CudaError, Event, Stream
from carpool.worker.cuda.fake import FakeCuda
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.engines.trt import TensorRTEngine
from carpool.worker.factory import worker_server
from carpool.worker.inference import InferenceThread
from carpool.worker.run import LazyRing
from tests.unit.worker.trt_fakes import FakePlan

pytestmark = pytest.mark.timeout(30)

INPUTS = (TensorMeta("x", "float32", (-1, 4)),)


def started(**factories: Any) -> InferenceThread:
    return thread_of(factories)


def thread_of(factories: dict[str, Any], **options: Any) -> InferenceThread:
    return InferenceThread(
        factories,
        name="test",
        warmup=False,
        clock=MonotonicClock(),
        reader=RegionReader(),
        rings=LazyRing(0, 0o600),
        **options,
    )


def slow_start(
    timeout_s: float,
    tell: Callable[[float], None],
    built: threading.Event,
    closed: threading.Event | None = None,
) -> InferenceThread:
    """An inference thread whose one engine is built once ``built`` is set."""

    class Slow(SyntheticEngine):
        def close(self) -> None:
            if closed is not None:
                closed.set()

    def build() -> SyntheticEngine:
        assert built.wait(10)
        return Slow(item_shape=(4,))

    return thread_of({"m": build}, start_timeout_s=timeout_s, starting=tell)


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


def test_an_engine_that_fails_to_close_does_not_keep_the_others_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed: list[str] = []

    class Faulted(SyntheticEngine):
        def close(self) -> None:
            raise CudaError("cudaErrorIllegalAddress: an illegal memory access")

    class Closing(SyntheticEngine):
        def close(self) -> None:
            closed.append("b")

    thread = started(a=lambda: Faulted(item_shape=(4,)), b=lambda: Closing(item_shape=(4,)))
    with caplog.at_level(logging.ERROR, logger="carpool.worker.inference"):
        thread.stop(5)
        assert not thread.alive
    assert closed == ["b"]
    assert [r.getMessage() for r in caplog.records] == ["model 'a': its engine failed to close"]
    assert thread.release_after(lambda: None)


def test_a_tensorrt_batch_is_waited_for_on_the_inference_thread() -> None:
    """The thread that owns the engine (and its CUDA context) collects each batch, with a
    wait on its completion event."""
    waits: list[tuple[str, bool]] = []

    class Recording(FakeCuda):
        def wait(self, done: Event, stream: Stream) -> None:
            waits.append((threading.current_thread().name, done.timing))
            super().wait(done, stream)

    def build() -> TensorRTEngine:
        cuda = Recording()  # opened here: on the inference thread, as open_cuda is
        return TensorRTEngine(FakePlan(cuda), cuda)

    thread = started(m=build)
    try:
        thread.submit(job(1))
        thread.submit(job(2))
        assert [o.error for o in collect(thread, 2)] == [None, None]
    finally:
        thread.stop(5)
        assert thread.release_after(lambda: None)
    assert waits == [("carpool-inference-test", False)] * 2


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


def test_a_slow_start_is_told_how_long_it_has_waited_and_then_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(inference, "STARTING_EVERY_S", 0.05)
    told: list[float] = []
    built = threading.Event()

    def tell(waited_s: float) -> None:
        told.append(waited_s)
        if len(told) == 3:
            built.set()

    thread = slow_start(10.0, tell, built)
    try:
        assert told[:3] == pytest.approx([0.05, 0.1, 0.15])
        thread.submit(job(1))
        (outcome,) = collect(thread, 1)
        assert outcome.error is None
    finally:
        thread.stop(5)
        assert thread.release_after(lambda: None)


def test_a_start_past_its_timeout_fails_naming_it_and_the_engine_is_closed_once_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(inference, "STARTING_EVERY_S", 0.05)
    told: list[float] = []
    built, closed = threading.Event(), threading.Event()
    with pytest.raises(ConfigError, match=r"did not start within start_timeout_s \(0.2 s\)"):
        slow_start(0.2, told.append, built, closed)
    assert told == pytest.approx([0.05, 0.1, 0.15])  # not at the limit itself
    assert not closed.is_set()
    built.set()  # the build ends: the thread closes what it built and ends
    assert closed.wait(10)


def test_a_workers_start_limit_and_what_it_is_told_come_from_its_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A synthetic model whose warm-up runs (0.4 s each) outlast start_timeout_s = 1."""
    monkeypatch.setattr(inference, "STARTING_EVERY_S", 0.25)
    slow = ModelConfig.synthetic("slow", 400, 0, 4)
    config = WorkerConfig(broker="tcp://127.0.0.1:1", models=(slow,), start_timeout_s=1)
    told: list[float] = []
    with pytest.raises(ConfigError, match=r"start_timeout_s \(1 s\)"):
        worker_server(config, starting=told.append)
    assert told == pytest.approx([0.25, 0.5, 0.75])
