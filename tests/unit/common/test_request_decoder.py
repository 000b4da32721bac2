"""RequestDecoder: remembered layouts decode on the fast path, everything else exactly as
the full decoder does."""

from __future__ import annotations

import re
from typing import Any

import pytest

from carpool.common import codec
from carpool.common.errors import ProtocolError
from carpool.common.protocol import (
    KnownRequest,
    Priority,
    RequestDecoder,
    Submit,
    TensorMeta,
    decode_submit,
)

KEY = "0123456789abcdef" * 2


def meta(**changes: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "id": 7,
        "model": "m",
        "timeout_ms": 500,
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2, 4]}],
    }
    m.update(changes)
    out: dict[str, Any] = codec.unpack(codec.pack(m))
    return out


FRAMES = [b"\0" * 32]


def warm() -> RequestDecoder[str]:
    decoder: RequestDecoder[str] = RequestDecoder()
    decoder.remember(decode_submit(meta()), "layout")
    return decoder


def test_an_unknown_layout_is_decoded_in_full() -> None:
    decoder: RequestDecoder[str] = RequestDecoder()
    got = decoder.decode(meta(), FRAMES)
    assert isinstance(got, Submit)
    assert got == decode_submit(meta())


def test_a_remembered_layout_takes_the_fast_path() -> None:
    got = warm().decode(meta(id=9, priority=1, shm_outputs=True), FRAMES)
    assert got == KnownRequest("layout", 9, 500, Priority.BULK, None, True, None)
    nonce = bytes(range(16))
    got = warm().decode(meta(id=9, client=nonce), FRAMES)
    assert got == KnownRequest("layout", 9, 500, Priority.INTERACTIVE, None, False, nonce)


def test_shared_memory_references_are_parsed_on_the_fast_path() -> None:
    ref = {"region": "carpool-1-ab", "offset": 64, "key": KEY}
    inputs = [{"name": "x", "dtype": "float32", "shape": [2, 4], "shm": ref}]
    got = warm().decode(meta(inputs=inputs), [b""])
    assert isinstance(got, KnownRequest)
    assert got.refs == (("carpool-1-ab", 64, KEY),)


@pytest.mark.parametrize(
    ("changes", "frames"),
    [
        ({"id": -1}, FRAMES),
        ({"id": True}, FRAMES),
        ({"timeout_ms": 0}, FRAMES),
        ({"timeout_ms": 1.5}, FRAMES),
        ({"priority": 2}, FRAMES),
        ({"shm_outputs": 1}, FRAMES),
        ({"client": b"\0" * 15}, FRAMES),
        ({"client": "0" * 16}, FRAMES),
        ({}, [b"\0" * 31]),
        ({}, FRAMES * 2),
        ({"inputs": [{"name": "x", "dtype": "float32", "shape": [2, 4], "shm": {}}]}, [b""]),
    ],
)
def test_anything_unusual_gets_the_full_decoders_answer(
    changes: dict[str, Any], frames: list[bytes]
) -> None:
    decoder = warm()
    try:
        expected: Any = decode_submit(meta(**changes))
    except ProtocolError as exc:
        with pytest.raises(ProtocolError, match=re.escape(str(exc))):
            decoder.decode(meta(**changes), frames)
    else:  # a valid meta with the wrong frames: the caller's frame checks answer it
        got = decoder.decode(meta(**changes), frames)
        assert isinstance(got, Submit)
        assert got == expected


def test_forget_model_and_the_bound_on_layouts() -> None:
    decoder = warm()
    decoder.forget_model("other")
    assert isinstance(decoder.decode(meta(), FRAMES), KnownRequest)
    decoder.forget_model("m")
    assert isinstance(decoder.decode(meta(), FRAMES), Submit)
    small: RequestDecoder[int] = RequestDecoder(max_layouts=2)
    for n in range(1, 4):
        inputs = (TensorMeta("x", "float32", (n, 4)),)
        small.remember(Submit(1, "m", None, inputs), n)
    assert len(small.layouts) == 1  # dropped all at once when full, then the newest
