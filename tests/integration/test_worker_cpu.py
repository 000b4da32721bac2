"""A real worker's RESULT carries ``cpu_ms`` (protocol §8.4): its CPU for the batch outside
the engine run, on whichever thread ran it."""

from __future__ import annotations

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

BURN_S = 0.03


class Burner:
    """A synthetic engine that uses ``BURN_S`` of its thread's CPU per batch."""

    thread_bound = False

    def __init__(self) -> None:
        self.inner = SyntheticEngine(item_shape=(4,), max_batch=8)

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        until = time.thread_time() + BURN_S
        while time.thread_time() < until:
            pass
        return self.inner.run(inputs)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.timeout(60)
def test_result_cpu_ms_leaves_the_engine_out() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://worker-cpu")
    inputs = [{"name": "x", "dtype": "float32", "shape": [-1, 4]}]
    x = np.ones((1, 4), np.float32).tobytes()
    metas: list[dict[str, Any]] = []
    with WorkerServer("inproc://worker-cpu", {"m": Burner}, warmup=False, context=context) as w:
        for _ in range(1000):
            if router.poll(0):
                break
            w.step(0.01)
        wid = router.recv_multipart()[0]  # READY
        for batch_id in (1, 2, 3):  # the first on the inference thread; later ones may not
            items = [{"id": i, "n": 1, "queue_ms": 0.0} for i in range(4)]
            meta = {"batch": batch_id, "model": "m", "inputs": inputs, "requests": items}
            router.send_multipart([wid, *encode(Command.BATCH, meta, [x] * 4)])
            until = time.monotonic() + 20
            while time.monotonic() < until and len(metas) < batch_id:
                w.step(0.01)
                while router.poll(0):
                    frames = router.recv_multipart()
                    if frames[1] == header(Command.RESULT):
                        metas.append(codec.unpack(frames[2]))
            assert len(metas) == batch_id, f"no RESULT for batch {batch_id}"
    router.close()
    for m in metas:
        assert m["compute_ms"] >= 1000 * BURN_S
        assert 0 < m["cpu_ms"] < 1000 * BURN_S  # decoding, stacking, replies: not the burn
