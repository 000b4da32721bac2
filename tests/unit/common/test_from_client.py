"""decode_from_client: a client's frames as one typed message, never an exception; a
remembered layout decodes with its value, everything else exactly as a fresh decoder."""

from __future__ import annotations

import re
from typing import Any

import pytest

from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import (
    Cancel,
    ClientMalformed,
    Command,
    KnownLayouts,
    MetadataRequest,
    Priority,
    Request,
    StatsQuery,
    Submit,
    TensorMeta,
    decode_from_client,
    decode_request,
    encode_request,
    encode_simple_request,
    header,
)
from carpool.common.protocol import frames as codec

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


def warm() -> KnownLayouts[str]:
    known: KnownLayouts[str] = KnownLayouts()
    known.remember(decode_request(meta(), FRAMES), "layout")
    return known


def fields(r: Request[Any]) -> tuple[Any, ...]:
    return (r.request_id, r.model, r.timeout_ms, r.priority, r.inputs, r.shm, r.shm_outputs)


def test_an_unknown_layout_is_decoded_in_full_with_no_value() -> None:
    got = decode_request(meta(), FRAMES, KnownLayouts[str]())
    assert got.layout is None
    x = TensorMeta("x", "float32", (2, 4))
    assert fields(got) == (7, "m", 500, Priority.INTERACTIVE, (x,), None, False)
    assert got.payloads is FRAMES  # the frames as they arrived


def test_a_remembered_layout_decodes_with_its_value_and_the_same_fields() -> None:
    known = warm()
    got = decode_request(meta(id=9, priority=1, shm_outputs=True), FRAMES, known)
    assert got.layout == "layout"
    fresh = decode_request(meta(id=9, priority=1, shm_outputs=True), FRAMES)
    assert fields(got) == fields(fresh)
    nonce = bytes(range(16))
    got = decode_request(meta(id=9, client=nonce), FRAMES, known)
    assert (got.layout, got.nonce, got.priority) == ("layout", nonce, Priority.INTERACTIVE)


def test_shared_memory_references_are_read_for_a_remembered_layout() -> None:
    ref = {"region": "carpool-1-ab", "offset": 64, "key": KEY}
    inputs = [{"name": "x", "dtype": "float32", "shape": [2, 4], "shm": ref}]
    got = decode_request(meta(inputs=inputs), [b""], warm())
    assert got.layout == "layout"
    assert got.shm == (("carpool-1-ab", 64, KEY),)


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
def test_anything_unusual_gets_a_fresh_decoders_answer(
    changes: dict[str, Any], frames: list[bytes]
) -> None:
    try:
        expected = decode_request(meta(**changes), frames)
    except ProtocolError as exc:
        with pytest.raises(ProtocolError, match=re.escape(str(exc))):
            decode_request(meta(**changes), frames, warm())
    else:  # a valid meta with other frames: the broker's checks against the model answer
        got = decode_request(meta(**changes), frames, warm())
        assert got.layout is None
        assert fields(got) == fields(expected)


def test_forget_model_and_the_bound_on_layouts() -> None:
    known = warm()
    known.forget_model("other")
    assert decode_request(meta(), FRAMES, known).layout == "layout"
    known.forget_model("m")
    assert decode_request(meta(), FRAMES, known).layout is None
    small: KnownLayouts[int] = KnownLayouts(max_layouts=2)
    for n in range(1, 4):
        inputs = [{"name": "x", "dtype": "float32", "shape": [n, 4]}]
        small.remember(decode_request(meta(inputs=inputs)), n)
    assert len(small.layouts) == 1  # dropped all at once when full, then the newest


SUBMIT = Submit(5, "m", 100, (TensorMeta("x", "uint8", (1, 2)),))


def test_each_message_decodes_to_its_type() -> None:
    request = decode_from_client(encode_request(SUBMIT, [b"ab"]))
    assert isinstance(request, Request)
    assert (request.request_id, request.delimited, request.simple) == (5, False, False)
    simple = decode_from_client([encode_simple_request(SUBMIT, [b"ab"])])
    assert isinstance(simple, Request)
    assert (simple.simple, list(simple.payloads)) == (True, [b"ab"])
    cancel = Cancel(5, b"n" * 16)
    assert decode_from_client(cancel.to_frames()) == cancel
    assert decode_from_client(StatsQuery(3).to_frames()) == StatsQuery(3)
    assert decode_from_client([header(Command.STATS)]) == StatsQuery(None)
    assert decode_from_client(MetadataRequest(4, "m").to_frames()) == MetadataRequest(4, "m")
    assert decode_from_client([header(Command.METADATA)]) == MetadataRequest()


def test_a_req_sockets_delimiter_is_read_and_kept_for_the_answer() -> None:
    request = decode_from_client([b"", *encode_request(SUBMIT, [b"ab"])])
    assert isinstance(request, Request)
    assert request.delimited
    assert decode_from_client([b"", *StatsQuery(3).to_frames()]) == StatsQuery(3, True)
    query = MetadataRequest(4, delimited=True)
    assert decode_from_client([b"", *MetadataRequest(4).to_frames()]) == query


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        ([], (None, ErrorCode.INVALID_ARGUMENT, "empty message")),
        ([b"XX\x01\x01", b"\x80"], (None, ErrorCode.INVALID_ARGUMENT, "not a carpool header")),
        ([b"CP\x02\x01", b"\x80"], (None, ErrorCode.UNSUPPORTED_VERSION, "version 2")),
        ([header(Command.REQUEST)], (None, ErrorCode.INVALID_ARGUMENT, "needs a meta frame")),
        ([header(Command.REQUEST), b"\xc1"], (None, ErrorCode.INVALID_ARGUMENT, "")),
        (
            [header(Command.REQUEST), codec.pack({"id": 3, "model": ""})],
            (3, ErrorCode.INVALID_ARGUMENT, "model"),
        ),
        ([header(Command.CANCEL)], (None, ErrorCode.INVALID_ARGUMENT, "header and a meta")),
        (
            [header(Command.CANCEL), codec.pack({"id": 3})],
            (3, ErrorCode.INVALID_ARGUMENT, "'client'"),
        ),
        ([header(Command.REPLY), b"\x80"], (None, ErrorCode.INVALID_ARGUMENT, "REPLY is not")),
        (
            [header(Command.METADATA), codec.pack({"id": 3, "model": 5})],
            (None, ErrorCode.INVALID_ARGUMENT, "metadata model"),
        ),
        ([header(Command.STATS), b"\xc1"], (None, ErrorCode.INVALID_ARGUMENT, "")),
    ],
)
def test_a_message_that_breaks_the_protocol_is_malformed_never_raised(
    frames: list[bytes], expected: tuple[int | None, ErrorCode, str]
) -> None:
    got = decode_from_client(frames)
    assert isinstance(got, ClientMalformed)
    assert (got.request_id, got.code, got.simple) == (*expected[:2], False)
    assert expected[2] in got.message


def test_a_malformed_simple_request_says_so_and_keeps_its_id() -> None:
    frame = codec.pack({"v": 1, "id": 8, "model": "m", "inputs": []})
    got = decode_from_client([b"", frame])
    assert isinstance(got, ClientMalformed)
    assert (got.request_id, got.code, got.delimited, got.simple) == (
        8,
        ErrorCode.INVALID_ARGUMENT,
        True,
        True,
    )
    old = decode_from_client([codec.pack({"v": 2, "id": 8})])
    assert isinstance(old, ClientMalformed)
    assert (old.code, old.version) == (ErrorCode.UNSUPPORTED_VERSION, None)


def request_frames(**changes: Any) -> list[Any]:
    return [header(Command.REQUEST), codec.pack(meta(**changes)), *FRAMES]


def test_a_remembered_layout_decodes_from_frames_with_its_value() -> None:
    known = warm()
    got = decode_from_client(request_frames(id=11), known)
    assert isinstance(got, Request)
    assert (got.layout, got.request_id, got.nbytes) == ("layout", 11, 32)
    assert fields(got) == fields(decode_request(meta(id=11), FRAMES))
    ref = {"region": "carpool-1-ab", "offset": 64, "key": KEY}
    inputs = [{"name": "x", "dtype": "float32", "shape": [2, 4], "shm": ref}]
    frames = [header(Command.REQUEST), codec.pack(meta(inputs=inputs)), b""]
    got = decode_from_client(frames, known)
    assert isinstance(got, Request)
    assert (got.layout, got.shm, got.nbytes) == ("layout", (("carpool-1-ab", 64, KEY),), 0)


@pytest.mark.parametrize(
    "inputs",
    [
        [{"name": "x", "dtype": "float32", "shape": [2, 4.0]}],  # equal to 4, a float
        [{"name": "x", "dtype": "float32", "shape": [True, 4]}],  # (with [1, 4] remembered)
        [{"name": "x", "dtype": "float32", "shape": [2, 4], "shm": "r"}],
        [{"name": "x", "dtype": "float32", "shape": [2, [4]]}],
        [{"name": "x", "dtype": "float32"}],
        ["x"],
        "x",
        {"name": "x", "dtype": "float32", "shape": [2, 4]},
        None,
        [],
    ],
)
def test_framed_inputs_off_a_remembered_layout_get_a_fresh_decoders_answer(inputs: Any) -> None:
    known = warm()
    known.remember(
        decode_request(
            meta(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4]}]), [b"\0" * 16]
        ),
        "one",
    )
    fresh = decode_from_client(request_frames(inputs=inputs))
    got = decode_from_client(request_frames(inputs=inputs), known)
    assert isinstance(fresh, ClientMalformed)
    assert got == fresh


def test_frames_of_other_lengths_than_a_remembered_layouts_have_no_value() -> None:
    known = warm()
    for payloads in ([b"\0" * 31], [b"\0" * 32] * 2, []):
        frames = [header(Command.REQUEST), codec.pack(meta()), *payloads]
        got = decode_from_client(frames, known)
        assert isinstance(got, Request)
        assert (got.layout, got.nbytes) == (None, sum(map(len, payloads)))


@pytest.mark.parametrize(
    ("tensor", "shown"),
    [
        ({"name": "x", "dtype": [2, 3], "shape": [2, 3]}, "unsupported dtype [2, 3]"),
        ({"name": "x", "dtype": "float32", "shape": [2, []]}, "bad dimension [] in shape [2, []]"),
        (
            {"name": "x", "dtype": "float32", "shape": [2, 4], "shm": {"region": ["carpool-r"]}},
            "got ['carpool-r']",
        ),
        (
            {
                "name": "x",
                "dtype": "float32",
                "shape": [2, 4],
                "shm": {"region": "carpool-1-ab", "offset": [4096], "key": KEY},
            },
            "got [4096]",
        ),
    ],
)
def test_an_error_shows_the_arrays_a_client_sent_as_it_sent_them(
    tensor: dict[str, Any], shown: str
) -> None:
    """A REQUEST's meta decodes its arrays as tuples; a refusal that quotes one shows it
    as the list the client wrote, as the simple form's (decoded with lists) does."""
    for known in (None, warm()):
        got = decode_from_client(
            request_frames(inputs=[tensor]), *(() if known is None else (known,))
        )
        assert isinstance(got, ClientMalformed)
        assert shown in got.message


def test_an_array_nested_a_thousand_deep_is_refused_not_raised() -> None:
    """msgpack lets a peer nest arrays about a thousand deep; the refusal that quotes one
    shows its first levels, and the decoder still never raises."""
    deep: Any = 1
    for _ in range(1000):
        deep = [deep]
    got = decode_from_client(request_frames(inputs=[{"name": "x", "dtype": deep, "shape": [2, 4]}]))
    assert isinstance(got, ClientMalformed)
    assert "unsupported dtype [[[[[[[[[...]]]]]]]]]" in got.message
