"""Shared-memory inputs at the worker (protocol §5.4): stack reads them from real
/dev/shm regions into the batch; a request whose region cannot be read gets its own
error and the rest of its batch runs."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.common.clock import MonotonicClock
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import BatchItem, BatchMeta, Command, TensorMeta, parse_header
from carpool.common.protocol import frames as codec
from carpool.common.shm import HEADER_BYTES, RegionReader, ShmArena, ShmRef
from carpool.common.shm import available as shm_available
from carpool.worker.core import RunBatch
from carpool.worker.engines.base import Array
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.run import run_job
from carpool.worker.tensors import ItemError, stack

pytestmark = pytest.mark.skipif(not shm_available(), reason="no usable /dev/shm")

INPUTS = (TensorMeta("x", "float32", (-1, 3)),)


@pytest.fixture
def arena() -> Iterator[ShmArena]:
    a = ShmArena(1 << 16)
    yield a
    a.close()


@pytest.fixture
def reader() -> Iterator[RegionReader]:
    r = RegionReader()
    yield r
    r.close()


def rows(rid: int, n: int) -> np.ndarray:
    return (np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 100 * rid).astype(np.float32)


KEY = "77" * 16


def put(arena: ShmArena, arr: np.ndarray) -> tuple[str, int, str]:
    off = arena.put(arr.reshape(-1).view(np.uint8).data)
    assert off is not None
    return arena.name, off, arena.key


def test_a_single_shared_request_is_read_into_a_writable_batch(
    arena: ShmArena, reader: RegionReader
) -> None:
    x = rows(1, 2)
    meta = BatchMeta(1, "m", INPUTS, (BatchItem(1, 2, False, 0.0, (put(arena, x),)),))
    out = stack(meta, [b""], reader)
    np.testing.assert_array_equal(out["x"], x)
    out["x"][0, 0] = -1  # a copy of its own: the client's region is not written
    assert np.frombuffer(Path(arena.path).read_bytes(), np.float32, 6, HEADER_BYTES)[0] == x[0, 0]


def test_shared_and_inline_requests_stack_in_order(arena: ShmArena, reader: RegionReader) -> None:
    a, b, c = rows(1, 1), rows(2, 2), rows(3, 1)
    items = (
        BatchItem(1, 1, False, 0.0),
        BatchItem(2, 2, False, 0.0, (put(arena, b),)),
        BatchItem(3, 1, False, 0.0),
    )
    out = stack(BatchMeta(1, "m", INPUTS, items), [a.tobytes(), b"", c.tobytes()], reader)
    np.testing.assert_array_equal(out["x"], np.concatenate([a, b, c]))


def test_a_shared_request_without_a_reader_fails_the_batch() -> None:
    meta = BatchMeta(1, "m", INPUTS, (BatchItem(1, 1, False, 0.0, (("carpool-x", 64, KEY),)),))
    with pytest.raises(ProtocolError, match="shared-memory"):
        stack(meta, [b""])


def test_a_shared_input_with_bytes_in_its_frame_fails_the_batch(reader: RegionReader) -> None:
    meta = BatchMeta(1, "m", INPUTS, (BatchItem(1, 1, False, 0.0, (("carpool-x", 64, KEY),)),))
    with pytest.raises(ProtocolError, match="must be empty"):
        stack(meta, [rows(1, 1).tobytes()], reader)


def test_unreadable_regions_name_the_request(arena: ShmArena, reader: RegionReader) -> None:
    items: tuple[BatchItem, ...] = (
        BatchItem(1, 1, False, 0.0),
        BatchItem(2, 1, False, 0.0, (("carpool-gone-0", 64, KEY),)),
    )
    with pytest.raises(ItemError) as info:
        stack(BatchMeta(1, "m", INPUTS, items), [rows(1, 1).tobytes(), b""], reader)
    assert (info.value.index, info.value.code) == (1, ErrorCode.UNAVAILABLE)
    items = (BatchItem(1, 1, False, 0.0, ((arena.name, arena.size - 4, arena.key),)),)
    with pytest.raises(ItemError) as info:
        stack(BatchMeta(1, "m", INPUTS, items), [b""], reader)
    assert (info.value.index, info.value.code) == (0, ErrorCode.INVALID_ARGUMENT)


def reply_of(frames: list[Any]) -> tuple[Command, dict[str, Any], list[Any]]:
    return parse_header(bytes(frames[0])), codec.unpack(bytes(frames[1])), frames[2:]


def test_one_bad_reference_does_not_fail_the_rest_of_the_batch(
    arena: ShmArena, reader: RegionReader
) -> None:
    engine = SyntheticEngine(item_shape=(3,))
    seen: list[tuple[int, ...]] = []
    run = engine.run

    def run_and_note_shape(inputs: Mapping[str, Array]) -> dict[str, Array]:
        seen.append(inputs["x"].shape)
        return run(inputs)

    engine.run = run_and_note_shape  # type: ignore[method-assign]
    good = [rows(1, 1), rows(3, 2), rows(5, 1)]
    items = (
        BatchItem(1, 1, False, 0.0),
        BatchItem(2, 1, False, 0.0, (("carpool-gone-0", 64, KEY),)),
        BatchItem(3, 2, False, 0.0, (put(arena, good[1]),)),
        BatchItem(4, 1, False, 0.0, ((arena.name, arena.size - 8, arena.key),)),  # runs off the end
        BatchItem(5, 1, False, 0.0),
    )
    frames = [good[0].tobytes(), b"", b"", b"", good[2].tobytes()]
    outcome = run_job(
        {"m": engine},
        RunBatch(1, BatchMeta(9, "m", INPUTS, items), frames),
        MonotonicClock(),
        reader,
    )
    out = list(outcome.frames)
    assert outcome.error is None
    assert seen == [(4, 3)]  # the engine ran once, on the three readable requests
    assert len(outcome.counts) == 5
    assert sum(outcome.counts) == len(out)
    replies = []
    pos = 0
    for k in outcome.counts:
        replies.append(reply_of(out[pos : pos + k]))
        pos += k
    assert [(cmd, meta["id"]) for cmd, meta, _ in replies] == [
        (Command.REPLY, 1),
        (Command.ERROR, 2),
        (Command.REPLY, 3),
        (Command.ERROR, 4),
        (Command.REPLY, 5),
    ]
    assert replies[1][1]["code"] == int(ErrorCode.UNAVAILABLE)
    assert "one host" in replies[1][1]["message"]
    assert replies[3][1]["code"] == int(ErrorCode.INVALID_ARGUMENT)
    for (_, meta, payloads), x in zip([replies[0], replies[2], replies[4]], good, strict=True):
        assert meta["batch_size"] == 4
        y = np.frombuffer(bytes(payloads[0]), np.float32).reshape(x.shape)
        np.testing.assert_array_equal(y, synthetic_output(x))


def test_a_batch_of_only_unreadable_requests_answers_each(reader: RegionReader) -> None:
    engine = SyntheticEngine(item_shape=(3,))
    items = tuple(BatchItem(i, 1, False, 0.0, (("carpool-gone-0", 64, KEY),)) for i in (1, 2))
    outcome = run_job(
        {"m": engine},
        RunBatch(1, BatchMeta(9, "m", INPUTS, items), [b"", b""]),
        MonotonicClock(),
        reader,
    )
    out = list(outcome.frames)
    assert outcome.counts == [2, 2]
    assert [reply_of(out[i : i + 2])[1]["id"] for i in (0, 2)] == [1, 2]
    # The engine did not run: a few microseconds for the batch would teach the broker's
    # cost model a near-zero cost.
    assert not outcome.timed


def test_a_claimed_size_is_checked_before_anything_is_allocated(
    arena: ShmArena, reader: RegionReader
) -> None:
    """A reference that claims more bytes than its region holds is answered on its own,
    before a batch buffer of the claimed size exists (2**40 floats here)."""
    engine = SyntheticEngine(item_shape=(-1,), max_batch=4)
    inputs = (TensorMeta("x", "float32", (-1, 2**40)),)
    items = (BatchItem(1, 1, False, 0.0, ((arena.name, HEADER_BYTES, arena.key),)),)
    outcome = run_job(
        {"m": engine},
        RunBatch(1, BatchMeta(1, "m", inputs, items), [b""]),
        MonotonicClock(),
        reader,
    )
    out = list(outcome.frames)
    assert outcome.error is None
    cmd, meta, _ = reply_of(out)
    assert (cmd, meta["code"]) == (Command.ERROR, int(ErrorCode.INVALID_ARGUMENT))
    assert "ends before" in meta["message"]


def test_bad_references_are_found_in_one_pass(arena: ShmArena, reader: RegionReader) -> None:
    """k good and k bad references: each good one is read once, not once per bad one."""
    engine = SyntheticEngine(item_shape=(4,), max_batch=64)
    reads: list[ShmRef] = []
    read_into = reader.read_into

    def note_and_read_into(ref: ShmRef, dest: memoryview) -> None:
        reads.append(ref)
        read_into(ref, dest)

    reader.read_into = note_and_read_into  # type: ignore[method-assign]
    k = 8
    good = [BatchItem(i, 1, False, 0.0, (put(arena, rows(i, 1)),)) for i in range(k)]
    bad = [BatchItem(100 + i, 1, False, 0.0, (("carpool-gone-0", 64, KEY),)) for i in range(k)]
    items = tuple(x for pair in zip(good, bad, strict=True) for x in pair)
    outcome = run_job(
        {"m": engine},
        RunBatch(1, BatchMeta(1, "m", INPUTS, items), [b""] * 2 * k),
        MonotonicClock(),
        reader,
    )
    assert outcome.error is None
    assert len(reads) == k
    assert outcome.counts == [3, 2] * k  # REPLY (header, meta, y) and ERROR, alternating


# --------------------------------------------------------------------------- outputs (§5.5)


def test_large_outputs_of_requests_that_ask_go_into_the_ring(reader: RegionReader) -> None:
    from carpool.common.shm import ShmRing
    from carpool.worker.tensors import SHM_OUTPUT_MIN_BYTES, replies

    ring = ShmRing(1 << 20)
    try:
        width = SHM_OUTPUT_MIN_BYTES // 4  # float32: exactly the threshold per sample
        y = np.arange(3 * width, dtype=np.float32).reshape(3, width)
        small = np.arange(3, dtype=np.float32).reshape(3, 1)
        items = (
            BatchItem(1, 1, False, 0.0, None, True),  # asks: y through the ring
            BatchItem(2, 1, False, 0.0),  # does not ask
            BatchItem(3, 1, True, 0.0, None, True),  # simple form: never
        )
        meta = BatchMeta(1, "m", INPUTS, items)
        counts, frames = replies(meta, {"y": y, "s": small}, ["y", "s"], 1.0, ring)
        assert counts == [4, 4, 1]
        cmd, first, payloads = reply_of(frames[:4])
        assert cmd is Command.REPLY
        ref = first["outputs"][0]["shm"]
        assert "shm" not in first["outputs"][1]  # 4 bytes: in its frame
        assert bytes(payloads[0]) == b""
        assert bytes(payloads[1]) == small[:1].tobytes()
        dest = np.empty((1, width), np.float32)
        reader.read_output(
            (ref["region"], ref["offset"], ref["key"], ref["seq"]),
            dest.reshape(-1).view(np.uint8).data,
        )
        np.testing.assert_array_equal(dest, y[:1])
        _, second, payloads = reply_of(frames[4:8])
        assert "shm" not in second["outputs"][0]
        assert bytes(payloads[0]) == y[1:2].tobytes()
    finally:
        ring.close()


def test_outputs_go_in_frames_when_the_ring_is_busy(reader: RegionReader) -> None:
    import fcntl
    import struct

    from carpool.common.shm import ShmRing
    from carpool.worker.tensors import replies

    ring = ShmRing(1 << 20)
    fd = os.open(ring.path, os.O_RDONLY)
    try:
        # A client holds the header (reading it, or misbehaving): the worker does not wait.
        fcntl.fcntl(
            fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_RDLCK, 0, 0, HEADER_BYTES, 0)
        )
        y = np.ones((1, 1 << 16), np.float32)
        meta = BatchMeta(1, "m", INPUTS, (BatchItem(1, 1, False, 0.0, None, True),))
        _, frames = replies(meta, {"y": y}, ["y"], 1.0, ring)
        _, reply, payloads = reply_of(frames)
        assert "shm" not in reply["outputs"][0]
        assert np.asarray(payloads[0]).tobytes() == y.tobytes()
    finally:
        os.close(fd)
        ring.close()


def test_a_batch_never_writes_over_its_own_outputs(reader: RegionReader) -> None:
    """Three 400 KiB outputs in a 1 MiB ring: the third would come round over the first
    before either reply is sent, so it goes in its frame; every reference is readable."""
    from carpool.common.shm import ShmRing
    from carpool.worker.tensors import replies

    ring = ShmRing(1 << 20)
    try:
        width = 400 * 1024 // 4
        y = np.arange(3 * width, dtype=np.float32).reshape(3, width)
        items = tuple(BatchItem(i, 1, False, 0.0, None, True) for i in (1, 2, 3))
        counts, frames = replies(BatchMeta(1, "m", INPUTS, items), {"y": y}, ["y"], 1.0, ring)
        in_ring = []
        pos = 0
        for i, k in enumerate(counts):
            _, meta, payloads = reply_of(frames[pos : pos + k])
            pos += k
            ref = meta["outputs"][0].get("shm")
            in_ring.append(ref is not None)
            got = np.empty((1, width), np.float32)
            if ref is None:
                got[:] = np.frombuffer(bytes(payloads[0]), np.float32).reshape(1, width)
            else:
                reader.read_output(
                    (ref["region"], ref["offset"], ref["key"], ref["seq"]),
                    got.reshape(-1).view(np.uint8).data,
                )
            np.testing.assert_array_equal(got, y[i : i + 1])
        assert in_ring == [True, True, False]
    finally:
        ring.close()


# --------------------------------------------------------------------------- a failed batch


class FailsTogether(SyntheticEngine):
    """Runs one request at a time; a batch of more samples fails, as a batch holding one
    bad index does."""

    def run(self, inputs: Any) -> Any:
        if inputs["x"].shape[0] > 1:
            raise RuntimeError("a bad index somewhere in the batch")
        return super().run(inputs)


def test_a_failed_batch_run_again_one_by_one_puts_outputs_in_frames(
    reader: RegionReader,
) -> None:
    """Run request by request, each reply carries its outputs in its frames, not in the
    ring, where a later reply's outputs could write over an earlier one's, still unsent."""
    from carpool.worker.run import LazyRing
    from carpool.worker.tensors import SHM_OUTPUT_MIN_BYTES

    width = SHM_OUTPUT_MIN_BYTES // 4
    engine = FailsTogether(item_shape=(width,))
    rings = LazyRing(3 * SHM_OUTPUT_MIN_BYTES, 0o600)
    try:
        inputs = (TensorMeta("x", "float32", (-1, width)),)
        items = tuple(BatchItem(i, 1, False, 0.0, None, True) for i in (1, 2, 3))
        xs = [np.full((1, width), i, np.float32) for i in (1, 2, 3)]
        outcome = run_job(
            {"m": engine},
            RunBatch(1, BatchMeta(1, "m", inputs, items), [x.tobytes() for x in xs]),
            MonotonicClock(),
            reader,
            rings,
        )
        out = list(outcome.frames)
        assert outcome.counts == [3, 3, 3]  # header, meta, y: each in its frames
        assert not outcome.timed  # nothing for the cost models to learn from
        assert outcome.samples == 0
        for i, x in enumerate(xs):
            _, meta, payloads = reply_of(out[3 * i : 3 * i + 3])
            assert "shm" not in meta
            y = np.frombuffer(bytes(payloads[0]), np.float32).reshape(x.shape)
            np.testing.assert_array_equal(y, synthetic_output(x))
    finally:
        rings.close()


def test_the_one_request_left_after_unreadable_ones_keeps_their_answers(
    reader: RegionReader,
) -> None:
    """The engine failing on the one request left does not fail the whole batch: the
    unreadable request keeps its own (retryable) UNAVAILABLE, the other gets INTERNAL."""
    engine = SyntheticEngine(item_shape=(3,))
    engine.run = lambda inputs: (_ for _ in ()).throw(RuntimeError("broken"))  # type: ignore[method-assign]
    items = (
        BatchItem(1, 1, False, 0.0, (("carpool-gone-0", 64, KEY),)),
        BatchItem(2, 1, False, 0.0),
    )
    outcome = run_job(
        {"m": engine},
        RunBatch(1, BatchMeta(9, "m", INPUTS, items), [b"", rows(2, 1).tobytes()]),
        MonotonicClock(),
        reader,
    )
    out = list(outcome.frames)
    assert outcome.error is None
    first, second = reply_of(out[:2]), reply_of(out[2:])
    assert (first[0], first[1]["id"], first[1]["code"]) == (
        Command.ERROR,
        1,
        int(ErrorCode.UNAVAILABLE),
    )
    assert (second[0], second[1]["id"], second[1]["code"]) == (
        Command.ERROR,
        2,
        int(ErrorCode.INTERNAL),
    )
