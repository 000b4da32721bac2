"""BATCH ``requests[i].shapes`` (§8.3) and RESULT ``padding`` (§8.4) on the wire: their
round trips, and the forms a receiver refuses."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.common.errors import ProtocolError
from carpool.common.protocol import BatchItem, BatchMeta, ResultMeta, TensorMeta
from carpool.common.protocol import frames as codec

INPUTS = (TensorMeta("x", "float32", (-1, 3, 736, 1280)), TensorMeta("k", "int64", (-1, 2)))


def test_batch_item_shapes_round_trip_and_give_each_request_its_own_tensors() -> None:
    items = (
        BatchItem(1, 2, False, 1.5, shapes=((3, 720, 1280), (2,))),
        BatchItem(2, 1, True, 0.0),
    )
    meta = BatchMeta(9, "det", INPUTS, items)
    wire = codec.unpack(codec.pack(meta.to_wire()))
    assert wire["requests"][0]["shapes"] == [[3, 720, 1280], [2]]
    assert "shapes" not in wire["requests"][1]
    back = BatchMeta.from_wire(wire)
    assert back.items == items
    assert [t.shape for t in back.request_tensors(back.items[0])] == [(2, 3, 720, 1280), (2, 2)]
    assert [t.shape for t in back.request_tensors(back.items[1])] == [(1, 3, 736, 1280), (1, 2)]


def test_result_padding_round_trips_and_is_optional() -> None:
    meta = ResultMeta(4, 0.5, 2.0, (3, 3), (1024, 8192))
    assert ResultMeta.from_wire(codec.unpack(codec.pack(meta.to_wire()))) == meta
    plain = ResultMeta(4, 0.5, 2.0, (3,))
    assert "padding" not in plain.to_wire()
    assert ResultMeta.from_wire(plain.to_wire()).padding is None


@pytest.mark.parametrize("bad", [[1], [1, 2, 3], [5, 4], [-1, 4], [1.0, 4], "no", [True, 4]])
def test_malformed_result_padding_is_refused(bad: Any) -> None:
    wire = {**ResultMeta(4, 0.5, 2.0, (3,)).to_wire(), "padding": bad}
    with pytest.raises(ProtocolError, match="padding"):
        ResultMeta.from_wire(wire)
