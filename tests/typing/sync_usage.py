"""The blocking client as its users write it: every line checks under mypy --strict, and
each ``type: ignore[...]`` marks a call that must stay an error (an unused one fails)."""

from __future__ import annotations

from typing import Any, assert_type

import numpy as np
import zmq
from numpy.typing import NDArray

from carpool.client import (
    CarpoolError,
    Client,
    ClientOptionArgs,
    ClientOptions,
    DeadlineExceeded,
    InferResult,
    ModelMetadata,
    Overloaded,
    Priority,
    ReplyFuture,
    RequestError,
    Unavailable,
)


def infer_and_submit(image: NDArray[np.float32], images: list[NDArray[np.float32]]) -> None:
    with Client("tcp://127.0.0.1:5555", default_timeout_s=2.0, grace_s=0.5) as client:
        assert_type(client, Client)
        outputs = client.infer("orientation", {"x": image}, timeout_s=0.5)
        assert_type(outputs, dict[str, NDArray[Any]])
        futures = [client.submit("orientation", {"x": im}, 0.5) for im in images]
        assert_type(futures, list[ReplyFuture])
        result = futures[0].result(timeout_s=1.0)
        assert_type(result, InferResult)
        assert_type(result["y"], NDArray[Any])
        assert_type(result.batch_size, int)
        assert_type(result.queue_ms + result.compute_ms, float)
        assert_type(futures[1].outputs(), dict[str, NDArray[Any]])
        assert_type(futures[1].done(), bool)
        assert_type(client.poll(0.1), int)
        bulk = client.submit("orientation", {"x": [[1.0, 2.0]]}, priority=Priority.BULK)
        assert_type(bulk.request_id, int)
        assert_type(client.stats(timeout_s=1.0), dict[str, Any])
        model = client.model("orientation", timeout_s=1.0)
        assert_type(model, ModelMetadata)
        assert_type(model.workers, tuple[str, ...])
        assert_type(client.models(), tuple[ModelMetadata, ...])
        assert_type(client.in_flight, int)
        assert_type(futures[2].cancel(), bool)
        assert_type(client.cancel(futures[3]), bool)


def options(context: zmq.Context[zmq.Socket[bytes]]) -> Client:
    return Client(
        "ipc:///tmp/carpool-frontend",
        context=context,
        shared_memory=64 << 20,
        shared_memory_min_bytes=1 << 16,
        shared_memory_mode=0o640,
        shared_memory_outputs=True,
        shared_memory_group="carpool",
        send_timeout_s=None,
    )


def shared_options() -> Client:
    options: ClientOptionArgs = {"default_timeout_s": 0.5, "send_timeout_s": 0.0}
    client = Client("tcp://127.0.0.1:5555", **options)
    assert_type(client.options, ClientOptions)
    assert_type(client.options.grace_s, float)
    return client


def errors(client: Client, image: NDArray[np.float32]) -> float | None:
    try:
        client.infer("orientation", {"x": image})
    except Overloaded as exc:
        assert_type(exc.retry_after_s, float | None)
        assert_type(exc.request_id, int | None)
        return exc.retry_after_s
    except (DeadlineExceeded, Unavailable):
        return None
    except RequestError as exc:
        assert_type(exc.code.name, str)
        raise
    except CarpoolError:
        raise
    return 0.0


def rejected(client: Client, image: NDArray[np.float32]) -> None:
    client.infer("orientation", image)  # type: ignore[arg-type]
    client.submit("orientation", {"x": image}, priority=1)  # type: ignore[arg-type]
    client.submit("orientation", {"x": image}, 0.5, Priority.BULK)  # type: ignore[call-arg]
    Client("tcp://127.0.0.1:5555", grace_s="1")  # type: ignore[arg-type]
    Client("tcp://127.0.0.1:5555", grace=1.0)  # type: ignore[call-arg]
    Client("tcp://127.0.0.1:5555", **ClientOptionArgs(grace_s=None))  # type: ignore[typeddict-item]
    client.options.grace_s = 2.0  # type: ignore[misc]
