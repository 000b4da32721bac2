"""METADATA over real sockets: a raw DEALER learns a model's inputs, outputs, limits and
workers from the broker, with no SDK."""

from __future__ import annotations

from typing import Any

import pytest
import zmq

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
