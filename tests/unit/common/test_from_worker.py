"""decode_from_worker: every message a worker may send, as one typed union."""

from __future__ import annotations

import pytest

from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Command,
    FailedMeta,
    ModelSpec,
    Ready,
    ResultMeta,
    TensorMeta,
    ToBroker,
    WorkerDisconnect,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerMalformed,
    WorkerReady,
    WorkerResult,
    checked_from_worker,
    decode_from_worker,
    encode,
    header,
)
from carpool.common.protocol import frames as codec

SPEC = ModelSpec(
    "m", (TensorMeta("x", "float32", (-1, 2)),), (TensorMeta("y", "float32", (-1, 2)),), 8
)
READY = Ready("w", 2, (SPEC,), 500)


def test_ready_decodes_to_its_spec() -> None:
    assert decode_from_worker(encode(Command.READY, READY.to_wire())) == WorkerReady(READY)


def test_a_result_keeps_its_reply_frames_as_they_arrived() -> None:
    replies = [memoryview(b"r1"), bytearray(b"r2"), b"r3"]
    meta = ResultMeta(4, 0.5, 2.0, (1, 2))
    msg = decode_from_worker([*encode(Command.RESULT, meta.to_wire()), *replies])
    assert isinstance(msg, WorkerResult)
    assert msg.result == meta
    assert len(msg.replies) == 3
    assert all(a is b for a, b in zip(msg.replies, replies, strict=True))


def test_an_embedded_workers_message_is_taken_as_is_but_for_a_results_frame_counts() -> None:
    result = WorkerResult(ResultMeta(4, 0.5, 2.0, (1,)), [b"r"])
    assert checked_from_worker(result) is result
    beat = WorkerHeartbeat(0.5)
    assert checked_from_worker(beat) is beat
    assert checked_from_worker(WorkerResult(ResultMeta(4, 0, 1, (0,)), [])) == (
        WorkerMalformed(None, "result: frames must be a list of ints >= 1")
    )


@pytest.mark.parametrize(
    "msg",
    [
        WorkerReady(READY),
        WorkerResult(ResultMeta(4, 0.5, 2.0, (2, 1)), [b"a", b"b", b"c"]),
        WorkerFailed(FailedMeta(3, ErrorCode.INTERNAL, "boom", 0.25)),
        WorkerHeartbeat(0.25),
        WorkerHeartbeat(None),
        WorkerHeartbeat(0.25, 1500),
        WorkerHeartbeat(None, 0),
        WorkerDisconnect("bye"),
    ],
)
def test_each_message_decodes_back_from_its_frames(msg: ToBroker) -> None:
    assert decode_from_worker(msg.to_frames()) == msg


def test_failed_heartbeat_and_disconnect() -> None:
    failed = FailedMeta(3, ErrorCode.INTERNAL, "boom", 0.25)
    assert decode_from_worker(encode(Command.FAILED, failed.to_wire())) == WorkerFailed(failed)
    assert decode_from_worker(encode(Command.HEARTBEAT, {"rho": 0.5})) == WorkerHeartbeat(0.5)
    assert decode_from_worker(encode(Command.DISCONNECT, {"reason": "bye"})) == WorkerDisconnect(
        "bye"
    )


@pytest.mark.parametrize("rho", [None, True, -0.1, 1.5, "0.5"])
def test_a_heartbeat_without_a_load_in_range_carries_none(rho: object) -> None:
    meta = {} if rho is None else {"rho": rho}
    assert decode_from_worker(encode(Command.HEARTBEAT, meta)) == WorkerHeartbeat(None)


@pytest.mark.parametrize("busy_ms", [None, True, -1, 1.5, "10"])
def test_a_heartbeat_without_a_valid_busy_time_carries_none(busy_ms: object) -> None:
    """An absent or invalid busy_ms (an older worker's HEARTBEAT) is None: no report."""
    meta = {"rho": 0.5} if busy_ms is None else {"rho": 0.5, "busy_ms": busy_ms}
    assert decode_from_worker(encode(Command.HEARTBEAT, meta)) == WorkerHeartbeat(0.5, None)


def test_a_heartbeat_with_a_busy_time_and_no_load() -> None:
    meta = {"busy_ms": 42}
    assert decode_from_worker(encode(Command.HEARTBEAT, meta)) == WorkerHeartbeat(None, 42)


def test_a_message_broken_whoever_sent_it_has_no_command() -> None:
    for frames in (
        [header(Command.READY)],  # no meta frame
        [b"junk", codec.pack({})],  # no header
        [header(Command.HEARTBEAT), b"\xc1"],  # no msgpack
        encode(Command.READY, {"name": "w"}),  # a READY without its fields
    ):
        msg = decode_from_worker(frames)
        assert isinstance(msg, WorkerMalformed)
        assert msg.command is None


def test_a_broken_result_or_failed_and_a_command_not_for_workers_keep_their_command() -> None:
    bad_result = decode_from_worker(encode(Command.RESULT, {"batch": 1, "frames": [0]}))
    assert bad_result == WorkerMalformed(
        Command.RESULT, "result: frames must be a list of ints >= 1"
    )
    bad_failed = decode_from_worker(encode(Command.FAILED, {"code": 1}))
    assert isinstance(bad_failed, WorkerMalformed)
    assert bad_failed.command is Command.FAILED
    batch = decode_from_worker(encode(Command.BATCH, {}))
    assert batch == WorkerMalformed(Command.BATCH, "command BATCH is not valid from a worker")
