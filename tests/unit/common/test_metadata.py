"""metadata.py: METADATA requests and answers on the wire."""

from __future__ import annotations

import pytest

from carpool.common.errors import ProtocolError
from carpool.common.padding import CropAxis, PadRule
from carpool.common.protocol import (
    Command,
    MetadataRequest,
    ModelMetadata,
    ModelSpec,
    TensorMeta,
    decode_meta,
    header,
    metadata_reply_frames,
    parse_header,
    parse_metadata_reply,
)
from carpool.common.protocol import frames as codec

DETECTOR = ModelSpec(
    "det",
    (TensorMeta("x", "float32", (-1, 3, -1, -1)),),
    (TensorMeta("map", "float32", (-1, 1, -1, -1)),),
    8,
    (4, 8),
    pads=(PadRule(multiple_of=(1, 32, 32)),),
    crops=((CropAxis(2, "x", 2), CropAxis(3, "x", 3)),),
)


def test_a_request_for_one_model_or_all_round_trips() -> None:
    for request in (MetadataRequest(7, "det"), MetadataRequest(), MetadataRequest(3)):
        frames = request.to_frames()
        assert parse_header(frames[0]) is Command.METADATA
        assert frames[0] == header(Command.METADATA) == b"CP\x01\x06"
        assert MetadataRequest.from_wire(decode_meta(frames[1])) == request


def test_a_bad_model_name_is_refused() -> None:
    with pytest.raises(ProtocolError, match="metadata model"):
        MetadataRequest.from_wire({"id": 1, "model": ""})


def test_the_answer_names_workers_and_round_trips_the_spec() -> None:
    models = (ModelMetadata(DETECTOR, ("edge-1", "edge-2")),)
    frames = metadata_reply_frames(9, models)
    meta = decode_meta(frames[1])
    assert meta["models"][0]["workers"] == ["edge-1", "edge-2"]
    assert meta["models"][0]["inputs"][0]["shape"] == [-1, 3, -1, -1]
    assert parse_metadata_reply(meta) == (9, models)


@pytest.mark.parametrize(
    "meta",
    [
        {"id": 1},
        {"id": 1, "models": {}},
        {"id": 1, "models": [{"name": "m"}]},
        {"id": 1, "models": [{**DETECTOR.to_wire(), "workers": "edge-1"}]},
    ],
)
def test_a_malformed_answer_is_a_protocol_error(meta: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        parse_metadata_reply(codec.unpack(codec.pack(meta)))
