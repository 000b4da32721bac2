"""The asyncio client: same results and typed errors as the blocking one."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from carpool.client import AsyncClient, NotFound
from carpool.worker.engines.synthetic import SyntheticEngine


@pytest.mark.timeout(30)
def test_async_client_many_in_flight(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=8, max_wait_s=0.002)
    fleet.add_worker({"m": lambda: SyntheticEngine(item_shape=(3,), max_batch=8)})
    fleet.ready()
    endpoint = fleet.broker.frontend_endpoint

    async def main() -> None:
        async with AsyncClient(endpoint) as client:
            futures = [
                await client.submit("m", {"x": np.full((1, 3), i, np.float32)}) for i in range(200)
            ]
            results = await asyncio.gather(*futures)
            for i, result in enumerate(results):
                np.testing.assert_array_equal(result["y"], np.full((1, 3), 2 * i + 1))
            single = await client.infer("m", {"x": np.ones((2, 3), np.float32)})
            np.testing.assert_array_equal(single["y"], np.full((2, 3), 3.0))
            with pytest.raises(NotFound):
                await client.infer("missing", {"x": np.ones((1, 3), np.float32)})
            stats = await client.stats()
            assert stats["replies"] == 201
            assert max(int(s) for s in stats["batch_sizes"]["m"]) > 1

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_closing_with_requests_in_flight_fails_them_typed(tmp_path: Any) -> None:
    from carpool.client import Unavailable

    async def main() -> None:
        client = AsyncClient(f"ipc://{tmp_path}/nobody")  # no broker: nothing will answer
        future = await client.submit("m", {"x": np.ones((1, 3), np.float32)}, timeout_s=5)
        await client.close()
        with pytest.raises(Unavailable):
            await future

    asyncio.run(main())
