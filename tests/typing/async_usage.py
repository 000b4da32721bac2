"""The asyncio client as its users write it: every line checks under mypy --strict, and
each ``type: ignore[...]`` marks a call that must stay an error (an unused one fails)."""

from __future__ import annotations

import asyncio
from typing import Any, assert_type

import numpy as np
import zmq.asyncio
from numpy.typing import NDArray

from carpool.client import (
    AsyncClient,
    Cancelled,
    InferResult,
    ModelMetadata,
    NotFound,
    Priority,
    Unavailable,
)


async def infer_and_submit(image: NDArray[np.float32], images: list[NDArray[np.float32]]) -> None:
    async with AsyncClient("tcp://127.0.0.1:5555", send_timeout_s=0.0) as client:
        assert_type(client, AsyncClient)
        outputs = await client.infer("orientation", {"x": image}, timeout_s=0.5)
        assert_type(outputs, dict[str, NDArray[Any]])
        futures = [await client.submit("orientation", {"x": im}, 0.5) for im in images]
        assert_type(futures, list[asyncio.Future[InferResult]])
        results = await asyncio.gather(*futures)
        assert_type(results, list[InferResult])
        assert_type(results[0]["y"], NDArray[Any])
        bulk = await client.submit("orientation", {"x": image}, priority=Priority.BULK)
        assert_type(await bulk, InferResult)
        assert_type(await client.stats(1.0), dict[str, Any])
        assert_type(await client.model("orientation"), ModelMetadata)
        assert_type(await client.models(1.0), tuple[ModelMetadata, ...])
        assert_type(client.in_flight, int)
        assert_type(client.cancel(bulk), bool)
        assert_type(bulk.cancel(), bool)


async def with_context(context: zmq.asyncio.Context, image: NDArray[np.float32]) -> None:
    client = AsyncClient("tcp://127.0.0.1:5555", context=context, default_timeout_s=1.0)
    try:
        await client.infer("orientation", {"x": image})
    except NotFound as exc:
        assert_type(exc.request_id, int | None)
    except (Unavailable, Cancelled):
        pass
    finally:
        await client.close()


async def rejected(client: AsyncClient, image: NDArray[np.float32]) -> None:
    await client.infer("orientation", image)  # type: ignore[arg-type]
    await client.infer("orientation", {"x": image}, "0.5")  # type: ignore[arg-type]
    client.infer("orientation", {"x": image})  # type: ignore[unused-coroutine]
    AsyncClient("tcp://127.0.0.1:5555", shared_memory="64M")  # type: ignore[arg-type]
    AsyncClient("tcp://127.0.0.1:5555", context=zmq.Context())  # type: ignore[arg-type]
