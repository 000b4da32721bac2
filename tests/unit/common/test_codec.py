"""protocol/frames.py: msgpack with limits, and the dtype allow-list."""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import numpy as np
import pytest

from carpool.common.errors import ProtocolError
from carpool.common.protocol import frames as codec

ALLOWED = [
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "float32",
    "float64",
]


def test_allow_list_is_exactly_the_documented_dtypes() -> None:
    assert list(codec.DTYPES) == ALLOWED
    for name, dt in codec.DTYPES.items():
        assert dt.name == name
        assert dt.byteorder in ("<", "|", "=")
        assert dt.newbyteorder("<") == dt


@pytest.mark.parametrize("name", ALLOWED)
def test_wire_dtype_accepts_allowed(name: str) -> None:
    assert codec.wire_dtype(name) == name
    assert codec.wire_dtype(np.dtype(name)) == name
    assert codec.wire_dtype(np.dtype(name).newbyteorder("<")) == name
    assert codec.numpy_dtype(name) == np.dtype(name).newbyteorder("<")


def test_wire_dtype_accepts_python_types() -> None:
    assert codec.wire_dtype(np.float32) == "float32"
    assert codec.wire_dtype(bool) == "bool"


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype(object),
        np.dtype("V8"),
        np.dtype("U4"),
        np.dtype("S4"),
        np.dtype("complex64"),
        np.dtype("datetime64[s]"),
        np.dtype([("a", "<f4"), ("b", "<i4")]),
    ],
    ids=str,
)
def test_wire_dtype_rejects(dtype: np.dtype[Any]) -> None:
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        codec.wire_dtype(dtype)


def test_single_byte_dtypes_have_no_byte_order() -> None:
    # '>u1' has no byte order to speak of: it is the same dtype as uint8.
    assert codec.wire_dtype(np.dtype(">u1")) == "uint8"


@pytest.mark.parametrize("name", ["float128", "object", "complex64", "", "FLOAT32", "f4", None, 3])
def test_numpy_dtype_rejects_unknown_names(name: Any) -> None:
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        codec.numpy_dtype(name)


@pytest.mark.parametrize(
    "obj",
    [
        {"a": 1, "b": [1, 2.5, "x", b"\x00\xff", None, True]},
        {},
        [],
        {"nested": {"deep": [{"k": -(2**63)}, 2**64 - 1]}},
        "text",
        b"bin",
    ],
)
def test_pack_unpack_round_trip(obj: Any) -> None:
    assert codec.unpack(codec.pack(obj)) == obj


def test_pack_uses_bin_type_for_bytes() -> None:
    packed = codec.pack(b"ab")
    assert packed[0] == 0xC4  # bin 8, never raw str
    assert codec.unpack(packed) == b"ab"
    assert isinstance(codec.unpack(codec.pack("ab")), str)


def test_pack_after_a_failed_pack_and_from_other_threads() -> None:
    """The per-thread Packer starts clean after an object it could not pack, and each
    thread's packs are whole."""
    with pytest.raises(TypeError):
        codec.pack({"a": [1, object()]})
    assert codec.pack({"b": 1}) == msgpack.packb({"b": 1})
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(codec.pack({"t": i, "x": [i] * 50})))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codec.unpack(r)["t"] for r in results) == list(range(8))
    assert all(codec.unpack(r)["x"] == [codec.unpack(r)["t"]] * 50 for r in results)


def test_a_large_pack_does_not_keep_its_buffer() -> None:
    codec.pack({"small": 1})
    kept = codec._packers.packer
    assert codec.pack({"small": 2}) == msgpack.packb({"small": 2})
    assert codec._packers.packer is kept  # reused for small objects
    big = codec.pack({"d": b"x" * (2 << 20)})
    assert len(big) > 2 << 20
    assert not hasattr(codec._packers, "packer")  # dropped: its buffer was that big
    assert codec.pack({"small": 3}) == msgpack.packb({"small": 3})


def test_unpack_accepts_memoryview() -> None:
    assert codec.unpack(memoryview(codec.pack({"x": 1}))) == {"x": 1}


def test_unpack_rejects_trailing_garbage() -> None:
    with pytest.raises(ProtocolError, match="malformed msgpack"):
        codec.unpack(codec.pack({"a": 1}) + b"\x00")


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x81", b"\x92\x01", b"\xdf\xff\xff\xff\xff"],
    ids=["empty", "never-used", "truncated-map", "truncated-array", "huge-map-header"],
)
def test_unpack_rejects_malformed(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        codec.unpack(data)


@pytest.mark.parametrize(
    "data",
    [
        msgpack.packb(msgpack.ExtType(1, b"xyz")),
        b"\xd4\x05\x00",  # fixext 1
        # Empty bodies in ext 8/16/32, alone and as a map value: max_ext_len=0 let them by.
        b"\xc7\x00\x05",
        b"\xc8\x00\x00\x05",
        b"\xc9\x00\x00\x00\x00\x05",
        b"\x81\xa1k\xc7\x00\x05",
    ],
)
def test_unpack_rejects_ext_types(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed msgpack"):
        codec.unpack(data)


def test_unpack_rejects_non_string_map_keys() -> None:
    data = msgpack.packb({1: "a"})
    with pytest.raises(ProtocolError):
        codec.unpack(data)


def test_unpack_size_limit() -> None:
    ok = codec.pack(b"x" * (codec.MAX_META_BYTES - 3))  # bin 16: 3 header bytes
    assert len(ok) == codec.MAX_META_BYTES
    assert codec.unpack(ok) == b"x" * (codec.MAX_META_BYTES - 3)
    too_big = codec.pack(b"x" * (codec.MAX_META_BYTES - 2))
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.unpack(too_big)
    assert len(codec.unpack(too_big, max_bytes=len(too_big))) == codec.MAX_META_BYTES - 2


def test_unpack_custom_limit() -> None:
    data = codec.pack("hello")
    with pytest.raises(ProtocolError, match="exceeds 3"):
        codec.unpack(data, max_bytes=3)


@pytest.mark.parametrize(
    ("dtype", "name"), [(">f4", "float32"), (">i8", "int64"), (">u2", "uint16")]
)
def test_wire_dtype_names_big_endian_types_senders_convert(dtype: str, name: str) -> None:
    # The wire is little-endian; a big-endian array is named by its type and converted.
    assert codec.wire_dtype(np.dtype(dtype)) == name
