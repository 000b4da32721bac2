"""Short batches of thread-free engines skip the hand-off; thread-bound engines never do."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from carpool.worker.engines.base import Array, EngineInfo
from carpool.worker.engines.synthetic import SyntheticEngine


class ThreadRecorder:
    """A synthetic engine that records which thread ran each batch."""

    def __init__(self, thread_bound: bool) -> None:
        self.inner = SyntheticEngine(item_shape=(2,), max_batch=4)
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
