"""The engine watchdog on real sockets (protocol §10.6): a worker whose inference thread
hangs while its loop still heartbeats, and a peer that takes 1,024 credits and answers
nothing, lose their batches to a worker that answers; every request is answered once,
correctly, within its deadline."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.common.clock import MonotonicClock
from carpool.common.protocol import (
    Command,
    Ready,
    WorkerHeartbeat,
    WorkerReady,
    parse_header,
)
from carpool.worker.engines.base import Array, EngineInfo
from carpool.worker.engines.synthetic import SyntheticEngine
from tests.conftest import Fleet, wait_for_workers

pytestmark = pytest.mark.timeout(60)

ITEM = (2,)


def x(i: int) -> Array:
    return np.full((1, *ITEM), i, np.float32)


class HangingEngine:
    """A synthetic engine whose next batch, once ``hang`` is set, blocks until
    ``release`` (at most 10 s): a wedged engine behind a live worker loop. Bound to the
    inference thread, so the loop keeps heartbeating."""

    thread_bound = True

    def __init__(self) -> None:
        self.inner = SyntheticEngine(item_shape=ITEM, max_batch=4)
        self.hang = threading.Event()
        self.hung = threading.Event()  # set when a batch is stuck
        self.release = threading.Event()

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        if self.hang.is_set() and not self.release.is_set():
            self.hung.set()
            self.release.wait(10.0)
        return self.inner.run(inputs)

    def close(self) -> None:
        pass


def wait_until(what: str, check: Any, client: Any, timeout_s: float = 10.0) -> None:
    clock = MonotonicClock()
    until = clock.now() + timeout_s
    while clock.now() < until:
        if check():
            return
        client.poll(0.02)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def worker_stats(client: Any, name: str) -> dict[str, Any]:
    (stats,) = [w for w in client.stats()["workers"] if w["name"] == name]
    return stats


def test_a_hung_engine_loses_its_batch_to_a_worker_that_answers(fleet_factory: Any) -> None:
    fleet: Fleet = fleet_factory(max_batch=1, max_wait_s=0.0)
    hanging = HangingEngine()
    fleet.add_worker({"m": lambda: hanging}, name="hangs", heartbeat_s=0.1, warmup=False)
    client = fleet.ready()
    for i in range(3):  # the broker learns the model's cost
        np.testing.assert_array_equal(client.infer("m", {"x": x(i)})["y"], 2 * x(i) + 1)
    hanging.hang.set()
    future = client.submit("m", {"x": x(7)}, timeout_s=5)
    wait_until("the batch hangs", hanging.hung.is_set, client)
    fleet.add_worker(
        {"m": lambda: SyntheticEngine(item_shape=ITEM, max_batch=4)}, name="steady", warmup=False
    )
    # After about a second (the slack over a cost of microseconds) the request goes to
    # the steady worker, though the hung one's loop heartbeats all along.
    np.testing.assert_array_equal(future.outputs(timeout_s=5)["y"], 2 * x(7) + 1)
    stats = client.stats()
    assert stats["unhealthy"] == 1
    assert stats["requeued"] == 1
    assert worker_stats(client, "hangs")["health"] == "unhealthy"
    # Freed, the hung engine's late RESULT is dropped and counted: the request stays
    # answered once; the worker shows progress and is trusted with one batch again.
    hanging.release.set()
    wait_until("the late result", lambda: client.stats()["late_results"] == 1, client)
    assert worker_stats(client, "hangs")["health"] in ("probation", "healthy")
    for i in range(8):
        np.testing.assert_array_equal(client.infer("m", {"x": x(i)})["y"], 2 * x(i) + 1)
    assert client.stats()["replies"] == 3 + 1 + 8


class GreedyPeer:
    """A raw DEALER on the worker socket that says READY with 1,024 credits for the model,
    heartbeats (so its registration lives), and answers no batch."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], backend: str) -> None:
        self.context = context
        self.backend = backend
        self.batches = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        spec = SyntheticEngine(item_shape=ITEM, max_batch=4).info.spec("m")
        sock = self.context.socket(zmq.DEALER)
        try:
            sock.linger = 0
            sock.connect(self.backend)
            sock.send_multipart(WorkerReady(Ready("greedy", 1024, (spec,), 1000)).to_frames())
            while not self.stop.is_set():
                if sock.poll(100):
                    frames = sock.recv_multipart()
                    if parse_header(frames[0]) is Command.BATCH:
                        self.batches += 1
                sock.send_multipart(WorkerHeartbeat(None).to_frames())
        finally:
            sock.close(linger=0)


@pytest.fixture
def greedy(
    fleet_factory: Any, context: zmq.Context[zmq.Socket[bytes]]
) -> Iterator[tuple[Fleet, GreedyPeer]]:
    fleet: Fleet = fleet_factory(max_batch=4, max_wait_s=0.0)
    peer = GreedyPeer(context, fleet.broker.backend_endpoint)
    yield fleet, peer
    peer.stop.set()
    if peer.thread.is_alive():
        peer.thread.join(5)


def test_a_peer_that_takes_every_credit_and_answers_nothing_does_not_hold_requests(
    greedy: tuple[Fleet, GreedyPeer],
) -> None:
    fleet, peer = greedy
    fleet.add_worker({"m": lambda: SyntheticEngine(item_shape=ITEM, max_batch=4)}, warmup=False)
    client = fleet.ready()
    np.testing.assert_array_equal(client.infer("m", {"x": x(0)})["y"], 2 * x(0) + 1)
    peer.thread.start()
    wait_for_workers(client, 2, timeout_s=10)
    # With the most free credits, the peer is offered the batches first.
    futures = [client.submit("m", {"x": x(i)}, timeout_s=3) for i in range(20)]
    for i, future in enumerate(futures):
        np.testing.assert_array_equal(future.outputs(timeout_s=5)["y"], 2 * x(i) + 1)
    assert peer.batches >= 1
    stats = client.stats()
    assert stats["unhealthy"] == 1
    assert worker_stats(client, "greedy")["health"] == "unhealthy"
    assert stats["replies"] == 21
