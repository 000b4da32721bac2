"""carpool.common.protocol: headers, the simple form, every decoder's validation, round trips."""

from __future__ import annotations

import math
from typing import Any

import pytest

from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.padding import CropAxis, PadRule
from carpool.common.protocol import (
    HEADER_BYTES,
    MAGIC,
    MAX_EMPTY_SPAN_BYTES,
    MAX_NAME_CHARS,
    MAX_RANK,
    MAX_TENSORS,
    MAX_TIMEOUT_MS,
    PROTOCOL_VERSION,
    BatchInputCache,
    BatchItem,
    BatchMeta,
    Cancel,
    Command,
    ErrorReply,
    FailedMeta,
    ModelSpec,
    Priority,
    Ready,
    ReplyMeta,
    ResultMeta,
    Submit,
    TensorMeta,
    VersionMismatch,
    check_frame_sizes,
    decode_meta,
    decode_simple_request,
    decode_submit,
    encode,
    encode_error,
    encode_reply,
    encode_request,
    encode_simple_request,
    header,
    is_simple_form,
    parse_header,
    request_id_of,
)
from carpool.common.protocol import frames as codec


def wire(obj: Any) -> Any:
    """What the other side sees: packed and unpacked again."""
    return codec.unpack(codec.pack(obj))


def tensor(name: object = "x", dtype: object = "float32", shape: Any = (1, 4)) -> dict[str, Any]:
    """A tensor descriptor as the wire carries it: any field may be of the wrong type."""
    return {"name": name, "dtype": dtype, "shape": list(shape)}


def submit_meta(**changes: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": 7, "model": "m", "timeout_ms": 500, "inputs": [tensor()]}
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not _DROP}


_DROP = object()

# --------------------------------------------------------------------------- header


@pytest.mark.parametrize("command", list(Command), ids=lambda c: c.name)
def test_header_round_trip(command: Command) -> None:
    frame = header(command)
    assert frame == MAGIC + bytes((PROTOCOL_VERSION, int(command)))
    assert len(frame) == HEADER_BYTES
    assert parse_header(frame) is command
    assert parse_header(memoryview(frame)) is command


@pytest.mark.parametrize(
    "frame",
    [b"", b"CP", b"CP\x01", b"CP\x01\x01\x00", b"XP\x01\x01", b"cp\x01\x01", b"\x00\x00\x00\x00"],
)
def test_parse_header_rejects_non_headers(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="not a carpool header") as info:
        parse_header(frame)
    assert not isinstance(info.value, VersionMismatch)


@pytest.mark.parametrize("version", [0, 2, 255])
def test_parse_header_version_mismatch(version: int) -> None:
    with pytest.raises(VersionMismatch) as info:
        parse_header(b"CP" + bytes((version, int(Command.REQUEST))))
    assert info.value.version == version
    assert isinstance(info.value, ProtocolError)
    assert str(PROTOCOL_VERSION) in str(info.value)


@pytest.mark.parametrize("command", [0x00, 0x07, 0x0F, 0x16, 0xFF])
def test_parse_header_unknown_command(command: int) -> None:
    with pytest.raises(ProtocolError, match=f"unknown command 0x{command:02x}"):
        parse_header(b"CP\x01" + bytes((command,)))


def test_version_is_checked_before_command() -> None:
    with pytest.raises(VersionMismatch):
        parse_header(b"CP\x02\xff")


# --------------------------------------------------------------------------- simple form


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (b"", False),
        (b"\x80", True),
        (b"\x8f", True),
        (b"\xde\x00\x10", True),
        (b"\xdf\x00\x00\x00\x10", True),
        (b"\x90", False),
        (b"\xc4\x00", False),
        (b"\x7f", False),
        (header(Command.REQUEST), False),
        (codec.pack({"v": 1}), True),
        (codec.pack({str(i): i for i in range(20)}), True),
        (codec.pack([1, 2]), False),
    ],
)
def test_is_simple_form(frame: bytes, expected: bool) -> None:
    assert is_simple_form(frame) is expected
    assert is_simple_form(memoryview(frame)) is expected


def test_headers_are_never_simple_form() -> None:
    assert not any(is_simple_form(header(c)) for c in Command)


# --------------------------------------------------------------------------- tensors


def test_tensor_meta_nbytes() -> None:
    assert TensorMeta("x", "float32", (2, 3)).nbytes == 24
    assert TensorMeta("x", "uint8", (5,)).nbytes == 5
    assert TensorMeta("x", "float64", (1, 1, 1)).nbytes == 8
    assert TensorMeta("x", "bool", (7,)).nbytes == 7


def test_tensor_meta_round_trip() -> None:
    t = TensorMeta("image", "uint8", (2, 3, 4))
    assert TensorMeta.from_wire(wire(t.to_wire())) == t
    dyn = TensorMeta("x", "float16", (-1, 8, -1))
    assert TensorMeta.from_wire(wire(dyn.to_wire()), allow_dynamic=True) == dyn


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ([1, 2], "expected a msgpack map"),
        ("x", "expected a msgpack map"),
        ({"dtype": "float32", "shape": [1]}, "name"),
        (tensor(name=""), "name"),
        (tensor(name=b"x"), "name"),
        (tensor(name=3), "name"),
        (tensor(name="n" * (MAX_NAME_CHARS + 1)), "name"),
        (tensor(dtype="float128"), "unsupported dtype"),
        (tensor(dtype=b"float32"), "unsupported dtype"),
        (tensor(dtype=None), "unsupported dtype"),
        ({"name": "x", "dtype": "float32"}, "shape must be a list"),
        ({"name": "x", "dtype": "float32", "shape": "1,4"}, "shape must be a list"),
        ({"name": "x", "dtype": "float32", "shape": {"a": 1}}, "shape must be a list"),
        (tensor(shape=[1] * (MAX_RANK + 1)), "shape must be a list"),
        (tensor(shape=[]), "shape must be a list"),
        (tensor(shape=[1, 0]), "bad dimension 0"),
        (tensor(shape=[1, -1]), "bad dimension -1"),
        (tensor(shape=[1, -5]), "bad dimension -5"),
        (tensor(shape=[True, 4]), "bad dimension True"),
        (tensor(shape=[1, 4.0]), "bad dimension 4.0"),
        (tensor(shape=[1, "4"]), "bad dimension '4'"),
        (tensor(shape=[1, None]), "bad dimension None"),
    ],
)
def test_tensor_meta_rejects(obj: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        TensorMeta.from_wire(wire(obj))


def test_tensor_meta_dynamic_dims_only_when_allowed() -> None:
    obj = tensor(shape=[-1, 4])
    assert TensorMeta.from_wire(obj, allow_dynamic=True).shape == (-1, 4)
    with pytest.raises(ProtocolError):
        TensorMeta.from_wire(obj)
    for bad in ([-2, 4], [0, 4], [False, 4]):
        with pytest.raises(ProtocolError, match="bad dimension"):
            TensorMeta.from_wire(tensor(shape=bad), allow_dynamic=True)


def test_zero_size_dims_only_after_dim_0_and_only_when_allowed() -> None:
    """Replies may carry empty arrays (a detector that found nothing, §5.1); requests,
    specs and dim 0 (the sample count) never have a 0."""
    obj = tensor(shape=[2, 0, 6])
    assert TensorMeta.from_wire(obj, allow_empty=True).shape == (2, 0, 6)
    assert TensorMeta.from_wire(obj, allow_empty=True).nbytes == 0
    with pytest.raises(ProtocolError, match="bad dimension 0"):
        TensorMeta.from_wire(obj)
    for bad in ([0, 6], [0], [2, False, 6], [2, -1]):
        with pytest.raises(ProtocolError, match="bad dimension"):
            TensorMeta.from_wire(tensor(shape=bad), allow_empty=True)
    # An empty frame bounds nothing: the other dims are bounded by §14's limit instead.
    edge = tensor(shape=[1, 0, MAX_EMPTY_SPAN_BYTES // 4])  # float32
    assert TensorMeta.from_wire(edge, allow_empty=True).nbytes == 0
    with pytest.raises(ProtocolError, match="at most"):
        TensorMeta.from_wire(tensor(shape=[1, 0, MAX_EMPTY_SPAN_BYTES // 4 + 1]), allow_empty=True)


def test_max_rank_and_name_length_are_accepted() -> None:
    t = TensorMeta.from_wire(tensor(name="n" * MAX_NAME_CHARS, shape=[1] * MAX_RANK))
    assert len(t.shape) == MAX_RANK


# --------------------------------------------------------------------------- frame sizes


def test_check_frame_sizes_accepts_exact_frames() -> None:
    metas = [TensorMeta("a", "float32", (2, 2)), TensorMeta("b", "uint8", (3,))]
    check_frame_sizes(metas, [bytes(16), bytearray(3)])
    check_frame_sizes(metas, [memoryview(bytes(16)), b"abc"])
    check_frame_sizes([], [])


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([bytes(16)], "expected 2 tensor frames, got 1"),
        ([bytes(16), bytes(3), b""], "expected 2 tensor frames, got 3"),
        ([bytes(15), bytes(3)], "needs 16 bytes, frame has 15"),
        ([bytes(16), bytes(4)], "needs 3 bytes, frame has 4"),
        ([b"", b""], "needs 16 bytes"),
    ],
)
def test_check_frame_sizes_rejects(frames: list[bytes], match: str) -> None:
    metas = [TensorMeta("a", "float32", (2, 2)), TensorMeta("b", "uint8", (3,))]
    with pytest.raises(ProtocolError, match=match):
        check_frame_sizes(metas, frames)


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    "submit",
    [
        Submit(7, "m", 500, (TensorMeta("x", "float32", (1, 4)),)),
        Submit(0, "m", None, (TensorMeta("x", "int8", (3,)),), Priority.BULK),
        Submit(
            2**64 - 1,
            "model/with.chars",
            MAX_TIMEOUT_MS,
            (TensorMeta("a", "uint16", (2, 2)), TensorMeta("b", "bool", (2,))),
        ),
        Submit(3, "m", 9, (TensorMeta("x", "int8", (3,)),), client=bytes(range(16))),
    ],
)
def test_submit_round_trip(submit: Submit) -> None:
    assert decode_submit(wire(submit.to_wire())) == submit


def test_submit_wire_omits_defaults() -> None:
    inputs = (TensorMeta("x", "uint8", (1,)),)
    meta = Submit(1, "m", None, inputs).to_wire()
    assert "timeout_ms" not in meta
    assert "priority" not in meta
    assert Submit(1, "m", 3, inputs, Priority.BULK).to_wire()["priority"] == 1


def test_decode_submit_preserves_input_order() -> None:
    meta = submit_meta(inputs=[tensor("b"), tensor("a"), tensor("c")])
    assert [t.name for t in decode_submit(meta).inputs] == ["b", "a", "c"]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"id": _DROP}, "'id'"),
        ({"id": -1}, "'id'"),
        ({"id": True}, "'id'"),
        ({"id": "7"}, "'id'"),
        ({"id": 1.0}, "'id'"),
        ({"model": _DROP}, "model"),
        ({"model": ""}, "model"),
        ({"model": b"m"}, "model"),
        ({"model": "m" * (MAX_NAME_CHARS + 1)}, "model"),
        ({"timeout_ms": 0}, "timeout_ms"),
        ({"timeout_ms": -5}, "timeout_ms"),
        ({"timeout_ms": MAX_TIMEOUT_MS + 1}, "timeout_ms"),
        ({"timeout_ms": True}, "timeout_ms"),
        ({"timeout_ms": 1.5}, "timeout_ms"),
        ({"timeout_ms": "100"}, "timeout_ms"),
        ({"priority": 2}, "priority"),
        ({"priority": -1}, "priority"),
        ({"priority": True}, "priority"),
        ({"priority": "bulk"}, "priority"),
        ({"priority": 1.0}, "priority"),
        ({"inputs": _DROP}, "1..64 tensors"),
        ({"inputs": []}, "1..64 tensors"),
        ({"inputs": {"x": tensor()}}, "1..64 tensors"),
        ({"inputs": [tensor(f"t{i}") for i in range(MAX_TENSORS + 1)]}, "1..64 tensors"),
        ({"inputs": [tensor("x"), tensor("x", shape=[2])]}, "duplicate tensor names"),
        ({"inputs": [tensor(shape=[0, 4])]}, "bad dimension"),
        ({"inputs": [tensor(shape=[-1, 4])]}, "bad dimension"),
        ({"inputs": ["x"]}, "expected a msgpack map"),
        ({"client": b"\0" * 15}, "client must be bin of 16 bytes"),
        ({"client": b"\0" * 17}, "client must be bin of 16 bytes"),
        ({"client": "0123456789abcdef"}, "client must be bin of 16 bytes"),
    ],
)
def test_decode_submit_rejects(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_submit(wire(submit_meta(**changes)))


def test_decode_submit_accepts_max_tensors() -> None:
    meta = submit_meta(inputs=[tensor(f"t{i}") for i in range(MAX_TENSORS)])
    assert len(decode_submit(meta).inputs) == MAX_TENSORS


def test_decode_submit_defaults() -> None:
    got = decode_submit(submit_meta(timeout_ms=_DROP, priority=1))
    assert got.timeout_ms is None
    assert got.priority is Priority.BULK
    assert decode_submit(submit_meta()).priority is Priority.INTERACTIVE


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        ({"id": 5}, 5),
        ({"id": 0}, 0),
        ({"id": 2**64 - 1}, 2**64 - 1),
        ({"id": 2**64}, None),
        ({"id": -1}, None),
        ({"id": True}, None),
        ({"id": "5"}, None),
        ({}, None),
        ([5], None),
        (None, None),
    ],
)
def test_request_id_of(meta: Any, expected: int | None) -> None:
    assert request_id_of(meta) == expected


def test_encode_request_frames() -> None:
    s = Submit(3, "m", 100, (TensorMeta("x", "uint8", (2,)),))
    payload = b"ab"
    frames = encode_request(s, [payload])
    assert frames[0] == header(Command.REQUEST)
    assert decode_submit(decode_meta(frames[1])) == s
    assert frames[2] is payload
    assert len(frames) == 3


def test_encode_generic() -> None:
    p = bytearray(b"xyz")
    frames = encode(Command.HEARTBEAT, {"rho": 0.5}, [p])
    assert frames[0] == header(Command.HEARTBEAT)
    assert decode_meta(frames[1]) == {"rho": 0.5}
    assert frames[2] is p
    assert encode(Command.DISCONNECT, {}) == [header(Command.DISCONNECT), codec.pack({})]


def test_decode_meta_rejects_non_maps_and_oversize() -> None:
    with pytest.raises(ProtocolError, match="expected a msgpack map"):
        decode_meta(codec.pack([1, 2]))
    with pytest.raises(ProtocolError, match="expected a msgpack map"):
        decode_meta(codec.pack(b"bin"))
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_meta(codec.pack({"pad": "x" * codec.MAX_META_BYTES}))
    with pytest.raises(ProtocolError, match="malformed"):
        decode_meta(codec.pack({"a": 1}) + b"\xc0")


# --------------------------------------------------------------------------- simple requests


def simple_frame(**changes: Any) -> bytes:
    meta = submit_meta(v=PROTOCOL_VERSION, inputs=[{**tensor(), "data": bytes(16)}])
    meta.update(changes)
    return codec.pack({k: v for k, v in meta.items() if v is not _DROP})


def test_simple_request_round_trip() -> None:
    s = Submit(
        9,
        "m",
        250,
        (TensorMeta("a", "float32", (1, 2)), TensorMeta("b", "uint8", (1, 3))),
        Priority.BULK,
    )
    payloads = [b"\x00" * 8, b"abc"]
    frame = encode_simple_request(s, payloads)
    assert is_simple_form(frame)
    got, data = decode_simple_request(frame)
    assert got == s
    assert data == payloads
    got2, _ = decode_simple_request(memoryview(frame))
    assert got2 == s


def test_simple_request_accepts_bytearray_and_memoryview_payloads() -> None:
    s = Submit(1, "m", None, (TensorMeta("a", "uint8", (2,)),))
    frame = encode_simple_request(s, [memoryview(bytearray(b"hi"))])  # type: ignore[list-item]
    assert decode_simple_request(frame)[1] == [b"hi"]


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (simple_frame(v=_DROP), "'v'"),
        (simple_frame(v="1"), "'v'"),
        (simple_frame(v=None), "'v'"),
        (simple_frame(inputs=[tensor()]), "no bin 'data'"),
        (simple_frame(inputs=[{**tensor(), "data": "x" * 16}]), "no bin 'data'"),
        (simple_frame(inputs=[{**tensor(), "data": [0] * 16}]), "no bin 'data'"),
        (simple_frame(inputs=[{**tensor(), "data": bytes(15)}]), "needs 16 bytes"),
        (simple_frame(id=-3), "'id'"),
        (simple_frame(model=b"m"), "model"),
        (codec.pack([1, 2]), "map"),
        (simple_frame() + b"\x00", "malformed"),
        (b"\x81", "malformed"),
    ],
)
def test_decode_simple_request_rejects(frame: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match) as info:
        decode_simple_request(frame)
    assert not isinstance(info.value, VersionMismatch)


@pytest.mark.parametrize("version", [True, 1.0, "1", None])
def test_simple_request_rejects_non_int_version(version: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_simple_request(simple_frame(v=version))
    assert not isinstance(info.value, VersionMismatch)


@pytest.mark.parametrize("version", [0, 2, 200])
def test_simple_request_version_mismatch(version: int) -> None:
    with pytest.raises(VersionMismatch) as info:
        decode_simple_request(simple_frame(v=version))
    assert info.value.version == version


def test_simple_request_size_limit() -> None:
    frame = b"\x80" + bytes(codec.MAX_SIMPLE_BYTES)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_simple_request(frame)


def test_simple_request_may_exceed_meta_limit() -> None:
    big = TensorMeta("x", "uint8", (1, codec.MAX_META_BYTES * 2))
    s = Submit(1, "m", None, (big,))
    got, data = decode_simple_request(encode_simple_request(s, [bytes(big.nbytes)]))
    assert got == s
    assert len(data[0]) == big.nbytes


# --------------------------------------------------------------------------- replies


def test_reply_meta_round_trip() -> None:
    r = ReplyMeta(
        5, (TensorMeta("y", "float32", (2, 3)), TensorMeta("z", "int64", (2,))), 8, 1.5, 2.25
    )
    assert ReplyMeta.from_wire(wire(r.to_wire())) == r


def test_reply_meta_rounds_times_and_defaults() -> None:
    r = ReplyMeta(5, (TensorMeta("y", "uint8", (1,)),), queue_ms=1.23456, compute_ms=0.00049)
    w = r.to_wire()
    assert w["queue_ms"] == 1.235
    assert w["compute_ms"] == 0.0
    got = ReplyMeta.from_wire({"id": 1, "outputs": [tensor()]})
    assert (got.batch_size, got.queue_ms, got.compute_ms) == (0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"outputs": [tensor()]}, "'id'"),
        ({"id": "1", "outputs": [tensor()]}, "'id'"),
        ({"id": 1}, "1..64 tensors"),
        ({"id": 1, "outputs": []}, "1..64 tensors"),
        ({"id": 1, "outputs": [tensor(), tensor()]}, "duplicate"),
        ({"id": 1, "outputs": [tensor()], "batch_size": True}, "batch_size"),
        ({"id": 1, "outputs": [tensor()], "batch_size": 1.0}, "batch_size"),
        ({"id": 1, "outputs": [tensor()], "queue_ms": "1"}, "queue_ms"),
        ({"id": 1, "outputs": [tensor()], "queue_ms": True}, "queue_ms"),
        ({"id": 1, "outputs": [tensor()], "compute_ms": math.nan}, "compute_ms"),
        ({"id": 1, "outputs": [tensor()], "compute_ms": math.inf}, "compute_ms"),
        ({"id": 1, "outputs": [tensor()], "compute_ms": None}, "compute_ms"),
    ],
)
def test_reply_meta_rejects(meta: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        ReplyMeta.from_wire(wire(meta))


def test_encode_reply_framed() -> None:
    r = ReplyMeta(5, (TensorMeta("y", "uint8", (1, 2)),), 1)
    payload = bytearray(b"ab")
    frames = encode_reply(r, [payload], simple=False)
    assert frames[0] == header(Command.REPLY)
    assert ReplyMeta.from_wire(decode_meta(frames[1])) == r
    assert frames[2] is payload
    assert len(frames) == 3


def test_encode_reply_simple() -> None:
    r = ReplyMeta(5, (TensorMeta("y", "uint8", (1, 2)), TensorMeta("z", "uint8", (1,))), 1)
    frames = encode_reply(r, [b"ab", memoryview(b"c")], simple=True)
    assert len(frames) == 1
    assert is_simple_form(frames[0])
    obj = codec.unpack(frames[0])
    assert obj["v"] == PROTOCOL_VERSION
    assert obj["id"] == 5
    assert [t["data"] for t in obj["outputs"]] == [b"ab", b"c"]
    assert ReplyMeta.from_wire(obj) == r


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "err",
    [
        ErrorReply(3, ErrorCode.NOT_FOUND, "no such model"),
        ErrorReply(None, ErrorCode.INVALID_ARGUMENT, "garbage"),
        ErrorReply(4, ErrorCode.OVERLOADED, "full", retry_after_ms=25),
        ErrorReply(5, ErrorCode.UNAVAILABLE, "stopping", retry=True),
        ErrorReply(6, ErrorCode.CANCELLED, "cancelled by the client"),
    ],
)
def test_error_reply_round_trip(err: ErrorReply) -> None:
    assert ErrorReply.from_wire(wire(err.to_wire())) == err
    frames = encode_error(err)
    assert frames[0] == header(Command.ERROR)
    assert len(frames) == 2
    assert ErrorReply.from_wire(decode_meta(frames[1])) == err


def test_retry_is_read_only_as_true_on_unavailable() -> None:
    """``retry`` says a stopping broker did not run the request (§6.3): anything but
    ``true``, or on another code, reads as no."""
    base = {"id": 1, "code": int(ErrorCode.UNAVAILABLE), "message": "m"}
    assert ErrorReply.from_wire({**base, "retry": True}).retry
    assert not ErrorReply.from_wire({**base, "retry": 1}).retry
    assert not ErrorReply.from_wire(base).retry
    assert "retry" not in ErrorReply(1, ErrorCode.UNAVAILABLE, "m").to_wire()
    other = {**base, "code": int(ErrorCode.INTERNAL), "retry": True}
    assert not ErrorReply.from_wire(other).retry


def test_cancel_round_trip_and_checks() -> None:
    cancel = Cancel(2**64 - 1, bytes(range(16)))
    frames = cancel.to_frames()
    assert frames[0] == header(Command.CANCEL) == b"CP\x01\x05"
    assert Cancel.from_wire(decode_meta(frames[1])) == cancel
    with pytest.raises(ProtocolError, match="'client'"):
        Cancel.from_wire({"id": 1})
    with pytest.raises(ProtocolError, match="16 bytes"):
        Cancel.from_wire({"id": 1, "client": b"short"})
    with pytest.raises(ProtocolError, match="'id'"):
        Cancel.from_wire({"client": bytes(16)})


def test_a_simple_request_cannot_carry_a_client_nonce() -> None:
    submit = Submit(1, "m", 5, (TensorMeta("x", "uint8", (1,)),), client=bytes(16))
    with pytest.raises(ProtocolError, match="framed form"):
        decode_simple_request(encode_simple_request(submit, [b"\0"]))


def test_error_reply_simple_form() -> None:
    err = ErrorReply(4, ErrorCode.OVERLOADED, "full", retry_after_ms=25)
    frames = encode_error(err, simple=True)
    assert len(frames) == 1
    assert is_simple_form(frames[0])
    assert codec.unpack(frames[0]) == {
        "v": PROTOCOL_VERSION,
        "id": 4,
        "error": {"code": int(ErrorCode.OVERLOADED), "message": "full", "retry_after_ms": 25},
    }
    anon = codec.unpack(encode_error(ErrorReply(None, ErrorCode.INTERNAL, "x"), simple=True)[0])
    assert anon == {"v": 1, "id": None, "error": {"code": 6, "message": "x"}}


def test_error_reply_unknown_code_becomes_internal() -> None:
    err = ErrorReply.from_wire({"id": 1, "code": 77, "message": "odd"})
    assert err.code is ErrorCode.INTERNAL
    assert err.message == "unknown error code 77: odd"
    assert err.request_id == 1


@pytest.mark.parametrize("code", [None, True, "3", 3.0])
def test_error_reply_rejects_bad_code(code: Any) -> None:
    meta = {"id": 1, "message": "m"} if code is None else {"id": 1, "code": code, "message": "m"}
    with pytest.raises(ProtocolError, match="code"):
        ErrorReply.from_wire(meta)


@pytest.mark.parametrize("retry", [True, "5", 5.5, None])
def test_error_reply_tolerates_bad_retry_after(retry: Any) -> None:
    err = ErrorReply.from_wire({"id": 1, "code": 4, "message": "m", "retry_after_ms": retry})
    assert err.retry_after_ms is None
    assert err.code is ErrorCode.OVERLOADED


def test_error_reply_message_is_stringified_and_id_optional() -> None:
    err = ErrorReply.from_wire({"code": 2, "message": 12})
    assert err.message == "12"
    assert err.request_id is None


# --------------------------------------------------------------------------- worker side


def spec(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "name": "m",
        "inputs": [tensor("x", shape=[-1, 4])],
        "outputs": [tensor("y", shape=[-1, 2])],
        "max_batch": 8,
        "preferred_batch": [4, 8],
    }
    obj.update(changes)
    return {k: v for k, v in obj.items() if v is not _DROP}


MODEL = ModelSpec(
    "m",
    (TensorMeta("x", "float32", (-1, 4)), TensorMeta("mask", "bool", (-1, -1))),
    (TensorMeta("y", "float32", (-1, 2)),),
    16,
    (1, 4, 16),
)


def test_model_spec_round_trip() -> None:
    assert ModelSpec.from_wire(wire(MODEL.to_wire())) == MODEL


DETECTOR = ModelSpec(
    "det",
    (TensorMeta("x", "float32", (-1, 3, -1, -1)),),
    (TensorMeta("map", "float32", (-1, 1, -1, -1)),),
    8,
    pads=(PadRule(multiple_of=(1, 32, 32)),),
    crops=((CropAxis(2, "x", 2), CropAxis(3, "x", 3)),),
)


def test_a_model_spec_with_pad_rules_and_crops_round_trips() -> None:
    meta = DETECTOR.to_wire()
    assert meta["inputs"][0]["pad"] == {"value": 0.0, "multiple_of": [1, 32, 32]}
    assert [c["axis"] for c in meta["outputs"][0]["crop"]] == [2, 3]
    assert ModelSpec.from_wire(wire(meta)) == DETECTOR
    assert "pad" not in MODEL.to_wire()["inputs"][0]
    assert "crop" not in MODEL.to_wire()["outputs"][0]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: m["inputs"][0].update(pad={"multiple_of": [32, 32]}), "multiple_of has 2"),
        (lambda m: m["outputs"][0].update(crop={"axis": 2}), "crop must be a list"),
        (lambda m: m["outputs"][0]["crop"].append(m["outputs"][0]["crop"][0]), "cropped twice"),
        (lambda m: m["outputs"][0]["crop"][0].update(input="z"), "names input 'z'"),
        (lambda m: m["inputs"][0].pop("pad"), "no input is padded"),
    ],
)
def test_bad_pad_and_crop_descriptors_are_refused(change: Any, match: str) -> None:
    meta = wire(DETECTOR.to_wire())
    change(meta)
    with pytest.raises(ProtocolError, match=match):
        ModelSpec.from_wire(meta)


def test_model_spec_sorts_and_dedups_preferred() -> None:
    got = ModelSpec.from_wire(spec(preferred_batch=[8, 2, 8, 4]))
    assert got.preferred_batch == (2, 4, 8)
    assert ModelSpec.from_wire(spec(preferred_batch=_DROP)).preferred_batch == ()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"name": _DROP}, "name"),
        ({"name": ""}, "name"),
        ({"inputs": _DROP}, "inputs"),
        ({"inputs": []}, "inputs"),
        ({"outputs": _DROP}, "outputs"),
        ({"outputs": [tensor("y"), tensor("y")]}, "duplicate"),
        ({"inputs": [tensor("x", shape=[-2, 4])]}, "bad dimension"),
        ({"max_batch": _DROP}, "max_batch"),
        ({"max_batch": 0}, "max_batch"),
        ({"max_batch": -3}, "max_batch"),
        ({"max_batch": True}, "max_batch"),
        ({"max_batch": 8.0}, "max_batch"),
        ({"max_batch": "8"}, "max_batch"),
        ({"preferred_batch": [9]}, "preferred_batch"),
        ({"preferred_batch": [0]}, "preferred_batch"),
        ({"preferred_batch": [True]}, "preferred_batch"),
        ({"preferred_batch": [2.0]}, "preferred_batch"),
        ({"preferred_batch": 4}, "preferred_batch"),
    ],
)
def test_model_spec_rejects(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        ModelSpec.from_wire(wire(spec(**changes)))


def test_model_spec_rejects_non_map() -> None:
    with pytest.raises(ProtocolError, match="map"):
        ModelSpec.from_wire(["m"])


def ready(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"name": "w1", "slots": 2, "models": [spec()], "heartbeat_ms": 500}
    obj.update(changes)
    return {k: v for k, v in obj.items() if v is not _DROP}


def test_ready_round_trip() -> None:
    r = Ready("w1", 3, (MODEL, ModelSpec("n", MODEL.inputs, MODEL.outputs, 1)), 250)
    assert Ready.from_wire(wire(r.to_wire())) == r


def test_ready_default_heartbeat() -> None:
    assert Ready.from_wire(ready(heartbeat_ms=_DROP)).heartbeat_ms == 1000


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"name": _DROP}, "name"),
        ({"name": b"w"}, "name"),
        ({"slots": _DROP}, "slots"),
        ({"slots": 0}, "slots"),
        ({"slots": 1025}, "slots"),
        ({"slots": True}, "slots"),
        ({"slots": 2.0}, "slots"),
        ({"models": _DROP}, "models"),
        ({"models": []}, "models"),
        ({"models": spec()}, "models"),
        ({"models": [spec(name=f"m{i}") for i in range(257)]}, "models"),
        ({"models": [spec(), spec()]}, "duplicate model names"),
        ({"models": [spec(max_batch=0)]}, "max_batch"),
        ({"heartbeat_ms": 9}, "heartbeat_ms"),
        ({"heartbeat_ms": 600_001}, "heartbeat_ms"),
        ({"heartbeat_ms": True}, "heartbeat_ms"),
        ({"heartbeat_ms": 500.0}, "heartbeat_ms"),
        ({"heartbeat_ms": None}, "heartbeat_ms"),
    ],
)
def test_ready_rejects(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        Ready.from_wire(wire(ready(**changes)))


@pytest.mark.parametrize(("slots", "hb"), [(1, 10), (1024, 600_000)])
def test_ready_bounds_are_inclusive(slots: int, hb: int) -> None:
    r = Ready.from_wire(ready(slots=slots, heartbeat_ms=hb))
    assert (r.slots, r.heartbeat_ms) == (slots, hb)


BATCH = BatchMeta(
    12,
    "m",
    (TensorMeta("x", "float32", (-1, 4)), TensorMeta("mask", "bool", (-1, 3))),
    (
        BatchItem(1, 2, False, 1.5),
        BatchItem(2**64 - 1, 1, True, 0.0),
        BatchItem(3, 5, False, 7.125),
    ),
)


def test_batch_meta_round_trip() -> None:
    assert BatchMeta.from_wire(wire(BATCH.to_wire())) == BATCH
    assert BATCH.total_samples == 8


def test_batch_meta_request_tensors() -> None:
    assert BATCH.request_tensors(BATCH.items[2]) == (
        TensorMeta("x", "float32", (5, 4)),
        TensorMeta("mask", "bool", (5, 3)),
    )


def batch(**changes: Any) -> dict[str, Any]:
    obj = BATCH.to_wire()
    obj.update(changes)
    return {k: v for k, v in obj.items() if v is not _DROP}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"batch": _DROP}, "'batch'"),
        ({"batch": True}, "'batch'"),
        ({"batch": "1"}, "'batch'"),
        ({"model": ""}, "model"),
        ({"inputs": []}, "inputs"),
        ({"requests": []}, "non-empty"),
        ({"requests": _DROP}, "non-empty"),
        ({"requests": {"id": 1, "n": 1}}, "non-empty"),
        ({"requests": [5]}, "map"),
        ({"requests": [{"n": 1}]}, "'id'"),
        ({"requests": [{"id": 1}]}, "'n'"),
        ({"requests": [{"id": 1, "n": 0}]}, "'n'"),
        ({"requests": [{"id": 1, "n": True}]}, "'n'"),
        ({"requests": [{"id": 1, "n": 1.0}]}, "'n'"),
        ({"requests": [{"id": -1, "n": 1}]}, "'id'"),
        ({"requests": [{"id": 1, "n": 1, "queue_ms": "0"}]}, "queue_ms"),
    ],
)
def test_batch_meta_rejects(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        BatchMeta.from_wire(wire(batch(**changes)))


def test_batch_item_defaults() -> None:
    got = BatchMeta.from_wire(batch(requests=[{"id": 4, "n": 2}]))
    assert got.items == (BatchItem(4, 2, False, 0.0),)


def test_result_meta_round_trip() -> None:
    r = ResultMeta(3, 0.5, 12.5, (3, 1, 2))
    assert ResultMeta.from_wire(wire(r.to_wire())) == r


def test_result_meta_carries_the_worker_cpu_when_measured() -> None:
    r = ResultMeta(3, 0.5, 12.5, (1,), cpu_ms=0.4567)
    w = r.to_wire()
    assert w["cpu_ms"] == 0.457
    assert ResultMeta.from_wire(wire(w)).cpu_ms == 0.457
    assert "cpu_ms" not in ResultMeta(3, 0.5, 12.5, (1,)).to_wire()  # 0: not measured
    assert ResultMeta.from_wire({"batch": 3, "frames": [1], "cpu_ms": 2}).cpu_ms == 2.0
    assert ResultMeta.from_wire({"batch": 3, "frames": [1]}).cpu_ms == 0.0


def test_result_meta_rounds() -> None:
    w = ResultMeta(3, 0.123456, 1.23456, (1,)).to_wire()
    assert w["rho"] == 0.1235
    assert w["compute_ms"] == 1.235


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"frames": [1]}, "'batch'"),
        ({"batch": False, "frames": [1]}, "'batch'"),
        ({"batch": 1}, "frames"),
        ({"batch": 1, "frames": 3}, "frames"),
        ({"batch": 1, "frames": [1, 0]}, "frames"),
        ({"batch": 1, "frames": [True]}, "frames"),
        ({"batch": 1, "frames": [1.0]}, "frames"),
        ({"batch": 1, "frames": [1], "rho": "high"}, "rho"),
        ({"batch": 1, "frames": [1], "rho": math.nan}, "rho"),
        ({"batch": 1, "frames": [1], "compute_ms": False}, "compute_ms"),
        ({"batch": 1, "frames": [1], "cpu_ms": True}, "cpu_ms"),
        ({"batch": 1, "frames": [1], "cpu_ms": math.inf}, "cpu_ms"),
        ({"batch": 1, "frames": [1], "cpu_ms": "0.3"}, "cpu_ms"),
    ],
)
def test_result_meta_rejects(meta: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        ResultMeta.from_wire(wire(meta))


def test_failed_meta_round_trip() -> None:
    f = FailedMeta(9, ErrorCode.INTERNAL, "engine exploded", 0.75)
    assert FailedMeta.from_wire(wire(f.to_wire())) == f
    assert FailedMeta.from_wire({"batch": 1, "code": 5}).message == ""


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"code": 6, "message": "x"}, "'batch'"),
        ({"batch": True, "code": 6}, "'batch'"),
        ({"batch": 1, "message": "x"}, "code"),
        ({"batch": 1, "code": "6"}, "code"),
        ({"batch": 1, "code": 6, "rho": math.inf}, "rho"),
    ],
)
def test_failed_meta_rejects(meta: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        FailedMeta.from_wire(meta)


def test_failed_meta_unknown_code_is_internal() -> None:
    f = FailedMeta.from_wire({"batch": 1, "code": 99, "message": "?"})
    assert f.code is ErrorCode.INTERNAL
    assert "99" in f.message


# --------------------------------------------------------------------------- shared memory (§5.4)

SHM_SUBMIT = Submit(
    9,
    "m",
    500,
    (TensorMeta("a", "float32", (1, 4)), TensorMeta("b", "uint8", (1, 2))),
    shm=(("carpool-1-ab", 128, "ab" * 16), None),
)


def test_submit_with_shared_memory_round_trip() -> None:
    obj = wire(SHM_SUBMIT.to_wire())
    assert obj["inputs"][0]["shm"] == {"region": "carpool-1-ab", "offset": 128, "key": "ab" * 16}
    assert "shm" not in obj["inputs"][1]
    assert decode_submit(obj) == SHM_SUBMIT
    assert decode_submit(wire(Submit(1, "m", None, SHM_SUBMIT.inputs).to_wire())).shm is None


def test_shm_nil_means_in_its_frame() -> None:
    obj = wire(SHM_SUBMIT.to_wire())
    obj["inputs"][0]["shm"] = None
    assert decode_submit(obj).shm is None


@pytest.mark.parametrize(
    "ref",
    [
        {"region": "elsewhere", "offset": 64, "key": "ab" * 16},
        {"region": "carpool-x", "offset": -5, "key": "ab" * 16},
        {"region": "carpool-x", "key": "ab" * 16},
        {"region": "carpool-x", "offset": 64},
        ["carpool-x", 64, "ab" * 16],
    ],
)
def test_decode_submit_rejects_bad_shared_memory_references(ref: Any) -> None:
    obj = wire(SHM_SUBMIT.to_wire())
    obj["inputs"][1]["shm"] = ref
    with pytest.raises(ProtocolError, match="shm"):
        decode_submit(obj)


def test_frames_of_shared_memory_inputs_must_be_empty() -> None:
    tensors = SHM_SUBMIT.inputs
    check_frame_sizes(tensors, [b"", b"\0\0"], SHM_SUBMIT.shm)
    with pytest.raises(ProtocolError, match="must be empty"):
        check_frame_sizes(tensors, [b"\0" * 16, b"\0\0"], SHM_SUBMIT.shm)
    with pytest.raises(ProtocolError, match="needs 2 bytes"):
        check_frame_sizes(tensors, [b"", b""], SHM_SUBMIT.shm)


def test_simple_form_cannot_carry_shared_memory_references() -> None:
    obj = SHM_SUBMIT.to_wire()
    obj["v"] = PROTOCOL_VERSION
    for t in obj["inputs"]:
        t["data"] = b"\0" * 16
    with pytest.raises(ProtocolError, match="framed form"):
        decode_simple_request(codec.pack(obj))


def test_batch_items_carry_shared_memory_references() -> None:
    b = BatchMeta(
        1,
        "m",
        BATCH.inputs,
        (
            BatchItem(1, 2, False, 1.5, (None, ("carpool-z", 64, "cd" * 16))),
            BatchItem(2, 1, False, 0.0),
        ),
    )
    obj = wire(b.to_wire())
    ref = {"region": "carpool-z", "offset": 64, "key": "cd" * 16}
    assert obj["requests"][0]["shm"] == [None, ref]
    assert "shm" not in obj["requests"][1]
    assert BatchMeta.from_wire(obj) == b


@pytest.mark.parametrize(
    "refs",
    [
        [None],  # one per input: two inputs
        [None, None, None],
        "carpool-z",
        [None, {"region": "nope", "offset": 64, "key": "cd" * 16}],
    ],
)
def test_batch_meta_rejects_bad_shared_memory_lists(refs: Any) -> None:
    with pytest.raises(ProtocolError, match="shm"):
        BatchMeta.from_wire(wire(batch(requests=[{"id": 1, "n": 1, "shm": refs}])))


# ------------------------------------------------------------- shared-memory outputs (§5.5)


def test_shm_outputs_round_trip_and_default() -> None:
    s = Submit(3, "m", None, SHM_SUBMIT.inputs, shm_outputs=True)
    obj = wire(s.to_wire())
    assert obj["shm_outputs"] is True
    assert decode_submit(obj) == s
    assert "shm_outputs" not in Submit(3, "m", None, SHM_SUBMIT.inputs).to_wire()


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_shm_outputs_must_be_a_bool(value: Any) -> None:
    obj = wire(Submit(3, "m", None, SHM_SUBMIT.inputs).to_wire())
    obj["shm_outputs"] = value
    with pytest.raises(ProtocolError, match="shm_outputs"):
        decode_submit(obj)


def test_simple_form_cannot_ask_for_shared_memory_outputs() -> None:
    obj = Submit(3, "m", None, (TensorMeta("x", "float32", (1, 1)),), shm_outputs=True).to_wire()
    obj["v"] = PROTOCOL_VERSION
    obj["inputs"][0]["data"] = b"\0" * 4
    with pytest.raises(ProtocolError, match="framed form"):
        decode_simple_request(codec.pack(obj))


def test_batch_items_carry_shm_outputs() -> None:
    b = BatchMeta(1, "m", BATCH.inputs, (BatchItem(1, 1, False, 0.0, None, True),))
    obj = wire(b.to_wire())
    assert obj["requests"][0]["shm_outputs"] is True
    assert BatchMeta.from_wire(obj) == b
    obj["requests"][0]["shm_outputs"] = 1  # only `true` means yes
    assert BatchMeta.from_wire(obj).items[0].shm_outputs is False


def test_reply_outputs_may_be_in_a_ring() -> None:
    ref = ("carpool-out-1-ab", 128, "ef" * 16, 64)
    r = ReplyMeta(
        5,
        (TensorMeta("y", "float32", (1, 4)), TensorMeta("z", "uint8", (1, 2))),
        shm=(ref, None),
    )
    obj = wire(r.to_wire())
    assert obj["outputs"][0]["shm"] == {
        "region": "carpool-out-1-ab",
        "offset": 128,
        "key": "ef" * 16,
        "seq": 64,
    }
    assert ReplyMeta.from_wire(obj) == r
    del obj["outputs"][0]["shm"]["seq"]
    with pytest.raises(ProtocolError, match="seq"):
        ReplyMeta.from_wire(obj)


def test_batch_inputs_validated_once_answer_as_a_fresh_parse() -> None:
    """A BATCH's inputs are validated once per signature and then reused: a second
    parse gives the same result, and lists that differ in anything are still checked."""
    known = BatchInputCache()
    first = BatchMeta.from_wire(wire(BATCH.to_wire()), known)
    second = BatchMeta.from_wire(wire(BATCH.to_wire()), known)
    assert first == second == BATCH == BatchMeta.from_wire(wire(BATCH.to_wire()))
    assert second.inputs is first.inputs  # reused, not rebuilt
    assert second.total_samples == 8
    for bad in (
        [{"name": "x", "dtype": "complex64", "shape": [-1, 4]}],
        [{"name": "x", "dtype": "float32", "shape": [-1, 0]}],
        [{"name": "x", "dtype": "float32", "shape": [-1, True]}],
        [{"name": "x", "dtype": "float32", "shape": [-1, 4]}] * 2,
    ):
        with pytest.raises(ProtocolError):
            BatchMeta.from_wire(wire(batch(inputs=bad)), known)
