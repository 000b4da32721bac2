"""Short batches of thread-free engines skip the hand-off; thread-bound engines never do."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.common.protocol import Command, encode, header
from carpool.common.protocol import frames as codec
from carpool.worker.engines.base import Array, EngineInfo
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer


class ThreadRecorder:
    """A synthetic engine that records which thread ran each batch."""

    def __init__(self, thread_bound: bool, inner: SyntheticEngine | None = None) -> None:
        self.inner = inner or SyntheticEngine(item_shape=(2,), max_batch=4)
        self.thread_bound = thread_bound
        self.threads: list[str] = []

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        self.threads.append(threading.current_thread().name)
        return self.inner.run(inputs)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("thread_bound", [False, True])
def test_short_batches_run_inline_only_for_thread_free_engines(
    fleet_factory: Any, thread_bound: bool
) -> None:
    engine = ThreadRecorder(thread_bound)
    fleet = fleet_factory(max_batch=4, max_wait_s=0.0)
    fleet.add_worker({"m": lambda: engine}, warmup=False)
    client = fleet.ready()
    for i in range(20):
        out = client.infer("m", {"x": np.full((1, 2), i, np.float32)}, timeout_s=5)
        np.testing.assert_array_equal(out["y"], np.full((1, 2), 2 * i + 1))
    inference = [t.startswith("carpool-inference") for t in engine.threads]
    assert inference[0]  # the first batch is measured on the inference thread
    if thread_bound:
        assert all(inference)
    else:
        assert not all(inference[1:])  # once known to be short, batches run inline


@pytest.mark.timeout(60)
def test_batches_answered_without_the_engine_do_not_teach_the_inline_rule() -> None:
    """Batches whose requests fail before the engine runs (here: inputs in a region not
    on this host) are answered in microseconds. Timed like real ones, they would make a
    slow model look short and its next batch run on the loop thread (no heartbeat, no
    BATCH read, for the whole batch); they are not timed, and it runs on its thread."""
    engine = ThreadRecorder(False, SyntheticEngine(item_shape=(4,), per_sample_s=0.02))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://inline-rule")
    inputs = [{"name": "x", "dtype": "float32", "shape": [-1, 4]}]
    elsewhere = [{"region": "carpool-not-on-this-host", "offset": 64, "key": "ab" * 16}]

    def run(wid: bytes, batch_id: int, items: list[dict[str, Any]], payloads: list[Any]) -> None:
        meta = {"batch": batch_id, "model": "m", "inputs": inputs, "requests": items}
        router.send_multipart([wid, *encode(Command.BATCH, meta, payloads)])
        until = time.monotonic() + 10
        while time.monotonic() < until:
            worker.step(0.01)
            while router.poll(0):
                frames = router.recv_multipart()
                if frames[1] == header(Command.RESULT):
                    assert codec.unpack(frames[2])["batch"] == batch_id
                    return
        raise AssertionError(f"no RESULT for batch {batch_id}")

    x = np.ones((1, 4), np.float32).tobytes()
    factories = {"m": lambda: engine}
    with WorkerServer("inproc://inline-rule", factories, warmup=False, context=context) as worker:
        for _ in range(500):
            if router.poll(0):
                break
            worker.step(0.01)
        wid = router.recv_multipart()[0]  # READY
        run(wid, 1, [{"id": 1, "n": 1, "queue_ms": 0.0}], [x])  # timed: 20 ms a sample
        for i in range(40):
            run(wid, 100 + i, [{"id": 100 + i, "n": 1, "queue_ms": 0.0, "shm": elsewhere}], [b""])
        run(wid, 2, [{"id": 2, "n": 2, "queue_ms": 0.0}], [x * 2])
    router.close()
    assert engine.threads[-1].startswith("carpool-inference"), engine.threads
    assert len(engine.threads) == 2  # the failed batches never reached the engine
