"""decode_from_broker: every message a broker may send a worker, as one typed union."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.common.protocol import (
    HEARTBEAT_TO_WORKER,
    BatchInputCache,
    BatchItem,
    BatchMeta,
    BrokerBatch,
    BrokerDisconnect,
    BrokerHeartbeat,
    BrokerMalformed,
    Command,
    TensorMeta,
    decode_from_broker,
    encode,
    header,
)
from carpool.common.protocol import frames as codec

BATCH = BatchMeta(
    7,
    "m",
    (TensorMeta("x", "float32", (-1, 4)),),
    (BatchItem(1, 1, False, 0.5), BatchItem(2, 2, True, 1.25)),
)


@pytest.mark.parametrize(
    "msg",
    [
        BrokerBatch(BATCH, [bytes(16), bytes(32)]),
        HEARTBEAT_TO_WORKER,
        BrokerDisconnect("unknown worker"),
        BrokerDisconnect(),
    ],
)
def test_each_message_decodes_back_from_its_frames(
    msg: BrokerBatch | BrokerHeartbeat | BrokerDisconnect,
) -> None:
    assert decode_from_broker(msg.to_frames()) == msg
    assert msg.to_message() is msg


def test_a_batchs_payloads_are_the_frames_that_arrived() -> None:
    payloads = [bytes(16), bytearray(32)]
    msg = decode_from_broker(encode(Command.BATCH, BATCH.to_wire(), payloads))
    assert isinstance(msg, BrokerBatch)
    assert all(a is b for a, b in zip(msg.payloads, payloads, strict=True))


def test_a_workers_input_cache_decodes_the_same_inputs_to_the_same_tuple() -> None:
    known = BatchInputCache()
    frames = encode(Command.BATCH, BATCH.to_wire())
    first, second = decode_from_broker(frames, known), decode_from_broker(frames, known)
    assert isinstance(first, BrokerBatch)
    assert isinstance(second, BrokerBatch)
    assert first.batch.inputs is second.batch.inputs


def test_a_broken_batch_keeps_its_id_where_it_is_readable() -> None:
    bad = decode_from_broker(encode(Command.BATCH, {**BATCH.to_wire(), "requests": []}))
    assert bad == BrokerMalformed("batch: requests must be a non-empty list", 7)
    no_id = decode_from_broker(encode(Command.BATCH, {"batch": "7", "model": "m"}))
    assert isinstance(no_id, BrokerMalformed)
    assert no_id.batch_id is None


@pytest.mark.parametrize(
    "frames",
    [
        [header(Command.HEARTBEAT)],  # no meta frame
        [b"garbage", codec.pack({})],
        [b"CP\x09" + bytes([int(Command.HEARTBEAT)]), codec.pack({})],  # another version
        [header(Command.HEARTBEAT), b"\xc1"],  # not msgpack
        encode(Command.REQUEST, {"id": 1}),
        encode(Command.READY, {}),
    ],
    ids=["one-frame", "garbage", "version", "bad-meta", "request", "ready"],
)
def test_anything_else_is_malformed_without_a_batch_id(frames: list[Any]) -> None:
    msg = decode_from_broker(frames)
    assert isinstance(msg, BrokerMalformed)
    assert msg.batch_id is None
    assert msg.error
