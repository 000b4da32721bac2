"""A detector that finds nothing answers with an empty array (``[n, 0, 6]``), over each
way a worker reaches the broker: ZeroMQ, the local unix endpoint, and embedded in the
broker's process (docs/protocol.md §5.1)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.server import BrokerServer
from carpool.client import AsyncClient, Client
from carpool.common.protocol import TensorMeta
from carpool.common.testing import ServerThread
from carpool.worker.engines.base import Array, EngineInfo, engine_io
from carpool.worker.server import WorkerServer
from tests.conftest import wait_for_workers

pytestmark = pytest.mark.timeout(60)


class Detector:
    """Boxes ``[n, k, 6]`` and scores ``[n, k]`` for the ``k`` objects found in the batch:
    ``k`` is the first element of the batch's first input row (0: nothing found)."""

    thread_bound = True

    def __init__(self) -> None:
        inputs = (TensorMeta("x", "float32", (-1, 4)),)
        outputs = (
            TensorMeta("boxes", "float32", (-1, -1, 6)),
            TensorMeta("scores", "float32", (-1, -1)),
        )
        self.info = EngineInfo(engine_io(inputs, outputs, 8))

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        x = inputs["x"]
        k = int(x[0, 0])
        boxes = np.repeat(x[:, None, :1], k, axis=1).repeat(6, axis=2)
        return {"boxes": boxes, "scores": np.full((len(x), k), 0.5, np.float32)}

    def close(self) -> None:
        pass


def _frame(k: int, rows: int = 1) -> np.ndarray:
    return np.full((rows, 4), k, np.float32)


@pytest.fixture
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A broker whose one ``Detector`` worker reaches it as the parameter says; yields
    the frontend endpoint."""
    how = request.param
    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        local_backend=f"unix:{tmp_path}/w.sock" if how == "local" else "",
        batching=BatchingConfig(max_batch=8, max_wait_s=0.02),
    )
    with contextlib.ExitStack() as stack:
        if how == "embedded":
            worker = stack.enter_context(
                WorkerServer("embedded", {"det": Detector}, embedded=True, warmup=False)
            )
            broker = stack.enter_context(ServerThread(BrokerServer(config, embedded=[worker])))
        else:
            broker = stack.enter_context(ServerThread(BrokerServer(config)))
            endpoint = broker.local_endpoint if how == "local" else broker.backend_endpoint
            assert endpoint is not None
            worker = WorkerServer(endpoint, {"det": Detector}, warmup=False)
            stack.enter_context(ServerThread(worker))
        yield broker.frontend_endpoint


@pytest.mark.parametrize("fleet", ["zeromq", "local", "embedded"], indirect=True)
def test_a_detector_that_finds_nothing_answers_with_empty_arrays(fleet: str) -> None:
    with Client(fleet) as client:
        wait_for_workers(client, 1)
        # One request alone, then a batch of several (each reply a slice of the batch's).
        got = client.infer("det", {"x": _frame(0)}, timeout_s=20)
        assert got["boxes"].shape == (1, 0, 6)
        assert got["boxes"].dtype == np.float32
        assert got["scores"].shape == (1, 0)
        futures = [client.submit("det", {"x": _frame(0, rows=1 + i % 2)}) for i in range(12)]
        for i, future in enumerate(futures):
            outputs = future.outputs(timeout_s=20)
            assert outputs["boxes"].shape == (1 + i % 2, 0, 6)
            assert outputs["scores"].shape == (1 + i % 2, 0)
        # The same fleet still answers non-empty detections, before and after.
        found = client.infer("det", {"x": _frame(3)}, timeout_s=20)
        np.testing.assert_array_equal(found["boxes"], np.full((1, 3, 6), 3, np.float32))
        stats = client.stats()
        assert stats["replies"] == 14
        assert sum(stats["errors"].values()) == 0


@pytest.mark.parametrize("fleet", ["zeromq"], indirect=True)
def test_the_asyncio_client_reads_empty_arrays_too(fleet: str) -> None:
    with Client(fleet) as client:
        wait_for_workers(client, 1)

    async def main() -> Any:
        async with AsyncClient(fleet) as client:
            return await client.infer("det", {"x": _frame(0)}, timeout_s=20)

    assert asyncio.run(main())["boxes"].shape == (1, 0, 6)


@pytest.mark.parametrize("fleet", ["local"], indirect=True)
def test_empty_and_shared_memory_outputs_in_one_reply(fleet: str) -> None:
    """A client that asks for outputs in shared memory (§5.5): an empty output stays in
    its (empty) frame, a large one goes through the worker's ring, in the same fleet."""
    with Client(fleet, shared_memory_outputs=True) as client:
        wait_for_workers(client, 1)
        assert client.infer("det", {"x": _frame(0)}, timeout_s=20)["boxes"].shape == (1, 0, 6)
        k = 4096  # boxes: 4096 x 6 x 4 bytes = 96 KiB, past SHM_OUTPUT_MIN_BYTES
        big = client.infer("det", {"x": _frame(k)}, timeout_s=20)
        np.testing.assert_array_equal(big["boxes"], np.full((1, k, 6), k, np.float32))
        assert client.infer("det", {"x": _frame(0)}, timeout_s=20)["scores"].shape == (1, 0)
