"""A worker embedded in the broker's process (BrokerServer(embedded=[WorkerServer(...,
embedded=True)])): real client sockets, no sockets between broker and worker."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from carpool.broker.server import BrokerServer
from carpool.client import Client, InvalidArgument
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.server import WorkerServer
from tests.conftest import loopback_config, wait_for_workers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def embedded_fleet() -> Iterator[Callable[..., tuple[BrokerServer, list[WorkerServer]]]]:
    with contextlib.ExitStack() as stack:

        def make(
            *engines: dict[str, Callable[[], Any]], **worker_kw: Any
        ) -> tuple[BrokerServer, list[WorkerServer]]:
            workers = [
                stack.enter_context(
                    WorkerServer("embedded", models, name=f"e{i}", embedded=True, **worker_kw)
                )
                for i, models in enumerate(engines)
            ]
            config = loopback_config(max_batch=8, max_wait_s=0.002)
            broker = stack.enter_context(ServerThread(BrokerServer(config, embedded=workers)))
            return broker, workers

        yield make


def test_requests_are_answered_by_the_embedded_engine(embedded_fleet: Any) -> None:
    broker, _ = embedded_fleet({"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=8)})
    with Client(broker.frontend_endpoint) as client:
        wait_for_workers(client, 1)
        xs = [np.full((1 + i % 3, 4), i, np.float32) for i in range(60)]
        futures = [client.submit("syn", {"x": x}) for x in xs]
        for f, x in zip(futures, xs, strict=True):
            np.testing.assert_array_equal(f.outputs(10)["y"], synthetic_output(x))
        stats = client.stats()
        assert [w["name"] for w in stats["workers"]] == ["e0"]
        assert sum(stats["batch_sizes"]["syn"].values()) < 60  # batches formed
        with pytest.raises(InvalidArgument):  # checked by the broker as for any worker
            client.infer("syn", {"x": np.zeros((1, 5), np.float32)})


def test_slow_batches_run_on_the_inference_thread(embedded_fleet: Any) -> None:
    """A 5 ms engine is not run on the broker's thread: finished batches come back through
    the results socket the broker polls, and the broker keeps serving meanwhile."""
    engine = {"slow": lambda: SyntheticEngine(item_shape=(4,), fixed_cost_s=0.005, max_batch=8)}
    broker, (worker,) = embedded_fleet(engine)
    with Client(broker.frontend_endpoint) as client:
        wait_for_workers(client, 1)
        for _ in range(3):  # teach the worker that its batches are long
            client.infer("slow", {"x": np.ones((1, 4), np.float32)}, timeout_s=5)
        assert not worker._runs_inline(_job(worker, "slow"))
        xs = [np.full((1, 4), i, np.float32) for i in range(40)]
        futures = [client.submit("slow", {"x": x}) for x in xs]
        for f, x in zip(futures, xs, strict=True):
            np.testing.assert_array_equal(f.outputs(10)["y"], synthetic_output(x))
        assert max(int(k) for k in client.stats()["batch_sizes"]["slow"]) > 1


def _job(worker: WorkerServer, model: str) -> Any:
    from carpool.common.protocol import BatchItem, BatchMeta, TensorMeta
    from carpool.worker.core import RunBatch

    meta = BatchMeta(1, model, (TensorMeta("x", "float32", (-1, 4)),), (BatchItem(1, 1, False, 0),))
    return RunBatch(worker.core.epoch, meta, [b""])


def test_heartbeats_keep_the_embedded_worker_registered(embedded_fleet: Any) -> None:
    broker, _ = embedded_fleet(
        {"syn": lambda: SyntheticEngine(item_shape=(4,))}, heartbeat_s=0.05, liveness=3
    )
    with Client(broker.frontend_endpoint) as client:
        wait_for_workers(client, 1)
        client.poll(0.6)  # twelve heartbeat intervals with no traffic
        assert [w["name"] for w in client.stats()["workers"]] == ["e0"]
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(client.infer("syn", {"x": x})["y"], synthetic_output(x))


def test_an_embedded_and_a_remote_worker_share_the_work(embedded_fleet: Any) -> None:
    broker, _ = embedded_fleet({"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=8)})
    with contextlib.ExitStack() as stack:
        remote = WorkerServer(
            broker.backend_endpoint,
            {"syn": lambda: SyntheticEngine(item_shape=(4,), fixed_cost_s=0.002, max_batch=8)},
            name="remote",
        )
        stack.enter_context(ServerThread(remote))
        with Client(broker.frontend_endpoint) as client:
            wait_for_workers(client, 2)
            assert sorted(w["name"] for w in client.stats()["workers"]) == ["e0", "remote"]
            xs = [np.full((1, 4), i, np.float32) for i in range(200)]
            futures = [client.submit("syn", {"x": x}) for x in xs]
            for f, x in zip(futures, xs, strict=True):
                np.testing.assert_array_equal(f.outputs(10)["y"], synthetic_output(x))
        assert remote.core.batches_done > 0


def test_a_refused_embedded_worker_asks_again_slowly(embedded_fleet: Any) -> None:
    """Two embedded workers whose specs for one model differ: the second is refused
    (DISCONNECT) and registers again at most once a second, not in a loop; the broker
    keeps serving with the first."""
    broker, (_, second) = embedded_fleet(
        {"m": lambda: SyntheticEngine(item_shape=(4,))},
        {"m": lambda: SyntheticEngine(item_shape=(5,))},
    )
    with Client(broker.frontend_endpoint) as client:
        wait_for_workers(client, 1)
        epoch = second.core.epoch
        client.poll(1.2)
        assert 1 <= second.core.epoch - epoch <= 2  # about one READY a second
        assert [w["name"] for w in client.stats()["workers"]] == ["e0"]
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(client.infer("m", {"x": x})["y"], synthetic_output(x))
