"""The client SDK when the broker is away, when the caller reuses its buffers, and when it
is closed with requests in flight: every request still gets exactly one answer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.client import AsyncClient, Client
from carpool.common.errors import Unavailable
from carpool.common.protocol import frames as codec
from carpool.worker.engines.synthetic import SyntheticEngine

X = np.ones((1, 4), np.float32)


@pytest.mark.timeout(60)
def test_a_broker_that_is_away_costs_a_request_its_timeout_not_a_hang(nobody: str) -> None:
    """ZeroMQ queues 1,000 messages for a peer that is not there; past that, a request's
    send waits at most its timeout and then fails Unavailable, however long the broker
    stays away."""
    with Client(nobody, grace_s=0.0) as client:
        futures = []
        for _ in range(3000):
            futures.append(client.submit("m", {"x": X}, timeout_s=0.3))
            if futures[-1].done():
                break
        refused = futures[-1]
        assert refused.done(), "every send was queued: no high-water mark met"
        assert len(futures) > 100  # queued until the mark, then refused
        with pytest.raises(Unavailable, match="not taking requests"):
            refused.result(0)
        assert refused.request_id not in client.core.pending
        # The next one too: submit returns once its send window passed, failed then.
        late = client.submit("m", {"x": X}, timeout_s=0.3)
        assert late.done()
        with pytest.raises(Unavailable, match="not taking requests"):
            late.result(0)
        for future in futures[:-1]:  # the queued ones: at their local deadlines
            with pytest.raises(Unavailable):
                future.result(5)
        with pytest.raises(TimeoutError):
            client.stats(timeout_s=0.2)


@pytest.mark.timeout(60)
def test_the_async_client_too(nobody: str) -> None:
    async def main() -> None:
        # (A grace, so that the local deadline does not race the end of the send's wait:
        # the reader task could settle the request first, as "no reply".)
        async with AsyncClient(nobody, grace_s=0.2) as client:
            futures = []
            for _ in range(3000):
                futures.append(await asyncio.wait_for(client.submit("m", {"x": X}, 0.3), 5))
                if futures[-1].done():
                    break
            refused = futures[-1]
            assert refused.done()
            with pytest.raises(Unavailable, match="not taking requests"):
                refused.result()
            with pytest.raises(Unavailable):
                await asyncio.wait_for(client.infer("m", {"x": X}, timeout_s=0.3), 5)
            for future in futures[:-1]:
                with pytest.raises(Unavailable):
                    await asyncio.wait_for(future, 5)
            with pytest.raises(TimeoutError):
                await client.stats(timeout_s=0.2)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_submitted_input_does_not_change_with_the_callers_buffer(
    nobody: str, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A camera loop refills its frame buffer after submit(); the request already made
    carries what was submitted, even when the socket sends it later (here, once the
    broker comes up): a large input that is the caller's memory is copied first."""
    frame = np.full((1, 32768), 1.0, np.float32)  # 128 KiB: over pyzmq's copy threshold
    small = np.full((1, 4), 1.0, np.float32)
    with Client(nobody) as client:
        client.submit("m", {"x": frame, "s": small}, timeout_s=10)
        frame[:] = 7.0
        small[:] = 7.0
        broker = context.socket(zmq.ROUTER)
        broker.setsockopt(zmq.LINGER, 0)
        broker.bind(nobody)
        try:
            assert broker.poll(10_000)
            frames = broker.recv_multipart()
        finally:
            broker.close()
    meta = codec.unpack(frames[2])
    assert [t["name"] for t in meta["inputs"]] == ["x", "s"]
    assert np.frombuffer(frames[3], np.float32).tolist() == [1.0] * 32768
    assert np.frombuffer(frames[4], np.float32).tolist() == [1.0] * 4


@pytest.mark.timeout(30)
def test_closing_a_client_answers_what_it_had_in_flight(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=4, max_wait_s=0.001)
    gate = threading.Event()  # the batch runs until the client has closed
    slow = Gated(gate)
    fleet.add_worker({"slow": lambda: slow}, warmup=False)
    fleet.ready()
    client = fleet.client()
    futures = [client.submit("slow", {"x": X}, timeout_s=5) for _ in range(3)]
    try:
        client.close()
        assert all(f.done() for f in futures)
        for future in futures:
            with pytest.raises(Unavailable, match="closed"):
                future.result(0)
    finally:
        gate.set()


class Gated(SyntheticEngine):
    """Finishes a batch only once the test opens the gate."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(item_shape=(4,))
        self.gate = gate

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        assert self.gate.wait(30)
        return super().run(inputs)
