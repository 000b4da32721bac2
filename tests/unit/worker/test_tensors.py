"""worker/tensors.py: stacking request frames into batch arrays, slicing replies."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool.common.errors import ProtocolError
from carpool.common.protocol import (
    BatchItem,
    BatchMeta,
    Command,
    ReplyMeta,
    TensorMeta,
    check_frame_sizes,
    decode_meta,
    encode_reply,
    is_simple_form,
    parse_header,
)
from carpool.common.protocol import frames as codec
from carpool.worker.engines.base import Array
from carpool.worker.tensors import replies, stack

INPUTS = (TensorMeta("x", "float32", (-1, 3)), TensorMeta("mask", "uint8", (-1, 2)))


def batch(*items: tuple[int, int, bool]) -> BatchMeta:
    return BatchMeta(
        11, "m", INPUTS, tuple(BatchItem(rid, n, simple, 2.5) for rid, n, simple in items)
    )


def frames_for(rid: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 100 * rid
    mask = np.full((n, 2), rid, dtype=np.uint8)
    return x, mask


# --------------------------------------------------------------------------- stack


def test_stack_concatenates_in_request_order() -> None:
    b = batch((1, 1, False), (2, 2, False), (3, 1, True))
    parts = [frames_for(rid, n) for rid, n, _ in ((1, 1, 0), (2, 2, 0), (3, 1, 0))]
    frames = [a.tobytes() for pair in parts for a in pair]  # request-major
    arrays = stack(b, frames)
    assert list(arrays) == ["x", "mask"]
    assert arrays["x"].shape == (4, 3)
    assert arrays["x"].dtype == np.float32
    assert arrays["mask"].shape == (4, 2)
    np.testing.assert_array_equal(arrays["x"], np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(arrays["mask"][:, 0], [1, 2, 2, 3])


def test_single_request_is_zero_copy() -> None:
    b = batch((5, 2, False))
    x, mask = frames_for(5, 2)
    xbuf, mbuf = bytearray(x.tobytes()), bytearray(mask.tobytes())
    arrays = stack(b, [xbuf, memoryview(mbuf)])
    np.testing.assert_array_equal(arrays["x"], x)
    # The arrays are views of the frames: a change in the frame shows through.
    xbuf[0:4] = np.float32(-1).tobytes()
    mbuf[0] = 42
    assert arrays["x"][0, 0] == -1
    assert arrays["mask"][0, 0] == 42


def test_several_requests_are_copied_once() -> None:
    b = batch((1, 1, False), (2, 1, False))
    bufs = [bytearray(a.tobytes()) for rid in (1, 2) for a in frames_for(rid, 1)]
    arrays = stack(b, bufs)
    bufs[0][0:4] = np.float32(-1).tobytes()
    assert arrays["x"][0, 0] == 100.0


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([bytes(12), bytes(2)], "2 frames for 2 requests"),
        ([bytes(12), bytes(2), bytes(12)], "3 frames for 2 requests"),
        ([bytes(12), bytes(2), bytes(12), bytes(3)], "needs 2 bytes, frame has 3"),
        ([bytes(11), bytes(2), bytes(12), bytes(2)], "needs 12 bytes, frame has 11"),
    ],
)
def test_stack_rejects_bad_frames(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        stack(batch((1, 1, False), (2, 1, False)), frames)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([bytes(24)], "1 frames for 1 requests"),
        ([bytes(24), bytes(3)], "needs 4 bytes, frame has 3"),
        ([bytes(23), bytes(4)], "needs 24 bytes, frame has 23"),
    ],
)
def test_stack_rejects_bad_frames_of_one_request(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        stack(batch((1, 2, False)), frames)


def test_each_input_list_gets_its_own_layout() -> None:
    """The per-input-list layout is cached: another list, even of the same names, is
    read with its own dtypes and shapes."""
    data = np.arange(6, dtype=np.uint8).tobytes()
    for dtype, shape, expected in (
        ("uint8", (-1, 6), np.arange(6, dtype=np.uint8).reshape(1, 6)),
        ("uint16", (-1, 3), np.frombuffer(data, np.uint16).reshape(1, 3)),
        ("uint8", (-1, 3, 2), np.arange(6, dtype=np.uint8).reshape(1, 3, 2)),
    ):
        b = BatchMeta(1, "m", (TensorMeta("x", dtype, shape),), (BatchItem(1, 1, False, 0.0),))
        for _ in range(2):
            out = stack(b, [data])["x"]
            assert out.dtype == expected.dtype
            np.testing.assert_array_equal(out, expected)


# --------------------------------------------------------------------------- replies


def decode_framed(frames: list[Any]) -> tuple[ReplyMeta, dict[str, np.ndarray]]:
    assert parse_header(frames[0]) is Command.REPLY
    meta = ReplyMeta.from_wire(decode_meta(frames[1]))
    arrays = {
        t.name: np.frombuffer(bytes(memoryview(p)), codec.numpy_dtype(t.dtype)).reshape(t.shape)
        for t, p in zip(meta.outputs, frames[2:], strict=True)
    }
    return meta, arrays


def test_replies_slice_rows_per_request() -> None:
    b = batch((1, 1, False), (2, 2, False), (3, 1, False))
    y = np.arange(8, dtype=np.float32).reshape(4, 2)
    z = np.array([10, 20, 30, 40], dtype=np.int64)
    counts, frames = replies(b, {"y": y, "z": z, "ignored": y}, ["y", "z"], 12.5)
    assert counts == [4, 4, 4]  # header, meta, two outputs
    assert len(frames) == 12
    rows = {1: slice(0, 1), 2: slice(1, 3), 3: slice(3, 4)}
    for i, rid in enumerate((1, 2, 3)):
        meta, arrays = decode_framed(frames[4 * i : 4 * i + 4])
        assert meta.request_id == rid
        assert [t.name for t in meta.outputs] == ["y", "z"]
        assert meta.batch_size == 4
        assert meta.queue_ms == 2.5
        assert meta.compute_ms == 12.5
        np.testing.assert_array_equal(arrays["y"], y[rows[rid]])
        np.testing.assert_array_equal(arrays["z"], z[rows[rid]])


def test_framed_replies_are_exactly_what_encode_reply_gives() -> None:
    """The per-request reply meta is built inline for speed; it must stay byte-identical
    to ReplyMeta.to_wire through encode_reply."""
    b = batch((1, 1, False), (2, 2, False))
    y = np.arange(6, dtype=np.float32).reshape(3, 2)
    z = np.array([[1], [2], [3]], dtype=np.int16)
    _, frames = replies(b, {"y": y, "z": z}, ["y", "z"], 12.34567)
    start = 0
    for item in b.items:
        rows = slice(start, start + item.samples)
        start += item.samples
        expected = encode_reply(
            ReplyMeta(
                item.request_id,
                (
                    TensorMeta("y", "float32", (item.samples, 2)),
                    TensorMeta("z", "int16", (item.samples, 1)),
                ),
                3,
                item.queue_ms,
                12.34567,
            ),
            [y[rows], z[rows]],
            simple=False,
        )
        got, frames = frames[:4], frames[4:]
        assert got[:2] == expected[:2]
        assert [bytes(memoryview(f)) for f in got[2:]] == [
            bytes(memoryview(f)) for f in expected[2:]
        ]


def test_replies_follow_output_names_order() -> None:
    b = batch((1, 2, False))
    out: dict[str, Array] = {"a": np.zeros((2, 1), np.float32), "b": np.ones((2,), np.uint8)}
    _, frames = replies(b, out, ["b", "a"], 1.0)
    meta, _ = decode_framed(frames)
    assert [t.name for t in meta.outputs] == ["b", "a"]


def test_simple_form_replies_are_one_frame() -> None:
    b = batch((1, 1, True), (2, 2, False))
    y = np.arange(6, dtype=np.float32).reshape(3, 2)
    counts, frames = replies(b, {"y": y}, ["y"], 3.0)
    assert counts == [1, 3]
    assert is_simple_form(frames[0])
    obj = codec.unpack(frames[0], max_bytes=codec.MAX_SIMPLE_BYTES)
    assert obj["v"] == 1
    assert obj["id"] == 1
    assert obj["batch_size"] == 3
    (out,) = obj["outputs"]
    assert (out["name"], out["dtype"], out["shape"]) == ("y", "float32", [1, 2])
    assert out["data"] == y[0:1].tobytes()
    meta, arrays = decode_framed(frames[1:])
    assert meta.request_id == 2
    np.testing.assert_array_equal(arrays["y"], y[1:3])


def test_outputs_go_out_little_endian_and_c_ordered() -> None:
    b = batch((1, 2, False))
    big = np.array([[1, 2, 3], [4, 5, 6]], dtype=">i4")
    fortran = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    _, frames = replies(b, {"big": big, "f": fortran}, ["big", "f"], 1.0)
    meta, arrays = decode_framed(frames)
    assert [t.dtype for t in meta.outputs] == ["int32", "float64"]
    assert frames[2].tobytes() == np.array([[1, 2, 3], [4, 5, 6]], dtype="<i4").tobytes()
    np.testing.assert_array_equal(arrays["big"], big)
    np.testing.assert_array_equal(arrays["f"], fortran)


@pytest.mark.parametrize(
    "bad",
    [np.zeros((3, 2), np.float32), np.zeros((5,), np.float32), np.float32(1.0), np.zeros((0, 2))],
    ids=["short", "long", "scalar", "empty"],
)
def test_wrong_output_dim_0_raises(bad: Any) -> None:
    b = batch((1, 1, False), (2, 3, False))
    with pytest.raises(ProtocolError, match="expected dim 0 = 4"):
        replies(b, {"y": bad}, ["y"], 1.0)


def test_stacked_batches_are_writable_for_engines_that_work_in_place() -> None:
    b = batch((1, 1, False), (2, 1, False))
    frames = [a.tobytes() for rid in (1, 2) for a in frames_for(rid, 1)]
    arrays = stack(b, frames)
    assert arrays["x"].flags.writeable
    arrays["x"] /= 2  # an engine normalising its input in place
    np.testing.assert_array_equal(arrays["x"][1], (np.arange(3) + 200) / 2)


def test_an_empty_output_no_client_could_shape_fails_the_batch() -> None:
    """numpy builds (2, 0, 2**50) float32; its span without the zero is past §14's limit."""
    b = batch((1, 2, False))
    empty = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (2, 0, 2**50), (0, 0, 0))
    with pytest.raises(ProtocolError, match="at most"):
        replies(b, {"y": empty}, ["y"], 1.0)


def test_outputs_of_rank_over_8_fail_the_batch() -> None:
    """Protocol v1 carries ranks 1..8 (§5.1). Sent as replies, the clients could not read
    them, so the batch fails here (the worker answers FAILED, INTERNAL, with this
    reason)."""
    b = batch((1, 1, False), (2, 2, False))
    with pytest.raises(ProtocolError, match=r"rank 1\.\.8"):
        replies(b, {"boxes": np.zeros((3,) + (1,) * 8, np.float32)}, ["boxes"], 1.0)


@pytest.mark.parametrize("simple", [False, True], ids=["framed", "simple"])
@pytest.mark.parametrize("items", [((1, 1),), ((1, 1), (2, 2))], ids=["one", "two"])
def test_a_detector_that_found_nothing_answers_empty_arrays(
    items: tuple[tuple[int, int], ...], simple: bool
) -> None:
    """(n, 0, 6): zero-size dims after dim 0 are carried (§5.1), as empty frames."""
    b = batch(*((rid, n, simple) for rid, n in items))
    total = sum(n for _, n in items)
    counts, frames = replies(b, {"boxes": np.zeros((total, 0, 6), np.float32)}, ["boxes"], 1.0)
    assert len(counts) == len(items)
    at = 0
    for (rid, n), count in zip(items, counts, strict=True):
        message = frames[at : at + count]
        at += count
        if simple:
            (frame,) = message
            meta = codec.unpack(frame)
            (out,) = meta["outputs"]
            assert out["shape"] == [n, 0, 6]
            assert bytes(out["data"]) == b""
            continue
        reply = ReplyMeta.from_wire(codec.unpack(message[1]))
        assert reply.request_id == rid
        assert reply.outputs[0].shape == (n, 0, 6)
        wire = [bytes(memoryview(f)) for f in message[2:]]  # as the socket sends them
        check_frame_sizes(reply.outputs, wire)
        assert wire == [b""]


def test_an_output_dtype_the_wire_cannot_carry_fails_the_batch() -> None:
    """complex64 is not a wire dtype: the batch fails here (the worker answers FAILED,
    INTERNAL) instead of every client receiving a reply it must refuse."""
    b = batch((1, 1, False))
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        replies(b, {"y": np.zeros((1, 2), np.complex64)}, ["y"], 1.0)
