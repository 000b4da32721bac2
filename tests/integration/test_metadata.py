"""METADATA over real sockets: a raw DEALER learns a model's inputs, outputs, limits and
workers from the broker with no SDK, and the SDK's ``model()`` and ``models()`` do."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.client import AsyncClient, NotFound
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Command,
    ErrorReply,
    MetadataRequest,
    decode_meta,
    parse_header,
    parse_metadata_reply,
)
from carpool.common.shape_rules import ShapeRule
from carpool.worker.engines.synthetic import SyntheticEngine


def _ask(socket: zmq.Socket[bytes], frames: list[Any]) -> tuple[Command, dict[str, Any]]:
    socket.send_multipart(frames)
    assert socket.poll(10_000), "the broker did not answer METADATA"
    header, meta = socket.recv_multipart()
    return parse_header(header), decode_meta(meta)


@pytest.mark.timeout(60)
def test_a_raw_client_learns_what_it_must_send(
    fleet_factory: Any, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    fleet = fleet_factory()
    rule = ShapeRule(max_shape=(-1, 64))
    engine = SyntheticEngine(item_shape=(-1,), max_batch=8, shape_rules={"x": rule})
    fleet.add_worker({"echo": lambda: engine}, name="edge-7", warmup=False)
    fleet.ready()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(fleet.broker.frontend_endpoint)

    command, meta = _ask(socket, MetadataRequest(5, "echo").to_frames())
    assert command is Command.METADATA
    rid, (model,) = parse_metadata_reply(meta)
    assert rid == 5
    assert [(t.name, t.dtype, t.shape) for t in model.spec.inputs] == [("x", "float32", (-1, -1))]
    assert model.spec.rules == (rule,)
    assert model.spec.max_batch == 8
    assert model.workers == ("edge-7",)
    # The raw map, as a client in another language reads it.
    assert meta["models"][0]["inputs"][0]["max_shape"] == [-1, 64]

    command, meta = _ask(socket, MetadataRequest(6).to_frames()[:1])  # no meta: every model
    assert command is Command.METADATA
    assert [m["name"] for m in meta["models"]] == ["echo"]

    command, meta = _ask(socket, MetadataRequest(7, "nosuch").to_frames())
    assert command is Command.ERROR
    error = ErrorReply.from_wire(meta)
    assert (error.request_id, error.code) == (7, ErrorCode.NOT_FOUND)
    socket.close(linger=0)


@pytest.mark.timeout(60)
def test_the_sdk_describes_a_model_and_lists_every_model(fleet_factory: Any) -> None:
    fleet = fleet_factory()
    rule = ShapeRule(max_shape=(-1, 64))
    for name in ("edge-1", "edge-2"):
        engine = SyntheticEngine(item_shape=(-1,), max_batch=4, shape_rules={"x": rule})
        fleet.add_worker({"echo": lambda e=engine: e}, name=name, warmup=False)
    other = SyntheticEngine(item_shape=(3,), max_batch=2)
    fleet.add_worker({"other": lambda: other}, name="edge-3", warmup=False)
    client = fleet.ready()

    model = client.model("echo")
    assert model.spec.name == "echo"
    assert [(t.name, t.dtype, t.shape) for t in model.spec.inputs] == [("x", "float32", (-1, -1))]
    assert model.spec.rules == (rule,)
    assert model.spec.max_batch == 4
    assert model.workers == ("edge-1", "edge-2")
    assert [m.spec.name for m in client.models()] == ["echo", "other"]
    assert client.models()[1].workers == ("edge-3",)
    with pytest.raises(NotFound, match="nosuch"):
        client.model("nosuch")
    # The client goes on serving requests between its questions.
    x = np.ones((2, 5), np.float32)
    assert client.infer("echo", {"x": x}, timeout_s=5)["y"].shape == (2, 5)


@pytest.mark.timeout(60)
def test_the_async_sdk_answers_overlapping_questions_each_its_own(fleet_factory: Any) -> None:
    fleet = fleet_factory()
    fleet.add_worker({"echo": lambda: SyntheticEngine(max_batch=4)}, name="a", warmup=False)
    fleet.add_worker({"other": lambda: SyntheticEngine(max_batch=2)}, name="b", warmup=False)
    fleet.ready()

    async def ask() -> tuple[Any, ...]:
        async with AsyncClient(fleet.broker.frontend_endpoint) as client:
            got = await asyncio.gather(
                client.model("echo"),
                client.model("other"),
                client.models(),
                client.stats(),
                client.model("nosuch"),
                return_exceptions=True,
            )
            return tuple(got)

    echo, other, every, stats, missing = asyncio.run(ask())
    assert (echo.spec.name, echo.workers, echo.spec.max_batch) == ("echo", ("a",), 4)
    assert (other.spec.name, other.workers, other.spec.max_batch) == ("other", ("b",), 2)
    assert [m.spec.name for m in every] == ["echo", "other"]
    assert "batch_sizes" in stats  # the STATS answer, not a METADATA one
    assert isinstance(missing, NotFound)
