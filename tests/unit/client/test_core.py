"""client/core.py: ClientCore request encoding, reply decoding and local deadlines."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from carpool.client.core import ClientCore
from carpool.client.options import ClientOptions
from carpool.client.results import InferResult
from carpool.common.errors import (
    DeadlineExceeded,
    ErrorCode,
    InternalError,
    InvalidArgument,
    NotFound,
    Overloaded,
    ProtocolError,
    RequestError,
    Unavailable,
    UnsupportedVersion,
)
from carpool.common.protocol import (
    Command,
    ErrorReply,
    Priority,
    ReplyMeta,
    Submit,
    TensorMeta,
    decode_meta,
    decode_submit,
    encode,
    encode_error,
    encode_reply,
    encode_request,
    header,
    parse_header,
)
from carpool.common.protocol import frames as codec

if TYPE_CHECKING:
    from carpool.common.shm import ShmRing

T0 = 100.0


def submit_of(frames: list[Any]) -> Submit:
    assert parse_header(frames[0]) is Command.REQUEST
    return decode_submit(decode_meta(frames[1]))


def reply_frames(rid: int, **arrays: np.ndarray) -> list[Any]:
    outputs = tuple(TensorMeta(n, codec.wire_dtype(a.dtype), a.shape) for n, a in arrays.items())
    meta = ReplyMeta(rid, outputs, batch_size=8, queue_ms=1.5, compute_ms=4.25)
    return encode_reply(meta, [a.tobytes() for a in arrays.values()], simple=False)


def error_frames(rid: int | None, code: int, retry_after_ms: int | None = None) -> list[Any]:
    meta: dict[str, Any] = {"id": rid, "code": code, "message": "nope"}
    if retry_after_ms is not None:
        meta["retry_after_ms"] = retry_after_ms
    return encode(Command.ERROR, meta)


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("value", "dtype", "shape"),
    [
        ([[1.0, 2.0, 3.0]], "float64", (1, 3)),
        ([[1, 2], [3, 4]], "int64", (2, 2)),
        ([True, False], "bool", (2,)),
        (np.zeros((2, 3), np.float16), "float16", (2, 3)),
        (np.zeros((1, 2, 2, 1), np.uint8), "uint8", (1, 2, 2, 1)),
        (np.arange(4, dtype=np.int8), "int8", (4,)),
        (np.ones((3, 1), np.float32), "float32", (3, 1)),
    ],
)
def test_request_encodes_dtype_and_shape(value: Any, dtype: str, shape: tuple[int, ...]) -> None:
    c = ClientCore()
    rid, frames = c.request(T0, "m", {"x": value})
    submit = submit_of(frames)
    assert submit.inputs == (TensorMeta("x", dtype, shape),)
    assert len(frames) == 3
    payload = frames[2]
    expected = np.asarray(value, dtype=codec.numpy_dtype(dtype))
    assert bytes(memoryview(payload)) == expected.tobytes()
    assert rid == submit.request_id == 1


def test_request_makes_payloads_c_contiguous() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    views = {"strided": base[:, ::2], "fortran": np.asfortranarray(base), "t": base.T}
    _, frames = ClientCore().request(T0, "m", views)
    submit = submit_of(frames)
    assert [t.name for t in submit.inputs] == ["strided", "fortran", "t"]
    for meta, payload, arr in zip(submit.inputs, frames[2:], views.values(), strict=True):
        assert meta.shape == arr.shape
        assert bytes(memoryview(payload)) == np.ascontiguousarray(arr).tobytes()
        assert len(memoryview(payload).cast("B")) == meta.nbytes


def test_request_meta_fields() -> None:
    c = ClientCore(default_timeout_s=2.5)
    _, frames = c.request(T0, "resnet", {"x": np.zeros((1, 2), np.float32)})
    submit = submit_of(frames)
    assert (submit.model, submit.timeout_ms, submit.priority) == ("resnet", 2500, Priority(0))
    _, frames = c.request(T0, "resnet", {"x": np.zeros((1, 2), np.float32)}, 0.25, Priority.BULK)
    submit = submit_of(frames)
    assert (submit.request_id, submit.timeout_ms, submit.priority) == (2, 250, Priority.BULK)


@pytest.mark.parametrize("priority", [Priority.INTERACTIVE, Priority.BULK])
def test_request_frames_are_exactly_what_encode_request_gives(priority: Priority) -> None:
    """The REQUEST meta is built inline for speed; it must stay byte-identical to
    Submit.to_wire through encode_request."""
    x = np.arange(6, dtype=">f4").reshape(3, 2)  # big-endian: converted on the way out
    m = np.ones((3,), np.uint8)
    core = ClientCore()
    rid, frames = core.request(T0, "m", {"x": x, "mask": m}, 0.5, priority)
    tensors = (TensorMeta("x", "float32", (3, 2)), TensorMeta("mask", "uint8", (3,)))
    submit = Submit(rid, "m", 500, tensors, priority, client=core.resend.nonce)
    expected = encode_request(submit, [x, m])
    assert frames[:2] == expected[:2]
    assert bytes(frames[2]) == x.astype("<f4").tobytes()
    assert bytes(frames[3]) == m.tobytes()


def test_request_ids_are_unique_and_shared_with_stats() -> None:
    c = ClientCore()
    ids = [c.request(T0, "m", {"x": [1]})[0] for _ in range(3)]
    sid, frames = c.queries.stats_request()
    assert ids == [1, 2, 3]
    assert sid == 4
    assert frames == encode(Command.STATS, {"id": 4})
    assert c.request(T0, "m", {"x": [1]})[0] == 5


@pytest.mark.parametrize(
    "inputs",
    [{"x": 1.0}, {"x": np.float32(2)}, {"x": np.array(3)}, {"x": [1.0], "y": 7}],
    ids=["float", "numpy-scalar", "0-d", "one-of-two"],
)
def test_scalars_are_rejected(inputs: dict[str, Any]) -> None:
    c = ClientCore()
    with pytest.raises(ValueError, match="scalar"):
        c.request(T0, "m", inputs)
    assert c.pending == {}
    assert c.request(T0, "m", {"x": [1.0]})[0] == 1  # no id was used up


@pytest.mark.parametrize(
    "inputs",
    [np.ones((1, 4), np.float32), [("x", np.ones((1, 4), np.float32))], None],
    ids=["bare-array", "pairs", "none"],
)
def test_inputs_that_are_not_a_mapping_say_so(inputs: Any) -> None:
    """A bare array or a list of pairs is refused with a TypeError that says what the
    call wants (not numpy's "truth value of an array is ambiguous" or an AttributeError)."""
    with pytest.raises(TypeError, match=r"inputs must map each input's name"):
        ClientCore().request(T0, "m", inputs)


def test_no_inputs_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one input"):
        ClientCore().request(T0, "m", {})


@pytest.mark.parametrize(
    "value",
    [
        np.zeros((1, 2), np.complex64),
        np.array([["a", "b"]]),
        np.array([[object()]], dtype=object),
        np.zeros((1,), dtype=[("a", "<f4")]),
        np.zeros((1, 2), np.float128) if hasattr(np, "float128") else np.zeros((1,), "V4"),
    ],
    ids=["complex", "str", "object", "record", "float128"],
)
def test_unsupported_dtypes_are_rejected(value: np.ndarray) -> None:
    c = ClientCore()
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        c.request(T0, "m", {"x": value})
    assert c.pending == {}


@pytest.mark.parametrize(
    ("timeout_s", "timeout_ms"),
    [(3600, 3_600_000), (0.0001, 1), (0.0015, 2), (1, 1000), (None, 10_000)],
)
def test_timeout_bounds(timeout_s: float | None, timeout_ms: int) -> None:
    _, frames = ClientCore().request(T0, "m", {"x": [1]}, timeout_s)
    assert submit_of(frames).timeout_ms == timeout_ms


@pytest.mark.parametrize("timeout_s", [0, -1, 3600.001, math.nan, math.inf])
def test_timeout_out_of_bounds(timeout_s: float) -> None:
    c = ClientCore()
    with pytest.raises(ValueError, match="timeout_s"):
        c.request(T0, "m", {"x": [1]}, timeout_s)
    assert c.pending == {}


# --------------------------------------------------------------------------- replies


def test_reply_decodes_into_infer_result() -> None:
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [[1.0]]})
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    z = np.array([True, False])
    got_id, result = c.on_reply(reply_frames(rid, y=y, z=z))
    assert got_id == rid
    assert isinstance(result, InferResult)
    assert list(result.outputs) == ["y", "z"]
    np.testing.assert_array_equal(result["y"], y)
    assert result["y"].dtype == np.float32
    np.testing.assert_array_equal(result["z"], z)
    assert (result.batch_size, result.queue_ms, result.compute_ms) == (8, 1.5, 4.25)
    assert c.pending == {}


def test_reply_accepts_memoryview_frames() -> None:
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    frames = [memoryview(bytes(f)) for f in reply_frames(rid, y=np.ones((1, 2), np.int16))]
    got_id, result = c.on_reply(frames)
    assert got_id == rid
    assert isinstance(result, InferResult)
    np.testing.assert_array_equal(result["y"], [[1, 1]])


ERROR_CLASSES = [
    (ErrorCode.INVALID_ARGUMENT, InvalidArgument),
    (ErrorCode.NOT_FOUND, NotFound),
    (ErrorCode.DEADLINE_EXCEEDED, DeadlineExceeded),
    (ErrorCode.OVERLOADED, Overloaded),
    (ErrorCode.UNAVAILABLE, Unavailable),
    (ErrorCode.INTERNAL, InternalError),
    (ErrorCode.UNSUPPORTED_VERSION, UnsupportedVersion),
    (99, InternalError),
]


@pytest.mark.parametrize(("code", "cls"), ERROR_CLASSES, ids=lambda v: str(v))
def test_error_reply_raises_the_right_class(code: int, cls: type[RequestError]) -> None:
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    got_id, exc = c.on_reply(error_frames(rid, int(code)))
    assert got_id == rid
    assert type(exc) is cls
    assert isinstance(exc, RequestError)
    assert exc.request_id == rid
    assert "nope" in exc.message
    assert c.pending == {}


def test_overloaded_carries_retry_after_seconds() -> None:
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    frames = encode_error(ErrorReply(rid, ErrorCode.OVERLOADED, "full", retry_after_ms=250))
    _, exc = c.on_reply(frames)
    assert isinstance(exc, Overloaded)
    assert exc.retry_after_s == 0.25
    rid, _ = c.request(T0, "m", {"x": [1]})
    _, exc = c.on_reply(error_frames(rid, int(ErrorCode.OVERLOADED)))
    assert isinstance(exc, Overloaded)
    assert exc.retry_after_s is None


def test_anonymous_error_names_no_request() -> None:
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    got_id, exc = c.on_reply(error_frames(None, int(ErrorCode.INVALID_ARGUMENT)))
    assert got_id is None
    assert isinstance(exc, InvalidArgument)
    assert rid in c.pending  # still waiting for its own answer


@pytest.mark.parametrize("kind", ["reply", "error"])
def test_late_and_duplicate_replies_are_ignored(kind: str) -> None:
    def answer(rid: int) -> list[Any]:
        if kind == "reply":
            return reply_frames(rid, y=np.zeros((1, 1), np.float32))
        return error_frames(rid, int(ErrorCode.DEADLINE_EXCEEDED))

    c = ClientCore(grace_s=1.0)
    first, _ = c.request(T0, "m", {"x": [1]}, timeout_s=1.0)
    assert c.on_reply(answer(first))[0] == first
    assert c.on_reply(answer(first))[0] is None  # duplicate
    # Late: after the local deadline gave up on the request.
    second, _ = c.request(T0, "m", {"x": [1]}, timeout_s=1.0)
    assert [rid for rid, _ in c.expire(T0 + 2.0)] == [second]
    got_id, late = c.on_reply(answer(second))
    assert got_id is None
    assert isinstance(late, InferResult if kind == "reply" else DeadlineExceeded)


def test_unknown_and_forgotten_ids_are_ignored() -> None:
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    assert c.on_reply(reply_frames(rid + 100, y=np.zeros((1,), np.uint8)))[0] is None
    c.forget(rid)
    assert c.on_reply(reply_frames(rid, y=np.zeros((1,), np.uint8)))[0] is None
    assert c.next_deadline() is None


def test_stats_reply() -> None:
    c = ClientCore()
    got_id, stats = c.on_reply(encode(Command.STATS, {"id": 3, "queued": 2}))
    assert got_id is None
    assert stats == {"id": 3, "queued": 2}


def test_stats_replies_are_matched_to_their_requests_by_id() -> None:
    c = ClientCore()
    first, _ = c.queries.stats_request()
    second, _ = c.queries.stats_request()
    assert c.queries.answer(first) is None  # asked, not answered yet
    assert c.on_reply(encode(Command.STATS, {"id": second, "n": 2})) == (
        second,
        {"id": second, "n": 2},
    )
    assert c.queries.answer(first) is None
    assert c.on_reply(encode(Command.STATS, {"id": first, "n": 1}))[0] == first
    assert c.queries.answer(first) == {"id": first, "n": 1}
    assert c.queries.answer(second) == {"id": second, "n": 2}
    c.queries.forget(first)
    assert c.queries.answer(first) is None
    assert c.on_reply(encode(Command.STATS, {"id": first, "n": 3}))[0] is None  # given up
    assert c.queries.answer(first) is None
    assert c.queries.answer(second) == {"id": second, "n": 2}


def test_metadata_answers_and_refusals_are_matched_to_their_requests_by_id() -> None:
    c = ClientCore()
    one, frames = c.queries.metadata_request("echo")
    every, every_frames = c.queries.metadata_request()
    assert parse_header(frames[0]) is Command.METADATA
    assert decode_meta(frames[1]) == {"id": one, "model": "echo"}
    assert decode_meta(every_frames[1]) == {"id": every}
    answer = {"id": every, "models": []}
    assert c.on_reply([header(Command.METADATA), codec.pack(answer)]) == (every, answer)
    assert c.queries.answer(one) is None
    refused = encode_error(ErrorReply(one, ErrorCode.NOT_FOUND, "no echo"))
    got_id, error = c.on_reply(refused)
    assert got_id == one
    assert isinstance(error, NotFound)
    assert c.queries.answer(one) is error
    assert c.queries.answer(every) == answer


@pytest.mark.parametrize("sid", [None, "1", 1.0, True])
def test_a_stats_reply_without_an_awaited_id_answers_nobody(sid: object) -> None:
    c = ClientCore()
    asked, _ = c.queries.stats_request()
    assert asked == 1
    assert c.on_reply(encode(Command.STATS, {"id": sid}))[0] is None
    assert c.queries.answer(asked) is None


@pytest.mark.parametrize(
    "frames",
    [
        [header(Command.REPLY)],
        [],
        [b"junk", b"junk"],
        [b"CP\x02\x02", codec.pack({})],
        encode(Command.BATCH, {"batch": 1}),
        encode(Command.REQUEST, {"id": 1}),
        [header(Command.REPLY), b"\xc1"],
        encode(Command.REPLY, {"id": 1}),
        encode(Command.ERROR, {"id": 1, "code": "x"}),
    ],
    ids=[
        "one-frame",
        "empty",
        "garbage",
        "version",
        "batch",
        "request",
        "bad-meta",
        "no-outputs",
        "bad-code",
    ],
)
def test_invalid_broker_messages_raise(frames: list[Any]) -> None:
    with pytest.raises(ProtocolError):
        ClientCore().on_reply(frames)


@pytest.mark.parametrize("payloads", [[], [bytes(7)], [bytes(8), bytes(8)]])
def test_a_reply_that_cannot_be_read_fails_its_request_at_once(payloads: list[bytes]) -> None:
    """The request is answered INTERNAL now, not left to wait out its timeout for an
    answer that has come."""
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    meta = ReplyMeta(rid, (TensorMeta("y", "float32", (1, 2)),))
    got, outcome = c.on_reply(encode(Command.REPLY, meta.to_wire(), payloads))
    assert got == rid
    assert isinstance(outcome, InternalError)
    assert outcome.request_id == rid
    assert "could not be read" in str(outcome)
    assert rid not in c.pending
    with pytest.raises(ProtocolError):  # the same again: nobody waits for it now
        c.on_reply(encode(Command.REPLY, meta.to_wire(), payloads))


def test_a_reply_outside_protocol_v1_fails_its_request_at_once() -> None:
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    meta = {"id": rid, "outputs": [{"name": "y", "dtype": "float32", "shape": [1] * 9}]}
    got, outcome = c.on_reply(encode(Command.REPLY, meta, [b""]))
    assert got == rid
    assert isinstance(outcome, InternalError)


def test_a_reply_with_zero_size_dims_is_an_empty_array() -> None:
    """A detector that found nothing (§5.1); read twice, so the known-layout path that
    the second reply takes answers it the same."""
    c = ClientCore()
    for _ in range(2):
        rid, _ = c.request(T0, "m", {"x": [1]})
        meta = {"id": rid, "outputs": [{"name": "y", "dtype": "float32", "shape": [2, 0, 6]}]}
        got, outcome = c.on_reply(encode(Command.REPLY, meta, [b""]))
        assert got == rid
        assert isinstance(outcome, InferResult)
        assert outcome["y"].shape == (2, 0, 6)
        assert outcome["y"].dtype == np.float32


@pytest.mark.parametrize("shape", [[1, 0, 2**61], [1, 0, 2**63], [1, 0, 2**40, 2**40]])
def test_an_empty_reply_no_array_could_have_fails_its_request_at_once(shape: list[int]) -> None:
    """An empty frame bounds none of the other dims: such a shape fails its request at
    once, INTERNAL (numpy's own ValueError for it must not escape the client)."""
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    meta = {"id": rid, "outputs": [{"name": "y", "dtype": "float32", "shape": shape}]}
    got, outcome = c.on_reply(encode(Command.REPLY, meta, [b""]))
    assert got == rid
    assert isinstance(outcome, InternalError)
    assert "at most" in str(outcome)


@pytest.mark.parametrize("waiting", [True, False], ids=["pending", "late"])
def test_whatever_decoding_raises_is_an_unreadable_message(
    monkeypatch: pytest.MonkeyPatch, waiting: bool
) -> None:
    """Not only ProtocolError: anything the decoding raises (numpy's own refusals, a
    ValueError) stays inside on_reply, which would otherwise end Client.poll and the
    asyncio client's reader. A request that waits gets INTERNAL, anything else is a
    ProtocolError the read loops step over."""
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    if not waiting:
        c.forget(rid)

    def refuse(*args: Any) -> Any:
        raise ValueError("array is too big; `arr.size * arr.dtype.itemsize` is larger ...")

    monkeypatch.setattr(ClientCore, "_decode", refuse)
    meta = {"id": rid, "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}]}
    message = encode(Command.REPLY, meta, [b"1234"])
    if not waiting:
        with pytest.raises(ProtocolError, match="unreadable"):
            c.on_reply(message)
        return
    got, outcome = c.on_reply(message)
    assert got == rid
    assert isinstance(outcome, InternalError)
    assert rid not in c.pending


@pytest.mark.parametrize("shape", [[0, 6], [1, 0, 6]], ids=["dim-0", "with-bytes"])
def test_zero_samples_or_bytes_for_an_empty_output_are_refused(shape: list[int]) -> None:
    """Dim 0 counts samples and is never 0; an empty output has an empty frame."""
    c = ClientCore()
    rid, _ = c.request(T0, "m", {"x": [1]})
    meta = {"id": rid, "outputs": [{"name": "y", "dtype": "float32", "shape": shape}]}
    got, outcome = c.on_reply(encode(Command.REPLY, meta, [b"" if shape[0] == 0 else b"1234"]))
    assert got == rid
    assert isinstance(outcome, InternalError)


# --------------------------------------------------------------------------- local deadlines


@pytest.mark.parametrize(
    ("default_s", "send_timeout_s", "timeout_s", "window_s"),
    [
        (10.0, None, None, 10.0),  # the default timeout
        (10.0, None, 0.3, 0.3),  # the request's own
        (10.0, 2.0, None, 2.0),  # send_timeout_s, shorter
        (10.0, 2.0, 0.3, 0.3),  # the request's own, shorter still
        (10.0, 0.0, 0.3, 0.0),  # never wait for room
    ],
)
def test_send_window_is_the_timeout_or_send_timeout_if_shorter(
    default_s: float, send_timeout_s: float | None, timeout_s: float | None, window_s: float
) -> None:
    c = ClientCore(default_timeout_s=default_s, send_timeout_s=send_timeout_s)
    assert c.send_window_s(timeout_s) == window_s


def test_a_core_from_options() -> None:
    options = ClientOptions(
        default_timeout_s=2.0,
        grace_s=0.25,
        send_timeout_s=0.5,
        shared_memory_min_bytes=4096,
        shared_memory_outputs=True,
    )
    c = ClientCore.from_options(options)
    assert (c.default_timeout_s, c.grace_s, c.send_timeout_s) == (2.0, 0.25, 0.5)
    assert (c.shm_min_bytes, c.shm_outputs, c.arena) == (4096, True, None)
    rid, frames = c.request(T0, "m", {"x": [1]})
    assert c.pending[rid] == T0 + 2.25
    assert decode_meta(frames[1])["shm_outputs"] is True


def test_local_expiry_is_unavailable() -> None:
    c = ClientCore(grace_s=0.5)
    a, _ = c.request(T0, "m", {"x": [1]}, timeout_s=1.0)
    b, _ = c.request(T0 + 0.1, "m", {"x": [1]}, timeout_s=2.0)
    assert c.next_deadline() == T0 + 1.5
    assert c.expire(T0 + 1.499) == []
    (expired,) = c.expire(T0 + 1.5)
    assert expired[0] == a
    assert type(expired[1]) is Unavailable
    assert expired[1].request_id == a
    assert c.expire(T0 + 1.5) == []  # once only
    assert c.next_deadline() == T0 + 0.1 + 2.0 + 0.5
    assert list(c.pending) == [b]


def test_answered_requests_do_not_expire() -> None:
    c = ClientCore(grace_s=1.0)
    a, _ = c.request(T0, "m", {"x": [1]}, timeout_s=1.0)
    b, _ = c.request(T0, "m", {"x": [1]}, timeout_s=5.0)
    c.on_reply(error_frames(a, int(ErrorCode.NOT_FOUND)))
    assert c.next_deadline() == T0 + 6.0  # a's deadline is skipped
    assert c.expire(T0 + 5.0) == []
    assert [rid for rid, _ in c.expire(T0 + 6.0)] == [b]
    assert c.next_deadline() is None


def test_answered_requests_leave_no_deadlines_behind() -> None:
    """Answered requests with long timeouts, queued behind short pending ones, do not
    keep their deadline entries until their own deadline: the heap stays within twice
    the pending requests (at 200 req/s, an hour's timeouts would leave 60,000 behind)."""
    c = ClientCore(grace_s=1.0)
    now = T0
    for i in range(5000):
        rid, _ = c.request(now, "m", {"x": [1]}, timeout_s=0.5 if i % 2 else 3600.0)
        if i % 2 == 0:  # the long one is answered at once, the short one expires
            c.on_reply(error_frames(rid, int(ErrorCode.NOT_FOUND)))
        now += 0.005
        c.expire(now)
    assert len(c.pending) < 400
    assert len(c._deadlines) <= 2 * len(c.pending) + 65
    assert c.next_deadline() == min(c.pending.values())


# --------------------------------------------------------------------------- the fast path


def _reply_meta(rid: Any = 2, **changes: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "outputs": [
            {"name": "y", "dtype": "float32", "shape": [1, 2]},
            {"name": "m", "dtype": "uint8", "shape": [1]},
        ],
        "batch_size": 4,
        "queue_ms": 1.5,
        "compute_ms": 2.25,
    }
    meta.update(changes)
    return meta


GOOD_PAYLOADS = [np.array([[1.0, 2.0]], np.float32).tobytes(), b"\x07"]


def _outcome(core: ClientCore, meta: dict[str, Any], payloads: list[bytes]) -> Any:
    try:
        rid, result = core.on_reply([header(Command.REPLY), codec.pack(meta), *payloads])
    except ProtocolError as exc:
        return ("ProtocolError", str(exc))
    if isinstance(result, RequestError):  # an answer to a waiting request, unreadable
        return (type(result).__name__, rid, str(result))
    assert isinstance(result, InferResult)
    outputs = {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in result.outputs.items()}
    return rid, outputs, result.batch_size, result.queue_ms, result.compute_ms


@pytest.mark.parametrize(
    ("changes", "payloads"),
    [
        ({}, GOOD_PAYLOADS),
        ({"rid": True}, GOOD_PAYLOADS),
        ({"rid": -1}, GOOD_PAYLOADS),
        ({"rid": None}, GOOD_PAYLOADS),
        ({"batch_size": 1.0}, GOOD_PAYLOADS),
        ({"batch_size": False}, GOOD_PAYLOADS),
        ({"queue_ms": 1}, GOOD_PAYLOADS),
        ({"queue_ms": "1"}, GOOD_PAYLOADS),
        ({"compute_ms": math.inf}, GOOD_PAYLOADS),
        ({"outputs": "ym"}, GOOD_PAYLOADS),
        ({"outputs": [{"name": "y", "dtype": "float32", "shape": [True, 2]}]}, GOOD_PAYLOADS[:1]),
        (
            {
                "outputs": [
                    {"name": "y", "dtype": "float32", "shape": [1.0, 2]},
                    {"name": "m", "dtype": "uint8", "shape": [1]},
                ]
            },
            GOOD_PAYLOADS,
        ),
        (
            {
                "outputs": [
                    {"name": "y", "dtype": "float32", "shape": b"\x01\x02"},
                    {"name": "m", "dtype": "uint8", "shape": [1]},
                ]
            },
            GOOD_PAYLOADS,
        ),
        ({}, GOOD_PAYLOADS[:1]),
        ({}, [GOOD_PAYLOADS[0], b"\x07\x08"]),
        ({}, [*GOOD_PAYLOADS, b""]),
    ],
)
def test_a_known_reply_layout_decodes_like_a_fresh_client(
    changes: dict[str, Any], payloads: list[bytes]
) -> None:
    """Once a reply layout is cached, any reply decodes (or fails) exactly as it does on a
    client that never saw the layout."""
    rid = changes.pop("rid", 2)
    warm, cold = ClientCore(), ClientCore()
    for core in (warm, cold):
        core.request(T0, "m", {"x": [1]})
        core.request(T0, "m", {"x": [1]})
    assert _outcome(warm, _reply_meta(1), GOOD_PAYLOADS)[0] == 1  # caches the layout
    assert warm._layouts
    meta = _reply_meta(rid, **changes)
    assert _outcome(warm, meta, payloads) == _outcome(cold, meta, payloads)


def test_a_known_reply_layout_skips_the_full_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    core = ClientCore()
    core.request(T0, "m", {"x": [1]})
    core.request(T0, "m", {"x": [1]})
    _outcome(core, _reply_meta(1), GOOD_PAYLOADS)

    def no_full_decode(meta: Any) -> None:
        raise AssertionError("a known layout took the full path")

    monkeypatch.setattr(ReplyMeta, "from_wire", no_full_decode)
    rid, outputs, *_ = _outcome(core, _reply_meta(2), GOOD_PAYLOADS)
    assert rid == 2
    assert outputs["y"] == ("<f4", (1, 2), GOOD_PAYLOADS[0])
    assert outputs["m"] == ("|u1", (1,), b"\x07")


# --------------------------------------------------------------------------- shared memory (§5.4)


@pytest.fixture
def shm_core() -> Any:

    from carpool.common.shm import ShmArena, available

    if not available():
        pytest.skip("no usable /dev/shm")
    core = ClientCore()
    core.arena = ShmArena(8192)
    core.shm_min_bytes = 1024
    yield core
    core.arena.close()


def test_large_inputs_go_through_shared_memory_small_ones_in_frames(shm_core: Any) -> None:
    big = np.arange(512, dtype=np.float32).reshape(2, 256)  # 2 KiB
    small = np.ones((2, 3), np.uint8)
    _rid, frames = shm_core.request(0.0, "m", {"big": big, "small": small})
    submit = decode_submit(decode_meta(frames[1]))
    assert submit.shm is not None
    region, offset, key = submit.shm[0]  # type: ignore[misc]
    assert (region, key, submit.shm[1]) == (shm_core.arena.name, shm_core.arena.key, None)
    assert len(frames[2]) == 0
    assert bytes(frames[3]) == small.tobytes()
    region = Path(shm_core.arena.path).read_bytes()
    stored = np.frombuffer(region, np.float32, 512, offset).reshape(2, 256)
    np.testing.assert_array_equal(stored, big)


def test_a_full_arena_sends_inline(shm_core: Any) -> None:
    big = np.zeros((1, 1536), np.float32)  # 6 KiB of the 8 KiB
    _, first = shm_core.request(0.0, "m", {"x": big})
    _, second = shm_core.request(0.0, "m", {"x": big})
    assert len(first[2]) == 0
    assert second[2] is not None
    assert np.asarray(second[2]).nbytes == big.nbytes
    assert decode_submit(decode_meta(second[1])).shm is None


@pytest.mark.parametrize("outcome", ["reply", "error", "expire", "forget"])
def test_shared_memory_is_freed_once_the_request_is_settled(shm_core: Any, outcome: str) -> None:
    big = np.zeros((1, 1536), np.float32)
    rid, _ = shm_core.request(0.0, "m", {"x": big}, timeout_s=1.0)
    assert shm_core.arena.used_bytes > 0
    if outcome == "reply":
        reply = ReplyMeta(rid, (TensorMeta("y", "float32", (1, 1)),))
        shm_core.on_reply(encode_reply(reply, [np.zeros(1, np.float32).tobytes()], simple=False))
    elif outcome == "error":
        shm_core.on_reply(encode_error(ErrorReply(rid, ErrorCode.OVERLOADED, "full")))
    elif outcome == "expire":
        assert [r for r, _ in shm_core.expire(100.0)] == [rid]
    else:
        shm_core.forget(rid)
    assert shm_core.arena.used_bytes == 0
    assert not shm_core._leases


def test_a_request_that_fails_to_encode_gives_its_shared_memory_back(shm_core: Any) -> None:
    big = np.zeros((1, 1024), np.float32)
    with pytest.raises(ValueError, match="scalar"):
        shm_core.request(0.0, "m", {"a": big, "b": np.float32(1.0)})  # b: a scalar
    assert shm_core.arena.used_bytes == 0
    assert not shm_core._leases
    assert not shm_core.pending


def place_one(ring: ShmRing, nbytes: int) -> tuple[int, int]:
    """Reserve one output in the ring: its (offset, seq)."""
    placed = ring.place([nbytes])
    assert placed is not None
    (spot,) = placed
    assert spot is not None
    return spot


def test_outputs_in_a_worker_ring_are_copied_out(shm_core: Any) -> None:
    from carpool.common.shm import ShmRing

    shm_core.shm_outputs = True
    rid, frames = shm_core.request(0.0, "m", {"x": np.zeros((1, 2), np.float32)})
    assert decode_meta(frames[1])["shm_outputs"] is True
    ring = ShmRing(1 << 16)
    try:
        y = np.arange(4096, dtype=np.float32).reshape(1, 4096)
        spot = place_one(ring, y.nbytes)
        assert ring.write(spot[0], y.reshape(-1).view(np.uint8).data)
        out = {"name": "y", "dtype": "float32", "shape": [1, 4096]}
        ref = {"region": ring.name, "offset": spot[0], "key": ring.key, "seq": spot[1]}
        meta = {"id": rid, "outputs": [{**out, "shm": ref}], "batch_size": 1}
        got_id, result = shm_core.on_reply([header(Command.REPLY), codec.pack(meta), b""])
        assert got_id == rid
        assert isinstance(result, InferResult)
        np.testing.assert_array_equal(result["y"], y)
        # Another request whose output the ring has since come round over: an error
        # for that request, never someone else's bytes.
        rid2, _ = shm_core.request(0.0, "m", {"x": np.zeros((1, 2), np.float32)})
        for _ in range(4):
            later = place_one(ring, y.nbytes)
            ring.write(later[0], np.zeros(4096, np.float32).view(np.uint8).data)
        meta["id"] = rid2
        got_id, result = shm_core.on_reply([header(Command.REPLY), codec.pack(meta), b""])
        assert got_id == rid2
        assert isinstance(result, Unavailable)
        assert "written over" in str(result)
    finally:
        ring.close()
        if shm_core.reader is not None:
            shm_core.reader.close()


def test_an_unreadable_ring_fails_the_request_and_stops_the_asking(
    shm_core: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any failure while copying an output out (here the system refuses a lock) answers
    the request, which was settled already: it is never lost. A ring this client cannot
    open at all also makes it stop asking for shared-memory outputs."""
    from carpool.common.shm import RegionReader, ShmError

    shm_core.shm_outputs = True
    shm_core.reader = RegionReader()
    ref = {"region": "carpool-out-1-abc", "offset": 64, "key": "0" * 32, "seq": 0}
    out = {"name": "y", "dtype": "float32", "shape": [1, 1 << 14], "shm": ref}

    def reply(rid: int) -> Any:
        meta = {"id": rid, "outputs": [out], "batch_size": 1}
        return shm_core.on_reply([header(Command.REPLY), codec.pack(meta), b""])

    def no_locks(ref: Any, dest: Any) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(shm_core.reader, "read_output", no_locks)
    rid, _ = shm_core.request(0.0, "m", {"x": np.zeros((1, 2), np.float32)})
    got_id, outcome = reply(rid)
    assert got_id == rid
    assert isinstance(outcome, Unavailable)
    assert not shm_core.pending
    assert shm_core.shm_outputs  # a passing failure: keep asking

    def unreachable(ref: Any, dest: Any) -> None:
        raise ShmError("cannot be opened on this worker", unreachable=True)

    monkeypatch.setattr(shm_core.reader, "read_output", unreachable)
    rid, _ = shm_core.request(0.0, "m", {"x": np.zeros((1, 2), np.float32)})
    got_id, outcome = reply(rid)
    assert isinstance(outcome, Unavailable)
    assert not shm_core.shm_outputs
    _, frames = shm_core.request(0.0, "m", {"x": np.zeros((1, 2), np.float32)})
    assert "shm_outputs" not in decode_meta(frames[1])
    shm_core.reader.close()
