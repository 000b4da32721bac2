"""50,000 requests through the worker's core and its run path in one process, with a fake
clock: what the worker keeps does not grow with the requests it has served.

Each batch goes the worker's way: its BATCH frames decoded as the loop decodes them,
``WorkerCore.on_broker``, the inline decision, ``run_job`` on a synthetic engine (whose
cost passes on the fake clock), the RESULT from ``on_job_done`` encoded to frames,
heartbeats both ways. Memory is what ``tracemalloc`` traces, after a warm-up and a
collection, so that caches filled once (layouts validated, packers) do not count.
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import numpy as np

from carpool.common.protocol import (
    BatchItem,
    BatchMeta,
    BrokerHeartbeat,
    Command,
    ModelSpec,
    WorkerResult,
    decode_from_broker,
    encode,
)
from carpool.common.protocol import frames as codec
from carpool.common.testing import FakeClock
from carpool.worker.core import RunBatch, WorkerCore
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.run import run_job

REQUESTS = 50_000
WARM_UP = 5_000
PER_BATCH = 8
CYCLE = 64
ITEM = 8
#: Traced memory the worker may gain over REQUESTS requests after its warm-up: a quarter
#: of the 1 MB asked of it, so that even a few bytes per request show (5).
GROWTH_BYTES = 256 << 10


class Worker:
    """A WorkerCore and its engine, driven batch by batch as the worker's loop does. The
    BATCH frames (the broker's part) are made once, CYCLE of them, and sent in turn."""

    def __init__(self) -> None:
        self.clock = FakeClock(100.0)
        self.engine = SyntheticEngine(
            fixed_cost_s=0.001, per_sample_s=0.0001, item_shape=(ITEM,), clock=self.clock
        )
        info = self.engine.info
        spec = ModelSpec("m", info.io.inputs, info.io.outputs, info.io.max_batch)
        self.core = WorkerCore("w", [spec], heartbeat_s=1.0, thread_free=["m"])
        self.core.on_connect(self.clock.now())
        self.batches = 0
        self.wire: list[tuple[BatchMeta, list[Any]]] = []
        for k in range(CYCLE):
            # Requests of 1 and 2 samples; the last of each batch in the simple form.
            items = tuple(
                BatchItem(k * PER_BATCH + i, 1 + i % 2, i == PER_BATCH - 1, 0.25)
                for i in range(PER_BATCH)
            )
            meta = BatchMeta(k + 1, "m", info.io.inputs, items)
            payloads = [_input(item).tobytes() for item in items]
            self.wire.append((meta, encode(Command.BATCH, meta.to_wire(), payloads)))
        self.last: tuple[BatchMeta, list[Any]] | None = None  # a batch and its RESULT

    def serve(self, requests: int) -> None:
        core, clock, engines = self.core, self.clock, {"m": self.engine}
        for _ in range(requests // PER_BATCH):
            meta, frames = self.wire[self.batches % CYCLE]
            self.batches += 1
            action = core.on_broker(clock.now(), decode_from_broker(frames, core.batch_inputs))
            assert isinstance(action, RunBatch)
            core.runs_inline(action)
            core.on_batch_queued(clock.now())
            message = core.on_job_done(clock.now(), run_job(engines, action, clock))
            assert isinstance(message, WorkerResult)
            self.last = (meta, message.to_frames())
            clock.advance(0.0005)
            heartbeats, lost = core.on_tick(clock.now())
            assert lost is None
            for heartbeat in heartbeats:
                heartbeat.to_frames()
                core.on_broker(clock.now(), BrokerHeartbeat())


def _input(item: BatchItem) -> np.ndarray[Any, Any]:
    return np.full((item.samples, ITEM), item.request_id % 97, np.float32)


def test_the_worker_core_holds_no_memory_per_request() -> None:
    worker = Worker()
    worker.serve(WARM_UP)
    gc.collect()
    tracemalloc.start()  # from here on: what is allocated and still held at the end
    try:
        before, _ = tracemalloc.get_traced_memory()
        worker.serve(REQUESTS)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert worker.core.batches_done == (WARM_UP + REQUESTS) // PER_BATCH
    assert after - before < GROWTH_BYTES, f"grew {after - before} bytes"
    # The last RESULT answers its requests right: the first framed, the last simple.
    assert worker.last is not None
    meta, frames = worker.last
    first, last = meta.items[0], meta.items[-1]
    assert codec.unpack(frames[3])["id"] == first.request_id
    assert bytes(frames[4]) == synthetic_output(_input(first)).tobytes()
    simple = codec.unpack(frames[-1], max_bytes=codec.MAX_SIMPLE_BYTES)
    assert simple["id"] == last.request_id
    assert simple["outputs"][0]["data"] == synthetic_output(_input(last)).tobytes()
