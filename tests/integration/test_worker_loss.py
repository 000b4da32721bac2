"""Workers that vanish, stall or restart: requests are requeued or answered, never lost."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest

from carpool.client import Unavailable
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer


@pytest.mark.timeout(30)
def test_worker_leaving_mid_batch_requeues_to_another(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=4, max_wait_s=0.0)
    slow = SyntheticEngine(fixed_cost_s=1.0, item_shape=(2,), max_batch=4)
    fast = SyntheticEngine(item_shape=(2,), max_batch=4)
    leaving = WorkerServer(
        fleet.broker.backend_endpoint, {"m": lambda: slow}, name="leaving", warmup=False
    )
    with ServerThread(leaving):
        client = fleet.ready(count=1)
        futures = [
            client.submit("m", {"x": np.full((1, 2), i, np.float32)}, timeout_s=10)
            for i in range(3)
        ]
        client.poll(0.2)  # the batch reaches the slow worker
    # The slow worker said DISCONNECT while its batch ran; a fast worker joins.
    fleet.add_worker({"m": lambda: fast}, name="fast", warmup=False)
    for i, future in enumerate(futures):
        np.testing.assert_array_equal(future.outputs(timeout_s=10)["y"], np.full((1, 2), 2 * i + 1))
    stats = client.stats()
    # Every request that had reached the slow worker went back to the queue: two or three,
    # as the three arrived in one loop turn (one batch) or over two (slots=2: two batches,
    # the third request queued behind them).
    assert stats["requeued"] in (2, 3)
    assert stats["replies"] == 3


@pytest.mark.timeout(30)
def test_no_worker_left_means_unavailable(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=4, max_wait_s=0.0)
    engine = SyntheticEngine(item_shape=(2,), max_batch=4)
    worker = WorkerServer(fleet.broker.backend_endpoint, {"m": lambda: engine}, warmup=False)
    with ServerThread(worker):
        client = fleet.ready(count=1)
        client.infer("m", {"x": np.zeros((1, 2), np.float32)})
    with pytest.raises(Unavailable):
        client.infer("m", {"x": np.zeros((1, 2), np.float32)}, timeout_s=2)


@pytest.mark.timeout(30)
def test_heartbeats_flow_during_a_long_batch(fleet_factory: Any) -> None:
    """A batch longer than the broker's liveness window must not get the worker dropped."""
    fleet = fleet_factory(max_batch=1, max_wait_s=0.0)
    engine = SyntheticEngine(fixed_cost_s=1.0, item_shape=(2,), max_batch=1)
    fleet.add_worker({"m": lambda: engine}, heartbeat_s=0.1, liveness=3, warmup=False)
    client = fleet.ready()
    out = client.infer("m", {"x": np.zeros((1, 2), np.float32)}, timeout_s=5)
    np.testing.assert_array_equal(out["y"], np.ones((1, 2)))
    stats = client.stats()
    assert stats["requeued"] == 0
    assert len(stats["workers"]) == 1
    assert stats["workers"][0]["rho"] > 0.5  # busy for most of the last second


@pytest.mark.timeout(30)
def test_worker_reregisters_after_broker_restart(context: Any, tmp_path: Any) -> None:
    from carpool.broker.config import BrokerConfig
    from carpool.broker.server import BrokerServer
    from carpool.client import Client

    # ipc endpoints: a restarted broker can bind the same path at once (a TCP port may
    # still be held by the closing socket for a moment).
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    first = BrokerServer(BrokerConfig(frontend=frontend, backend=backend), context=context)
    engine = SyntheticEngine(item_shape=(2,), max_batch=4)
    worker = WorkerServer(
        backend, {"m": lambda: engine}, heartbeat_s=0.1, liveness=3, warmup=False, context=context
    )
    from tests.conftest import wait_for_workers

    x = np.ones((1, 2), np.float32)
    with ServerThread(worker):
        with ServerThread(first), Client(frontend, context=context) as client:
            wait_for_workers(client, 1, timeout_s=10)  # (else NOT_FOUND, now and then)
            assert client.infer("m", {"x": x}, timeout_s=5)["y"][0, 0] == 3.0
        # Same endpoints, new broker process state: the worker must notice and re-register.
        second = BrokerServer(BrokerConfig(frontend=frontend, backend=backend), context=context)
        with ServerThread(second), Client(frontend, context=context) as client:
            wait_for_workers(client, 1, timeout_s=10)
            assert client.infer("m", {"x": x}, timeout_s=5)["y"][0, 0] == 3.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["zeromq", "local"])
def test_a_refused_worker_backs_off_instead_of_reconnecting_in_a_loop(
    tmp_path: Any, transport: str
) -> None:
    """A worker whose READY the broker refuses (its spec conflicts with a registered
    one) backs off after repeated failures (protocol §10.4), rather than opening a new
    connection and saying READY again about a thousand times a second."""
    from carpool.broker.config import BrokerConfig
    from carpool.broker.server import BrokerServer
    from carpool.client import Client
    from tests.conftest import wait_for_workers

    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        local_backend=f"unix:{tmp_path}/w.sock",
    )
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(ServerThread(BrokerServer(config)))
        endpoint = broker.local_endpoint if transport == "local" else broker.backend_endpoint
        first = SyntheticEngine(item_shape=(4,))
        stack.enter_context(ServerThread(WorkerServer(endpoint, {"m": lambda: first})))
        wait_for_workers(stack.enter_context(Client(broker.frontend_endpoint)), 1)
        other = SyntheticEngine(item_shape=(5,))  # model "m" with another shape: refused
        bad = stack.enter_context(WorkerServer(endpoint, {"m": lambda: other}, warmup=False))
        joined = bad.core.epoch
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            bad.step(0.05)
        assert bad.core.epoch - joined <= 6  # (each refusal: two epochs; 1 s, then 2 s)


@pytest.mark.timeout(60)
def test_a_model_upgraded_to_new_shapes_is_served_once_its_old_workers_are_gone(
    fleet_factory: Any,
) -> None:
    """A rolling upgrade that changes a model's shapes: the new worker is refused while a
    worker of the old spec lives, and joins at its next try once that one has left (the
    broker does not keep the first spec until it restarts)."""
    from carpool.client import InvalidArgument
    from tests.conftest import wait_for_workers

    fleet = fleet_factory(max_batch=4, max_wait_s=0.0)
    old = SyntheticEngine(item_shape=(4,))
    new = SyntheticEngine(item_shape=(5,))
    endpoint = fleet.broker.backend_endpoint
    with ServerThread(WorkerServer(endpoint, {"m": lambda: old}, name="old", warmup=False)):
        client = fleet.ready(count=1)
        assert client.infer("m", {"x": np.ones((1, 4), np.float32)})["y"].shape == (1, 4)
        upgraded = fleet.add_worker({"m": lambda: new}, name="new", warmup=False)
        until = time.monotonic() + 10
        while upgraded.core.epoch < 2 and time.monotonic() < until:
            client.poll(0.05)
        assert upgraded.core.epoch >= 2, "the new worker was not refused and retried"
        assert [w["name"] for w in client.stats()["workers"]] == ["old"]
    # The old worker said DISCONNECT; the new one is taken at its next try.
    until = time.monotonic() + 20
    while [w["name"] for w in client.stats()["workers"]] != ["new"]:
        assert time.monotonic() < until, "the new worker never joined"
        client.poll(0.05)
    wait_for_workers(client, 1)
    assert client.infer("m", {"x": np.ones((1, 5), np.float32)})["y"].shape == (1, 5)
    with pytest.raises(InvalidArgument, match=r"does not fit \[\?, 5\]"):
        client.infer("m", {"x": np.ones((1, 4), np.float32)})


class _Stuck(SyntheticEngine):
    """A batch that runs until released (a stuck kernel, a huge model)."""

    thread_bound = True  # on the inference thread, never inline

    def __init__(self) -> None:
        super().__init__(item_shape=(4,))
        self.running = threading.Event()
        self.release = threading.Event()

    def run(self, inputs: Any) -> Any:
        self.running.set()
        self.release.wait(60)
        return super().run(inputs)


@pytest.mark.timeout(60)
def test_close_returns_after_its_wait_while_a_batch_still_runs(fleet_factory: Any) -> None:
    """close() gives a running batch its wait and then returns, without blocking in the
    context's term() until the batch ends: a SIGTERM during a long batch is honoured."""
    fleet = fleet_factory(max_batch=1, max_wait_s=0.0)
    stuck = _Stuck()
    worker = WorkerServer(fleet.broker.backend_endpoint, {"m": lambda: stuck}, warmup=False)
    serving = threading.Thread(target=worker.serve, daemon=True)
    closing = threading.Thread(target=worker.close, kwargs={"wait_s": 0.2}, daemon=True)
    try:
        serving.start()
        client = fleet.ready(1)
        client.submit("m", {"x": np.ones((1, 4), np.float32)}, timeout_s=30)
        assert stuck.running.wait(10)
        worker.stop()  # what SIGTERM does; then the command closes the worker
        serving.join(10)
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "close() waited for the batch"
    finally:
        stuck.release.set()
        closing.join(10)
        worker.close()


@pytest.mark.timeout(30)
def test_a_worker_backing_off_sleeps_until_it_connects_again(context: Any) -> None:
    """While it waits, its core does not count the broker's silence, so it never says
    'due now' on every turn past liveness: the worker sleeps, it does not spin a core."""
    import zmq

    from carpool.common.protocol import Command, encode

    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    engine = SyntheticEngine(item_shape=(4,))
    worker = WorkerServer(
        f"tcp://127.0.0.1:{port}", {"m": lambda: engine}, warmup=False, heartbeat_s=0.1, liveness=2
    )
    try:
        assert router.poll(5000)
        wid = router.recv_multipart()[0]  # READY: refused at once
        router.send_multipart([wid, *encode(Command.DISCONNECT, {"reason": "refused"})])
        until = time.monotonic() + 5
        while worker.core.rejoin_at_s is None and time.monotonic() < until:
            worker.step(0.05)
        assert worker.core.rejoin_at_s is not None, "it did not back off"
        while time.monotonic() < worker.core.last_join_s + 0.3:  # past liveness (0.2 s)
            worker.step(0.05)
        turns = 0
        until = worker.core.rejoin_at_s - 0.05
        while time.monotonic() < until:
            worker.step()  # no timeout of its own: it sleeps until it connects again
            turns += 1
        assert turns < 20
    finally:
        worker.close(wait_s=2)
        router.close()
