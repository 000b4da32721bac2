"""core.py: BrokerCore driven directly with wire frames and an injected clock (harness.py).

No sockets, threads or sleeps: every event is a call with ``now``, every effect is the list
of ``Outgoing`` messages it returns. These tests pin the minibus rule with the ``fixed``
policy (B_max / T_max, FIFO), so their timing is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.core import BrokerCore, Side
from carpool.broker.requests import WorkerId
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Command,
    ModelSpec,
    Priority,
    ResultMeta,
    Submit,
    TensorMeta,
    encode,
    encode_request,
    header,
)
from carpool.common.protocol import frames as codec
from tests.unit.broker.harness import (
    C1,
    C2,
    C3,
    F32,
    SPEC,
    SPEC2,
    SPEC_DYN,
    T0,
    W1,
    W2,
    W3,
    Broker,
    Msg,
    answer,
    batches,
    fixed,
    ids,
    model_spec,
    only,
    parse,
    raw_request,
    ready_frames,
    to_clients,
)

# --------------------------------------------------------------------------- batch formation


@pytest.mark.parametrize("b_max", [1, 2, 4, 8])
def test_batch_leaves_as_soon_as_b_max_is_reached(b_max: int) -> None:
    b = Broker.make(max_batch=b_max, max_wait_s=0.5)
    assert b.ready(T0, W1, slots=4) == []
    for rid in range(1, b_max):
        assert b.request(T0 + rid * 0.001, rid) == []
    now = T0 + b_max * 0.001
    out = b.request(now, b_max)
    assert len(out) == 1
    (msg,) = batches(out)
    assert msg.to == W1
    batch = msg.batch
    assert ids(msg) == list(range(1, b_max + 1))
    assert [i.samples for i in batch.items] == [1] * b_max
    assert [i.simple for i in batch.items] == [False] * b_max
    assert batch.inputs == (TensorMeta("x", F32, (-1, 4)),)
    assert batch.model == "m"
    for i, item in enumerate(batch.items):
        assert item.queue_ms == pytest.approx(1000 * (now - (T0 + (i + 1) * 0.001)), abs=1e-3)
    # The clients' payload frames travel as the very objects that arrived.
    assert len(msg.payloads) == b_max
    for rid, frame in zip(range(1, b_max + 1), msg.payloads, strict=True):
        assert frame is b.sent[rid][0]


@pytest.mark.parametrize("max_wait_s", [0.001, 0.005, 0.01, 0.25])
def test_batch_leaves_at_exactly_t_max(max_wait_s: float) -> None:
    b = Broker.make(max_batch=4, max_wait_s=max_wait_s)
    b.ready(T0, W1, slots=2)
    assert b.request(T0, 1) == []
    leave_at = T0 + max_wait_s
    assert b.core.next_wakeup(T0) == leave_at
    assert b.core.next_wakeup(T0 + max_wait_s / 2) == leave_at
    assert b.request(T0 + max_wait_s / 2, 2) == []
    assert batches(b.tick(math.nextafter(leave_at, 0))) == []
    out = b.tick(leave_at)
    (msg,) = batches(out)
    assert ids(msg) == [1, 2]  # the later request leaves with the oldest
    assert b.core.queued == 0
    # Nothing waits now: the next wake-up is a heartbeat or a deadline, not a batch.
    assert b.core.next_wakeup(leave_at) == T0 + 1.0


def test_t_max_counts_from_the_oldest_queued_request(broker: Broker) -> None:
    broker.ready(T0, W1, slots=4)
    broker.request(T0, 1)
    assert ids(batches(broker.tick(T0 + 0.01))[0]) == [1]
    broker.request(T0 + 0.012, 2)
    broker.request(T0 + 0.015, 3)
    assert broker.core.next_wakeup(T0 + 0.015) == T0 + 0.012 + 0.01
    assert batches(broker.tick(T0 + 0.0215)) == []
    assert ids(batches(broker.tick(T0 + 0.012 + 0.01))[0]) == [2, 3]


def test_zero_t_max_dispatches_at_once() -> None:
    b = Broker.make(max_batch=8, max_wait_s=0.0)
    b.ready(T0, W1, slots=2)
    assert ids(batches(b.request(T0, 1))[0]) == [1]
    assert ids(batches(b.request(T0, 2))[0]) == [2]


def test_next_wakeup_is_never_in_the_past(broker: Broker) -> None:
    assert broker.core.next_wakeup(T0) is None  # nothing to do at all
    broker.ready(T0, W1)
    assert broker.core.next_wakeup(T0) == T0 + 1.0  # the first heartbeat
    broker.request(T0, 1)
    assert broker.core.next_wakeup(T0) == T0 + 0.01
    for later in (T0 + 0.01, T0 + 0.5, T0 + 7.0):
        assert broker.core.next_wakeup(later) == later


@pytest.mark.parametrize(
    ("b_max", "worker_max", "sizes"),
    [
        (4, 8, [1] * 10),
        (8, 3, [1] * 10),
        (5, 5, [1, 2, 3] * 4),
        (4, 16, [2, 3, 1, 4, 1, 1, 3]),
        (3, 3, [3, 1, 2, 2, 1, 3]),
    ],
)
def test_batches_never_exceed_b_max_nor_the_worker_max(
    b_max: int, worker_max: int, sizes: list[int]
) -> None:
    b = Broker.make(max_batch=b_max, max_wait_s=0.01)
    b.ready(T0, W1, model_spec(max_batch=worker_max), slots=64)
    out: list[Msg] = []
    for rid, n in enumerate(sizes, start=1):
        out += b.request(T0, rid, n=n)
    out += b.tick(T0 + 0.01)
    sent = batches(out)
    limit = min(b_max, worker_max)
    for msg in sent:
        assert msg.batch.total_samples <= limit
        # every payload frame is exactly its request's samples
        for item, frame in zip(msg.batch.items, msg.payloads, strict=True):
            assert len(frame) == item.samples * 16
    # Every request rode exactly once, in FIFO order.
    assert [rid for msg in sent for rid in ids(msg)] == list(range(1, len(sizes) + 1))
    assert b.core.queued == 0


def test_different_item_shapes_never_share_a_batch() -> None:
    b = Broker.make(max_batch=4, max_wait_s=0.01)
    b.ready(T0, W1, SPEC_DYN, slots=8)
    for rid in range(1, 7):
        width = 4 if rid % 2 else 6
        assert b.request(T0, rid, model="dyn", item=(width,)) == []
    sent = batches(b.tick(T0 + 0.01))
    assert len(sent) == 2
    by_width = {msg.batch.inputs[0].shape: ids(msg) for msg in sent}
    assert by_width == {(-1, 4): [1, 3, 5], (-1, 6): [2, 4, 6]}


def test_size_trigger_counts_per_item_shape() -> None:
    b = Broker.make(max_batch=2, max_wait_s=0.5)
    b.ready(T0, W1, SPEC_DYN, slots=8)
    assert b.request(T0, 1, model="dyn", item=(4,)) == []
    assert b.request(T0, 2, model="dyn", item=(6,)) == []
    (msg,) = batches(b.request(T0, 3, model="dyn", item=(4,)))
    assert ids(msg) == [1, 3]
    assert msg.batch.inputs[0].shape == (-1, 4)


def test_request_with_several_samples_counts_them_all(broker: Broker) -> None:
    broker.ready(T0, W1, slots=4)
    assert broker.request(T0, 1, n=3) == []
    (msg,) = batches(broker.request(T0 + 0.001, 2, n=1))
    assert ids(msg) == [1, 2]
    assert [i.samples for i in msg.batch.items] == [3, 1]
    assert msg.batch.total_samples == 4


def test_request_that_does_not_fit_waits_for_the_next_batch(broker: Broker) -> None:
    broker.ready(T0, W1, slots=4)
    broker.request(T0, 1, n=3)
    (msg,) = batches(broker.request(T0 + 0.001, 2, n=2))  # 5 samples queued, 4 fit
    assert ids(msg) == [1]
    # Request 2 is the oldest now; it waits for its own T_max.
    assert broker.core.next_wakeup(T0 + 0.001) == T0 + 0.001 + 0.01
    assert batches(broker.tick(T0 + 0.01)) == []
    assert ids(batches(broker.tick(T0 + 0.001 + 0.01))[0]) == [2]


def test_request_larger_than_b_max_travels_alone(broker: Broker) -> None:
    broker.ready(T0, W1, slots=4)
    broker.request(T0, 1)
    out = broker.request(T0, 2, n=6)  # B_max is 4, the worker takes 8
    # 7 samples queued: request 1 leaves (request 2 does not fit), then request 2 alone.
    first, second = batches(out)
    assert (ids(first), ids(second)) == ([1], [2])
    assert second.batch.total_samples == 6


def test_large_request_goes_to_a_worker_that_can_take_it() -> None:
    b = Broker.make(max_batch=4, max_wait_s=0.01)
    b.ready(T0, W1, model_spec(max_batch=8), slots=4)
    b.ready(T0, W2, model_spec(max_batch=16), slots=1)
    (msg,) = batches(b.request(T0, 1, n=12))
    assert msg.to == W2
    assert msg.batch.total_samples == 12
    # While W2 is busy, another 12-sample request waits: W1 cannot take it.
    assert batches(b.request(T0, 2, n=12)) == []
    out, _ = b.result(T0 + 0.1, msg)
    (nxt,) = batches(out)
    assert (nxt.to, ids(nxt)) == (W2, [2])


@pytest.mark.parametrize("policy", ["fixed", "carpool"])
def test_a_request_no_live_worker_can_take_is_answered_and_blocks_nobody(policy: str) -> None:
    """The only worker that takes 12 samples leaves: its requests are answered UNAVAILABLE
    at once rather than waiting at the head of the queue until their deadlines, and the
    requests behind them go to the smaller worker."""
    b = Broker.make(max_batch=4, max_wait_s=0.0, policy=policy)
    b.ready(T0, W1, model_spec(max_batch=16), slots=1)
    b.ready(T0, W2, model_spec(max_batch=4), slots=1)
    (big,) = batches(b.request(T0, 1, n=12, timeout_ms=3_600_000))
    assert big.to == W1
    assert batches(b.request(T0, 2, n=12, timeout_ms=3_600_000)) == []  # W1 busy: waits
    out = b.disconnect(T0 + 0.01, W1)
    errors = only(out, Command.ERROR, Side.FRONTEND)
    assert sorted((m.rid, m.code) for m in errors) == [
        (1, ErrorCode.UNAVAILABLE),
        (2, ErrorCode.UNAVAILABLE),
    ]
    assert (
        "no live worker of model 'm' takes more than 4 per batch now" in errors[0].meta["message"]
    )
    (small,) = batches(b.request(T0 + 0.02, 3, n=2))
    assert (small.to, ids(small)) == (W2, [3])
    assert b.core.queued == 0
    # A new request that large is refused at the door.
    (refused,) = to_clients(b.request(T0 + 0.03, 4, n=12))
    assert refused.code is ErrorCode.INVALID_ARGUMENT


# --------------------------------------------------------------------------- credits


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_worker_never_holds_more_batches_than_its_slots(slots: int) -> None:
    b = Broker.make(max_batch=1, max_wait_s=0.01)
    b.ready(T0, W1, slots=slots)
    out: list[Msg] = []
    for rid in range(1, slots + 3):
        out += b.request(T0, rid)
    sent = batches(out)
    assert [ids(m) for m in sent] == [[rid] for rid in range(1, slots + 1)]
    assert b.core.queued == 2
    # Each RESULT returns one credit, and the next queued request leaves at once.
    out, _ = b.result(T0 + 0.1, sent[0])
    assert [ids(m) for m in batches(out)] == [[slots + 1]]
    out, _ = b.result(T0 + 0.2, sent[1] if slots > 1 else batches(out)[0])
    assert [ids(m) for m in batches(out)] == [[slots + 2]]
    assert b.core.queued == 0


def test_the_next_batch_waits_for_the_result(broker: Broker) -> None:
    broker.ready(T0, W1, slots=1)
    (first,) = batches(broker.request(T0, 1, n=4))
    for rid in (2, 3, 4, 5):
        assert broker.request(T0 + 0.001, rid) == []
    # Full and past T_max, but no credit: nothing leaves, and no wake-up is scheduled for it.
    assert broker.tick(T0 + 0.4) == []
    assert broker.core.next_wakeup(T0 + 0.4) == T0 + 1.0
    out, _ = broker.result(T0 + 0.5, first)
    assert [m.command for m in out] == [Command.REPLY, Command.BATCH]
    assert ids(batches(out)[0]) == [2, 3, 4, 5]


def test_two_workers_share_the_load() -> None:
    b = Broker.make(max_batch=1, max_wait_s=0.01)
    b.ready(T0, W1, slots=1)
    b.ready(T0, W2, slots=1)
    first = batches(b.request(T0, 1))
    second = batches(b.request(T0, 2))
    assert {first[0].to, second[0].to} == {W1, W2}
    assert b.request(T0, 3) == []
    out, _ = b.result(T0 + 0.1, second[0])
    (third,) = batches(out)
    assert third.to == second[0].to
    assert ids(third) == [3]


def test_prefers_most_free_credits_then_lowest_rho() -> None:
    b = Broker.make(max_batch=1, max_wait_s=0.01)
    b.ready(T0, W1, slots=2)
    b.ready(T0, W2, slots=2)
    b.heartbeat(T0, W1, rho=0.9)
    b.heartbeat(T0, W2, rho=0.2)
    assert batches(b.request(T0, 1))[0].to == W2  # less loaded
    assert batches(b.request(T0, 2))[0].to == W1  # more free credits
    assert batches(b.request(T0, 3))[0].to == W2  # tie on credits: less loaded


# --------------------------------------------------------------------------- reply routing


def test_each_reply_goes_to_its_client(broker: Broker) -> None:
    broker.ready(T0, W1)
    out = broker.request(T0, 1, C1)
    out += broker.request(T0, 1, C2)  # the same id from another client
    out += broker.request(T0, 2, C3, n=2)
    (msg,) = batches(out)
    assert ids(msg) == [1, 1, 2]
    out, replies = broker.result(T0 + 0.02, msg)
    assert [(m.to, m.command, m.rid) for m in out] == [
        (C1, Command.REPLY, 1),
        (C2, Command.REPLY, 1),
        (C3, Command.REPLY, 2),
    ]
    for m, frames in zip(out, replies, strict=True):
        assert m.side is Side.FRONTEND
        assert not m.delimited
        # The worker's reply frames are forwarded as they are.
        assert len(m.frames) == len(frames)
        assert all(a is b for a, b in zip(m.frames, frames, strict=True))
    assert broker.core.stats.replies == 3


def test_req_clients_get_the_delimiter_back(broker: Broker) -> None:
    broker.ready(T0, W1)
    (msg,) = batches(broker.request(T0, 1, n=4, delimited=True))
    assert ids(msg) == [1]
    assert msg.payloads[0] is broker.sent[1][0]
    out, replies = broker.result(T0 + 0.1, msg)
    (reply,) = out
    assert reply.delimited
    assert reply.frames == replies[0]
    assert reply.command is Command.REPLY
    # Errors too, and STATS.
    (err,) = broker.request(T0, 2, model="nope", delimited=True)
    assert err.delimited
    assert err.code is ErrorCode.NOT_FOUND
    (stats,) = broker.client(T0, C1, [b"", header(Command.STATS)])
    assert stats.delimited
    assert stats.command is Command.STATS


def test_simple_form_is_flagged_in_batch_and_answered_in_kind(broker: Broker) -> None:
    broker.ready(T0, W1)
    broker.request(T0, 1, C1, simple=True)
    broker.request(T0, 2, C2)
    broker.request(T0, 3, C3, simple=True, delimited=True)
    (msg,) = batches(broker.tick(T0 + 0.01))
    assert [(i.request_id, i.simple) for i in msg.batch.items] == [(1, True), (2, False), (3, True)]
    # Simple payloads are copied out of msgpack: equal, not identical.
    assert msg.payloads[0] == broker.sent[1][0]
    assert msg.payloads[2] == broker.sent[3][0]
    out, _ = broker.result(T0 + 0.1, msg)
    assert [(m.to, m.simple, m.delimited, m.rid) for m in out] == [
        (C1, True, False, 1),
        (C2, False, False, 2),
        (C3, True, True, 3),
    ]
    assert [t["data"] for t in out[0].meta["outputs"]] == [np.full((1, 2), 1, np.float32).tobytes()]


def test_simple_form_errors_are_simple(broker: Broker) -> None:
    broker.ready(T0, W1)
    (err,) = broker.request(T0, 9, model="nope", simple=True)
    assert err.simple
    assert (err.code, err.rid) == (ErrorCode.NOT_FOUND, 9)
    # Undecodable simple requests still name their id when the map has a valid one.
    (garbage,) = broker.client(T0, C1, [codec.pack({"v": 1, "id": 4})])
    assert garbage.simple
    assert (garbage.code, garbage.rid) == (ErrorCode.INVALID_ARGUMENT, 4)
    (version,) = broker.client(T0, C1, [codec.pack({"v": 2, "id": 4})])
    assert version.simple
    assert (version.code, version.rid) == (ErrorCode.UNSUPPORTED_VERSION, 4)
    (anonymous,) = broker.client(T0, C1, [codec.pack({"v": 1, "id": -4})])
    assert (anonymous.code, anonymous.rid) == (ErrorCode.INVALID_ARGUMENT, None)
    (truncated,) = broker.client(T0, C1, [b"\x82\xa1v\x01"])
    assert truncated.simple
    assert (truncated.code, truncated.rid) == (ErrorCode.INVALID_ARGUMENT, None)


# --------------------------------------------------------------------------- typed errors


def frames_with(meta: dict[str, Any], *payloads: Any) -> list[Any]:
    return encode(Command.REQUEST, meta, payloads)


def x(shape: list[int], dtype: str = F32, name: str = "x") -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": shape}


def req_meta(inputs: list[dict[str, Any]], model: str = "m", rid: int = 5) -> dict[str, Any]:
    return {"id": rid, "model": model, "timeout_ms": 1000, "inputs": inputs}


ERROR_CASES: list[tuple[str, list[Any], ErrorCode, int | None]] = [
    (
        "unknown model",
        frames_with(req_meta([x([1, 4])], "nope"), bytes(16)),
        ErrorCode.NOT_FOUND,
        5,
    ),
    (
        "wrong dtype",
        frames_with(req_meta([x([1, 4], "int32")]), bytes(16)),
        ErrorCode.INVALID_ARGUMENT,
        5,
    ),
    ("wrong rank", frames_with(req_meta([x([1, 4, 1])]), bytes(16)), ErrorCode.INVALID_ARGUMENT, 5),
    ("rank one", frames_with(req_meta([x([4])]), bytes(16)), ErrorCode.INVALID_ARGUMENT, 5),
    ("wrong dims", frames_with(req_meta([x([1, 5])]), bytes(20)), ErrorCode.INVALID_ARGUMENT, 5),
    ("short payload", frames_with(req_meta([x([1, 4])]), bytes(15)), ErrorCode.INVALID_ARGUMENT, 5),
    ("long payload", frames_with(req_meta([x([1, 4])]), bytes(17)), ErrorCode.INVALID_ARGUMENT, 5),
    ("no payload", frames_with(req_meta([x([1, 4])])), ErrorCode.INVALID_ARGUMENT, 5),
    (
        "extra payload",
        frames_with(req_meta([x([1, 4])]), bytes(16), bytes(16)),
        ErrorCode.INVALID_ARGUMENT,
        5,
    ),
    (
        "wrong name",
        frames_with(req_meta([x([1, 4], name="z")]), bytes(16)),
        ErrorCode.INVALID_ARGUMENT,
        5,
    ),
    (
        "extra input",
        frames_with(req_meta([x([1, 4]), x([1, 4], name="z")]), bytes(16), bytes(16)),
        ErrorCode.INVALID_ARGUMENT,
        5,
    ),
    (
        "missing input",
        frames_with(req_meta([x([1, 3], name="a")], "two"), bytes(12)),
        ErrorCode.INVALID_ARGUMENT,
        5,
    ),
    (
        "dim 0 differs",
        frames_with(
            req_meta([x([2, 3], name="a"), x([1, 2], "uint8", "b")], "two"), bytes(24), bytes(2)
        ),
        ErrorCode.INVALID_ARGUMENT,
        5,
    ),
    (
        "too many samples",
        frames_with(req_meta([x([9, 4])]), bytes(144)),
        ErrorCode.INVALID_ARGUMENT,
        5,
    ),
    (
        "version mismatch",
        [b"CP\x02\x01", codec.pack(req_meta([x([1, 4])])), bytes(16)],
        ErrorCode.UNSUPPORTED_VERSION,
        None,
    ),
    ("garbage", [b"hello", b"world"], ErrorCode.INVALID_ARGUMENT, None),
    ("one garbage frame", [b"hello"], ErrorCode.INVALID_ARGUMENT, None),
    ("empty message", [], ErrorCode.INVALID_ARGUMENT, None),
    ("empty frame", [b""], ErrorCode.INVALID_ARGUMENT, None),
    ("header only", [header(Command.REQUEST)], ErrorCode.INVALID_ARGUMENT, None),
    ("bad meta", [header(Command.REQUEST), b"\xc1"], ErrorCode.INVALID_ARGUMENT, None),
    (
        "meta not a map",
        [header(Command.REQUEST), codec.pack([1])],
        ErrorCode.INVALID_ARGUMENT,
        None,
    ),
    (
        "bad field, readable id",
        frames_with({**req_meta([x([1, 4])]), "timeout_ms": 0}, bytes(16)),
        ErrorCode.INVALID_ARGUMENT,
        5,
    ),
    (
        "bool where int",
        frames_with({**req_meta([x([1, 4])]), "id": True}, bytes(16)),
        ErrorCode.INVALID_ARGUMENT,
        None,
    ),
    (
        "bin where str",
        frames_with({**req_meta([x([1, 4])]), "model": b"m"}, bytes(16)),
        ErrorCode.INVALID_ARGUMENT,
        5,
    ),
    ("worker command", ready_frames(), ErrorCode.INVALID_ARGUMENT, None),
    ("reply command", encode(Command.REPLY, {"id": 5}), ErrorCode.INVALID_ARGUMENT, None),
    ("unknown command", [b"CP\x01\x7f", codec.pack({})], ErrorCode.INVALID_ARGUMENT, None),
]


@pytest.mark.parametrize(
    ("frames", "code", "rid"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_typed_errors(frames: list[Any], code: ErrorCode, rid: int | None) -> None:
    b = Broker.make()
    b.ready(T0, W1, SPEC, SPEC2)
    out = b.client(T0, C1, frames)
    assert len(out) == 1
    (err,) = out
    assert (err.side, err.to, err.command) == (Side.FRONTEND, C1, Command.ERROR)
    assert err.code is code
    assert err.rid == rid
    assert isinstance(err.meta["message"], str)
    assert err.meta["message"]
    assert not err.simple
    assert err.payloads == []
    assert b.core.queued == 0
    assert b.core.stats.errors == {code.name: 1}
    assert b.core.next_wakeup(T0) == T0 + 1.0  # nothing queued, nothing to wait for


def test_known_model_without_live_worker_is_unavailable(broker: Broker) -> None:
    broker.ready(T0, W1)
    broker.disconnect(T0 + 0.1, W1)
    (err,) = broker.request(T0 + 0.2, 3)
    assert (err.code, err.rid) == (ErrorCode.UNAVAILABLE, 3)
    (err,) = broker.request(T0 + 0.2, 4, model="never")
    assert (err.code, err.rid) == (ErrorCode.NOT_FOUND, 4)


def test_request_larger_than_any_worker_takes(broker: Broker) -> None:
    broker.ready(T0, W1, model_spec(max_batch=8))
    broker.ready(T0, W2, model_spec(max_batch=12))
    (err,) = broker.request(T0, 1, n=13)
    assert (err.code, err.rid) == (ErrorCode.INVALID_ARGUMENT, 1)
    assert "13" in err.meta["message"]
    assert batches(broker.request(T0, 2, n=12))[0].to == W2


def test_inputs_are_reordered_into_spec_order(broker: Broker) -> None:
    broker.ready(T0, W1, SPEC2)
    pa, pb = bytes(range(12)), b"\x01\x02"
    meta = req_meta([x([1, 2], "uint8", "b"), x([1, 3], name="a")], "two")
    assert broker.client(T0, C1, frames_with(meta, pb, pa)) == []
    (msg,) = batches(broker.tick(T0 + 0.01))
    assert [t.name for t in msg.batch.inputs] == ["a", "b"]
    assert msg.batch.inputs == (TensorMeta("a", F32, (-1, 3)), TensorMeta("b", "uint8", (-1, 2)))
    assert msg.payloads[0] is pa
    assert msg.payloads[1] is pb


@pytest.mark.parametrize("max_wait_s", [0.0, 0.01, 0.25])
def test_queue_full_is_overloaded_with_retry_after(max_wait_s: float) -> None:
    b = Broker.make(max_batch=1, max_wait_s=max_wait_s, max_queued=2)
    b.ready(T0, W1, slots=1)
    assert len(batches(b.request(T0, 1))) == 1
    assert b.request(T0, 2) == []
    assert b.request(T0, 3) == []
    (err,) = b.request(T0, 4, C2)
    assert (err.to, err.code, err.rid) == (C2, ErrorCode.OVERLOADED, 4)
    # No batch cost is known yet, so the drain time is unknown: a modest 50 ms pause.
    assert err.meta["retry_after_ms"] == 50
    # An invalid request is still INVALID_ARGUMENT, not OVERLOADED.
    (err,) = b.request(T0, 5, n=99)
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert b.core.queued == 2
    assert b.core.stats.errors == {"OVERLOADED": 1, "INVALID_ARGUMENT": 1}


def calibrate(b: Broker, now: float, wid: bytes = W1) -> float:
    """Teach the broker a batch cost of 2 ms + 1 ms per sample (sizes 1 and 2)."""
    for rid, n in ((901, 1), (902, 2)):
        out = b.request(now, rid, n=n)
        out += b.tick(now + 0.01)
        (msg,) = batches(out)
        b.result(now + 0.01, msg, wid=wid, compute_ms=2.0 + n)
        now += 0.02
    lane = b.core.registry.get(WorkerId(wid)).lanes["m"]  # type: ignore[union-attr]
    cost = lane.cost(lane.last_key)
    assert cost.calibrated
    assert (cost.fixed_cost_s, cost.per_sample_s) == (pytest.approx(0.002), pytest.approx(0.001))
    return now


def test_overloaded_retry_after_is_the_fitted_drain_time() -> None:
    b = Broker.make(max_batch=4, max_queued=2)
    b.ready(T0, W1, slots=1)
    now = calibrate(b, T0)
    assert len(batches(b.request(now, 1, n=4))) == 1  # the worker is busy now
    b.request(now, 2)
    b.request(now, 3)
    (err,) = b.request(now, 4)
    # Full batches of B_max=4 take 6 ms: 2 queued samples drain in 3 ms.
    assert (err.code, err.meta["retry_after_ms"]) == (ErrorCode.OVERLOADED, 3)


def test_queue_admits_again_once_drained() -> None:
    b = Broker.make(max_batch=1, max_queued=1)
    b.ready(T0, W1, slots=1)
    (first,) = batches(b.request(T0, 1))
    b.request(T0, 2)
    assert b.request(T0, 3)[0].code is ErrorCode.OVERLOADED
    out, _ = b.result(T0 + 0.1, first)
    assert ids(batches(out)[0]) == [2]
    assert b.request(T0 + 0.1, 4) == []
    assert b.core.queued == 1


def test_a_full_queue_forms_the_turns_batches_before_the_door_answers() -> None:
    """Two requests in one loop turn, room for one queued: the first's batch, which the
    turn would form anyway, leaves before the door answers the second, which queues."""
    b = Broker.make(max_batch=1, max_wait_s=0.0, max_queued=1)
    b.ready(T0, W1, slots=1)
    assert b.core.on_client(T0, C1, b.request_frames(1)) == []  # marked for the turn's end
    out = [parse(o) for o in b.core.on_client(T0, C1, b.request_frames(2))]
    assert [ids(m) for m in batches(out)] == [[1]]
    assert to_clients(out) == []
    assert b.core.queued == 1
    assert b.request(T0, 3)[0].code is ErrorCode.OVERLOADED  # no batch this turn makes room


# --------------------------------------------------------------------------- deadlines


def test_deadline_while_queued() -> None:
    broker = Broker.make(max_batch=1)
    broker.ready(T0, W1, slots=1)
    (first,) = batches(broker.request(T0, 1))
    assert broker.request(T0, 2, C2, timeout_ms=100) == []
    assert broker.core.next_wakeup(T0) == T0 + 0.1
    assert broker.tick(T0 + 0.0999) == []
    (err,) = broker.tick(T0 + 0.1)
    assert (err.to, err.code, err.rid) == (C2, ErrorCode.DEADLINE_EXCEEDED, 2)
    assert broker.core.queued == 0
    assert to_clients(broker.tick(T0 + 0.2)) == []
    # The credit comes back with RESULT; the expired request is not dispatched.
    out, _ = broker.result(T0 + 0.3, first)
    assert [(m.to, m.command) for m in out] == [(C1, Command.REPLY)]
    assert broker.core.stats.errors == {"DEADLINE_EXCEEDED": 1}


def test_deadline_while_waiting_for_t_max() -> None:
    b = Broker.make(max_batch=4, max_wait_s=0.5)
    b.ready(T0, W1)
    b.request(T0, 1, timeout_ms=100)
    assert b.core.next_wakeup(T0) == T0 + 0.1
    (err,) = b.tick(T0 + 0.1)
    assert (err.code, err.rid) == (ErrorCode.DEADLINE_EXCEEDED, 1)
    assert batches(b.tick(T0 + 0.5)) == []
    assert b.core.queued == 0


def test_deadline_while_in_flight_answers_once() -> None:
    broker = Broker.make(max_batch=1)
    broker.ready(T0, W1, slots=1)
    (msg,) = batches(broker.request(T0, 1, timeout_ms=50))
    broker.request(T0, 2)
    (err,) = broker.tick(T0 + 0.05)
    assert (err.to, err.code, err.rid) == (C1, ErrorCode.DEADLINE_EXCEEDED, 1)
    assert to_clients(broker.tick(T0 + 0.06)) == []
    # The credit stays taken until the RESULT comes; the late result is not forwarded.
    assert broker.core.snapshot()["inflight_batches"] == 1
    out, _ = broker.result(T0 + 0.2, msg)
    assert to_clients(out) == []
    assert ids(batches(out)[0]) == [2]
    assert broker.core.stats.replies == 0
    assert broker.core.stats.errors == {"DEADLINE_EXCEEDED": 1}


def test_deadline_in_flight_then_worker_lost_answers_once(broker: Broker) -> None:
    broker.ready(T0, W1)
    (msg,) = batches(broker.request(T0, 1, n=4, timeout_ms=50))
    assert len(broker.tick(T0 + 0.05)) == 1
    assert to_clients(broker.disconnect(T0 + 0.1, W1)) == []
    assert to_clients(broker.tick(T0 + 1.0)) == []
    assert msg.batch.items[0].request_id == 1


def test_partly_expired_batch_forwards_only_the_live_replies() -> None:
    b = Broker.make(max_batch=2)
    b.ready(T0, W1)
    b.request(T0, 1, C1, timeout_ms=50)
    (msg,) = batches(b.request(T0, 2, C2, timeout_ms=500))
    (err,) = b.tick(T0 + 0.05)
    assert err.to == C1
    out, replies = b.result(T0 + 0.1, msg)
    assert [(m.to, m.rid) for m in out] == [(C2, 2)]
    assert out[0].frames == replies[1]


def test_default_timeout_applies_without_timeout_ms() -> None:
    b = Broker.make(max_batch=1, default_timeout_s=2.0)
    b.ready(T0, W1, slots=1)
    b.request(T0, 1, timeout_ms=10_000)
    b.request(T0, 2, timeout_ms=None)
    for t in (T0 + 1.0, T0 + 1.999):  # keep the worker alive meanwhile
        b.heartbeat(t, W1)
        assert to_clients(b.tick(t)) == []
    (err,) = to_clients(b.tick(T0 + 2.0))
    assert (err.code, err.rid) == (ErrorCode.DEADLINE_EXCEEDED, 2)


def test_deadline_without_live_worker_is_unavailable() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, slots=1)
    b.request(T0, 1, timeout_ms=500)
    assert b.disconnect(T0 + 0.1, W1) == []  # requeued: nobody else serves the model
    assert b.core.queued == 1
    (err,) = b.tick(T0 + 0.5)
    assert (err.code, err.rid) == (ErrorCode.UNAVAILABLE, 1)
    assert b.core.queued == 0


# --------------------------------------------------------------------------- worker loss


LOSSES = ["disconnect", "heartbeat-expiry", "unreachable", "protocol-error", "bad-header"]


def lose(b: Broker, kind: str, now: float, wid: bytes) -> list[Msg]:
    if kind == "disconnect":
        return b.disconnect(now, wid)
    if kind == "heartbeat-expiry":
        return b.tick(now)
    if kind == "unreachable":
        return [parse(o) for o in b.core.on_unreachable(now, Side.BACKEND, wid)]
    if kind == "protocol-error":
        return b.worker(now, wid, encode(Command.RESULT, {"batch": "x"}))
    if kind == "bad-header":
        return b.worker(now, wid, [b"CP\x09\x13", codec.pack({})])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", LOSSES)
def test_lost_worker_requests_are_requeued_then_dispatched_elsewhere(kind: str) -> None:
    b = Broker.make(max_batch=2, max_attempts=2)
    b.ready(T0, W1, slots=1)
    (msg,) = batches(b.request(T0, 1, timeout_ms=10_000) + b.request(T0, 2, C2, timeout_ms=10_000))
    assert ids(msg) == [1, 2]
    b.request(T0, 3, timeout_ms=10_000)
    now = T0 + 3.0  # three silent heartbeat intervals: W1 expires at this tick
    out = lose(b, kind, now, W1)
    assert to_clients(out) == []
    disconnects = only(out, Command.DISCONNECT)
    assert [m.to for m in disconnects] == ([W1] if kind in ("protocol-error", "bad-header") else [])
    assert b.core.stats.requeued == 2
    assert b.core.queued == 3
    assert b.core.snapshot()["workers"] == []
    # A fresh worker gets them, front of the queue first (FIFO kept).
    out = b.ready(now, W2, slots=2)
    sent = batches(out)
    assert [m.to for m in sent] == [W2, W2]
    assert [ids(m) for m in sent] == [[1, 2], [3]]
    # Same payload objects as the client sent.
    assert sent[0].payloads[0] is b.sent[1][0]
    # Its results reach the clients, once each.
    replies = b.result(now + 0.1, sent[0])[0] + b.result(now + 0.1, sent[1])[0]
    assert sorted((m.to, m.rid) for m in replies) == [(C1, 1), (C1, 3), (C2, 2)]


def test_requeued_request_is_dispatched_at_once_to_another_worker() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, slots=1)
    (msg,) = batches(b.request(T0, 1))
    b.ready(T0, W2, slots=1)
    out = b.disconnect(T0 + 0.1, W1)
    (again,) = batches(out)
    assert (again.to, ids(again)) == (W2, [1])
    assert again.batch.batch_id != msg.batch.batch_id
    assert again.batch.items[0].queue_ms == pytest.approx(100.0)


@pytest.mark.parametrize("max_attempts", [1, 2, 3])
def test_request_fails_unavailable_after_max_attempts(max_attempts: int) -> None:
    b = Broker.make(max_batch=1, max_attempts=max_attempts)
    now = T0
    b.ready(now, W1)
    out = b.request(now, 1)
    for attempt in range(1, max_attempts + 1):
        (msg,) = batches(out)
        assert ids(msg) == [1]
        now += 0.01
        out = b.disconnect(now, msg.to)
        if attempt < max_attempts:
            assert to_clients(out) == []
            wid = bytes([ord("a") + attempt])
            out = b.ready(now, wid)
    (err,) = to_clients(out)
    assert (err.to, err.code, err.rid) == (C1, ErrorCode.UNAVAILABLE, 1)
    assert b.core.queued == 0
    assert b.core.stats.requeued == max_attempts - 1


def test_lost_after_the_deadline_is_unavailable_at_once() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    b.request(T0, 1, timeout_ms=100)
    (err,) = b.disconnect(T0 + 0.1, W1)  # no tick in between
    assert (err.code, err.rid) == (ErrorCode.UNAVAILABLE, 1)


def test_late_result_from_a_lost_worker_is_not_forwarded() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    (msg,) = batches(b.request(T0, 1))
    b.disconnect(T0 + 0.1, W1)
    out, _ = b.result(T0 + 0.2, msg)
    assert [(m.to, m.command) for m in out] == [(W1, Command.DISCONNECT)]
    assert b.core.stats.late_results == 1
    # The request is still waiting for another worker, and gets exactly one reply from it.
    (again,) = batches(b.ready(T0 + 0.3, W2))
    out, _ = b.result(T0 + 0.4, again)
    assert [(m.to, m.rid) for m in to_clients(out)] == [(C1, 1)]
    assert b.core.stats.replies == 1


def test_result_for_a_batch_owned_by_another_worker_is_ignored() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    b.ready(T0, W2)
    (msg,) = batches(b.request(T0, 1))
    other = W2 if msg.to == W1 else W1
    out, _ = b.result(T0 + 0.1, msg, wid=other)
    assert out == []
    assert b.core.stats.late_results == 1
    out, _ = b.result(T0 + 0.2, msg)
    assert [(m.to, m.rid) for m in out] == [(C1, 1)]


def test_duplicate_result_is_ignored(broker: Broker) -> None:
    broker.ready(T0, W1)
    (msg,) = batches(broker.request(T0, 1, n=4))
    out, _ = broker.result(T0 + 0.1, msg)
    assert len(out) == 1
    out, _ = broker.result(T0 + 0.2, msg)
    assert out == []
    assert broker.core.stats.late_results == 1
    assert broker.core.stats.replies == 1


def test_re_ready_on_the_same_socket_requeues_its_batches() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    (old,) = batches(b.request(T0, 1))
    (new,) = batches(b.ready(T0 + 0.1, W1))
    assert (new.to, ids(new)) == (W1, [1])
    assert new.batch.batch_id != old.batch.batch_id
    out, _ = b.result(T0 + 0.2, old)
    assert to_clients(out) == []  # the old batch is no longer this worker's
    out, _ = b.result(T0 + 0.3, new)
    assert [(m.to, m.rid) for m in out] == [(C1, 1)]


@pytest.mark.parametrize(
    "command", [Command.RESULT, Command.HEARTBEAT, Command.FAILED, Command.BATCH, Command.REQUEST]
)
def test_unknown_worker_gets_disconnect(broker: Broker, command: Command) -> None:
    meta: dict[str, Any] = {"batch": 1, "frames": [2], "code": 6}
    out = broker.worker(T0, W3, encode(command, meta))
    assert [(m.side, m.to, m.command) for m in out] == [(Side.BACKEND, W3, Command.DISCONNECT)]
    assert out[0].meta["reason"]
    assert W3 not in broker.core.registry


def test_unknown_worker_result_counts_as_late(broker: Broker) -> None:
    broker.worker(T0, W3, encode(Command.RESULT, {"batch": 1, "frames": [2]}))
    assert broker.core.stats.late_results == 1


def test_unknown_worker_failed_counts_as_late(broker: Broker) -> None:
    broker.worker(T0, W3, encode(Command.FAILED, {"batch": 1, "code": 6}))
    assert broker.core.stats.late_results == 1


def test_unknown_worker_disconnect_is_not_answered(broker: Broker) -> None:
    assert broker.disconnect(T0, W3) == []


def test_garbage_from_an_unknown_worker_gets_disconnect(broker: Broker) -> None:
    out = broker.worker(T0, W3, [b"junk"])
    assert [(m.to, m.command) for m in out] == [(W3, Command.DISCONNECT)]
    out = broker.worker(T0, W3, [header(Command.READY), codec.pack({"name": "w"})])
    assert [(m.to, m.command) for m in out] == [(W3, Command.DISCONNECT)]
    assert len(broker.core.registry) == 0


def test_conflicting_spec_in_ready_gets_disconnect(broker: Broker) -> None:
    broker.ready(T0, W1)
    other = model_spec(inputs=(("x", F32, (-1, 5)),))
    out = broker.ready(T0, W2, SPEC2, other)
    assert [(m.to, m.command) for m in out] == [(W2, Command.DISCONNECT)]
    assert "m" in out[0].meta["reason"]
    assert W2 not in broker.core.registry
    assert not broker.core.registry.serving("two")
    # The registered spec stands.
    assert batches(broker.request(T0, 1, n=4))[0].to == W1


def test_conflicting_re_ready_ends_the_old_registration() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    b.ready(T0, W2)
    (msg,) = batches(b.request(T0, 1))
    assert msg.to == W1
    other = model_spec(inputs=(("x", F32, (-1, 5)),))
    out = b.ready(T0 + 0.1, W1, other)
    assert W1 not in b.core.registry
    assert sorted((m.to, m.command) for m in out if m.side is Side.BACKEND) == [
        (W1, Command.DISCONNECT),
        (W2, Command.BATCH),
    ]
    assert ids(batches(out)[0]) == [1]  # requeued to the other worker


# A model upgraded while its workers were down: the spec the next READY brings replaces
# the old one (protocol §8.1); while any worker of the old spec lives, it is refused.
WIDE = model_spec(inputs=(("x", F32, (-1, 5)),))
NEW_OUTPUTS = ModelSpec("m", SPEC.inputs, (TensorMeta("y", F32, (-1, 3)),), 8)


def test_a_model_no_worker_serves_takes_a_new_spec() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    (first,) = batches(b.request(T0, 1))
    b.result(T0, first)
    b.disconnect(T0 + 0.1, W1)
    out = b.ready(T0 + 0.2, W2, WIDE)
    assert not only(out, Command.DISCONNECT)
    assert b.core.registry.specs["m"] == WIDE
    # The old layout was remembered for the fast path; the new spec refuses it.
    (err,) = to_clients(b.request(T0 + 0.3, 2))
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert "does not fit [?, 5]" in err.meta["message"]
    (batch,) = batches(b.request(T0 + 0.3, 3, item=(5,)))
    assert batch.to == W2
    assert ids(batch) == [3]


def test_queued_requests_that_do_not_fit_the_new_spec_are_answered() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    batches(b.request(T0, 1))
    b.request(T0, 2, C2)
    b.disconnect(T0 + 0.1, W1)  # request 1 goes back to the queue, before 2
    out = b.ready(T0 + 0.2, W2, WIDE)
    errors = only(out, Command.ERROR, Side.FRONTEND)
    assert sorted((m.rid, m.code) for m in errors) == [
        (1, ErrorCode.INVALID_ARGUMENT),
        (2, ErrorCode.INVALID_ARGUMENT),
    ]
    assert "re-registered" in errors[0].meta["message"]
    assert not batches(out)
    assert b.core.queued == 0


def test_queued_requests_that_fit_the_new_spec_ride_on_it() -> None:
    b = Broker.make(max_batch=2)
    b.ready(T0, W1)
    batches(b.request(T0, 1))
    b.disconnect(T0 + 0.1, W1)
    out = b.ready(T0 + 0.2, W2, NEW_OUTPUTS)  # only the outputs changed
    assert not only(out, Command.ERROR)
    (batch,) = batches(out + b.tick(T0 + 0.3))
    assert (batch.to, ids(batch)) == (W2, [1])


@pytest.mark.parametrize(
    ("a_now", "code"),
    [
        ((-1, -1), ErrorCode.UNAVAILABLE),  # only the order changed: a resend fits
        ((-1, 5), ErrorCode.INVALID_ARGUMENT),  # reordered and narrowed: a resend would not
    ],
)
def test_queued_requests_whose_inputs_were_reordered_are_sent_back_if_a_resend_fits(
    a_now: tuple[int, ...], code: ErrorCode
) -> None:
    """Its payloads lie in the old order; 'resend it' only where the resend would fit."""
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, SPEC2)
    frames = encode_request(
        Submit(1, "two", 1000, (TensorMeta("a", F32, (1, 3)), TensorMeta("b", "uint8", (1, 2)))),
        [np.zeros((1, 3), np.float32).tobytes(), np.zeros((1, 2), np.uint8).tobytes()],
    )
    assert batches(b.client(T0, C1, frames))
    b.disconnect(T0 + 0.1, W1)
    swapped = model_spec("two", 8, (("b", "uint8", (-1, 2)), ("a", F32, a_now)))
    (err,) = to_clients(b.ready(T0 + 0.2, W2, swapped))
    assert (err.rid, err.code) == (1, code)


def test_a_new_spec_is_refused_while_a_worker_of_the_old_one_lives() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    b.ready(T0, W2)
    b.disconnect(T0 + 0.1, W1)
    out = b.ready(T0 + 0.2, W3, WIDE)
    assert [(m.to, m.command) for m in out] == [(W3, Command.DISCONNECT)]
    assert b.core.registry.specs["m"] == SPEC
    b.disconnect(T0 + 0.3, W2)
    assert not only(b.ready(T0 + 0.4, W3, WIDE), Command.DISCONNECT)
    assert b.core.registry.specs["m"] == WIDE


def test_an_expired_request_is_never_dispatched_even_without_a_tick() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    (first,) = batches(b.request(T0, 1))
    b.request(T0, 2, C2, timeout_ms=50)
    b.request(T0, 3, C3, timeout_ms=5000)
    # The RESULT arrives after request 2's deadline, before any tick.
    out, _ = b.result(T0 + 0.1, first)
    assert [(m.to, m.command) for m in to_clients(out)] == [
        (C1, Command.REPLY),
        (C2, Command.ERROR),
    ]
    assert to_clients(out)[1].code is ErrorCode.DEADLINE_EXCEEDED
    assert [ids(m) for m in batches(out)] == [[3]]


def test_same_spec_with_another_max_batch_is_welcome(broker: Broker) -> None:
    broker.ready(T0, W1, model_spec(max_batch=2))
    assert broker.ready(T0, W2, model_spec(max_batch=16)) == []
    assert len(broker.core.registry) == 2


@pytest.mark.parametrize(
    "code", [ErrorCode.INTERNAL, ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND]
)
def test_failed_batch_answers_each_request_with_the_workers_code(code: ErrorCode) -> None:
    b = Broker.make(max_batch=2)
    b.ready(T0, W1, slots=1)
    b.request(T0, 1, C1)
    (msg,) = batches(b.request(T0, 2, C2, simple=True))
    b.request(T0, 3, C3)
    out = b.failed(T0 + 0.1, msg, code, "engine exploded")
    errs = to_clients(out)
    assert [(m.to, m.code, m.rid, m.simple) for m in errs] == [
        (C1, code, 1, False),
        (C2, code, 2, True),
    ]
    assert all(m.meta["message"] == "engine exploded" for m in errs)
    # The credit came back: the next request leaves (after its T_max).
    assert ids(batches(out + b.tick(T0 + 0.1))[0]) == [3]
    assert b.core.snapshot()["workers"][0]["rho"] == 0.5


def test_a_workers_overloaded_reaches_the_client_with_a_retry_hint() -> None:
    """§12: OVERLOADED carries retry_after_ms; a worker's FAILED has none to forward."""
    b = Broker.make(max_batch=2)
    b.ready(T0, W1, slots=1)
    b.request(T0, 1, C1)
    (msg,) = batches(b.request(T0, 2, C2, simple=True))
    errs = to_clients(b.failed(T0 + 0.1, msg, ErrorCode.OVERLOADED, "out of device memory"))
    assert [(m.rid, m.code) for m in errs] == [(1, ErrorCode.OVERLOADED), (2, ErrorCode.OVERLOADED)]
    assert all(m.meta["retry_after_ms"] >= 1 for m in errs)
    assert all(m.meta["message"] == "out of device memory" for m in errs)


def test_malformed_result_is_internal_for_every_request() -> None:
    b = Broker.make(max_batch=2)
    b.ready(T0, W1)
    b.request(T0, 1, C1)
    (msg,) = batches(b.request(T0, 2, C2))
    # Two requests, but frame counts for one.
    bad = ResultMeta(msg.batch.batch_id, 0.1, 1.0, (3,))
    out = b.worker(T0 + 0.1, W1, encode(Command.RESULT, bad.to_wire(), [b"a", b"b", b"c"]))
    assert [(m.to, m.code, m.rid) for m in out] == [
        (C1, ErrorCode.INTERNAL, 1),
        (C2, ErrorCode.INTERNAL, 2),
    ]
    assert W1 in b.core.registry  # the worker stays; only the batch failed


def test_result_with_wrong_total_frame_count_is_internal(broker: Broker) -> None:
    broker.ready(T0, W1)
    (msg,) = batches(broker.request(T0, 1, n=4))
    bad = ResultMeta(msg.batch.batch_id, 0.1, 1.0, (3,))
    out = broker.worker(T0 + 0.1, W1, encode(Command.RESULT, bad.to_wire(), [b"a", b"b"]))
    assert [(m.code, m.rid) for m in out] == [(ErrorCode.INTERNAL, 1)]


# --------------------------------------------------------------------------- liveness, heartbeats


def test_heartbeats_to_workers_at_their_announced_interval() -> None:
    b = Broker.make(liveness=100)
    b.ready(T0, W1, heartbeat_ms=250)
    b.ready(T0, W2, heartbeat_ms=1000)
    sent: dict[bytes, list[float]] = {W1: [], W2: []}
    now = T0
    while True:
        nxt = b.core.next_wakeup(now)
        assert nxt is not None
        assert nxt >= now
        if nxt > T0 + 2.1:
            break
        now = nxt
        for m in b.tick(now):
            assert (m.side, m.command, m.meta) == (Side.BACKEND, Command.HEARTBEAT, {})
            sent[m.to].append(now - T0)
    assert sent[W1] == pytest.approx([0.25 * k for k in range(1, 9)])
    assert sent[W2] == pytest.approx([1.0, 2.0])


def test_heartbeats_go_out_whatever_other_traffic_there_is(broker: Broker) -> None:
    broker.ready(T0, W1, heartbeat_ms=100)
    broker.heartbeat(T0 + 0.05, W1)
    assert broker.tick(T0 + 0.099) == []
    out = broker.tick(T0 + 0.1)
    assert [(m.to, m.command) for m in out] == [(W1, Command.HEARTBEAT)]
    assert broker.tick(T0 + 0.15) == []


@pytest.mark.parametrize(("liveness", "heartbeat_ms"), [(3, 1000), (1, 250), (5, 500)])
def test_worker_expires_after_liveness_silent_intervals(liveness: int, heartbeat_ms: int) -> None:
    b = Broker.make(liveness=liveness)
    b.ready(T0, W1, heartbeat_ms=heartbeat_ms)
    b.ready(T0, W2, heartbeat_ms=heartbeat_ms)
    limit = liveness * heartbeat_ms / 1000
    last = T0 + limit / 2
    b.heartbeat(last, W1)  # any message is a sign of life
    b.tick(math.nextafter(T0 + limit, 0))
    assert (W1 in b.core.registry, W2 in b.core.registry) == (True, True)
    b.tick(T0 + limit)
    assert (W1 in b.core.registry, W2 in b.core.registry) == (True, False)
    assert b.core.next_wakeup(T0 + limit) <= last + limit  # type: ignore[operator]
    b.tick(math.nextafter(last + limit, 0))
    assert W1 in b.core.registry
    b.tick(last + limit)
    assert W1 not in b.core.registry


def test_any_message_counts_as_life() -> None:
    broker = Broker.make(max_batch=1)
    broker.ready(T0, W1)
    (msg,) = batches(broker.request(T0, 1))
    broker.result(T0 + 2.5, msg)
    broker.tick(T0 + 3.0)
    assert W1 in broker.core.registry
    broker.tick(T0 + 5.5)
    assert W1 not in broker.core.registry


def test_heartbeat_rho_is_recorded() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1)
    b.heartbeat(T0, W1, rho=0.75)
    assert b.core.snapshot()["workers"][0]["rho"] == 0.75
    b.heartbeat(T0, W1)  # no rho: unchanged
    assert b.core.snapshot()["workers"][0]["rho"] == 0.75
    (msg,) = batches(b.request(T0, 1))
    b.result(T0 + 0.1, msg, rho=0.25)
    assert b.core.snapshot()["workers"][0]["rho"] == 0.25


@pytest.mark.parametrize("rho", [math.nan, math.inf, -0.1, 1.5, True, "0.5"])
def test_heartbeat_with_an_invalid_rho_is_not_recorded(broker: Broker, rho: Any) -> None:
    broker.ready(T0, W1)
    broker.heartbeat(T0, W1, rho=0.25)
    broker.worker(T0, W1, encode(Command.HEARTBEAT, {"rho": rho}))
    assert W1 in broker.core.registry  # still alive: the heartbeat counted as a sign of life
    assert broker.core.snapshot()["workers"][0]["rho"] == 0.25


def test_next_wakeup_due_at_time_zero() -> None:
    b = Broker.make()
    b.ready(-1.0, W1, heartbeat_ms=1000)  # first heartbeat due at 0.0
    assert b.core.next_wakeup(-1.0) == 0.0


def test_rank_zero_tensors_are_refused(broker: Broker) -> None:
    scalar = {"name": "s", "inputs": [x([])], "outputs": [x([-1])], "max_batch": 4}
    meta = {"name": "w1", "slots": 1, "models": [scalar]}
    out = broker.worker(T0, W1, encode(Command.READY, meta))
    assert [(m.to, m.command) for m in out] == [(W1, Command.DISCONNECT)]
    broker.ready(T0, W2)
    (err,) = broker.client(T0, C1, frames_with(req_meta([x([])]), bytes(4)))
    assert (err.code, err.rid) == (ErrorCode.INVALID_ARGUMENT, 5)


def test_unreachable_client_is_counted(broker: Broker) -> None:
    assert broker.core.on_unreachable(T0, Side.FRONTEND, C1) == []
    assert broker.core.on_unreachable(T0, Side.BACKEND, W3) == []  # unknown worker
    assert broker.core.stats.undeliverable == 1


# --------------------------------------------------------------------------- the carpool policy


def test_carpool_policy_dispatches_at_once_while_the_cost_is_unknown() -> None:
    b = Broker.make(max_batch=4, max_wait_s=0.5, policy="carpool")
    b.ready(T0, W1, slots=2)
    assert ids(batches(b.request(T0, 1))[0]) == [1]


@pytest.mark.parametrize(("policy", "order"), [("fixed", [2, 3, 4]), ("carpool", [3, 4, 2])])
def test_queue_order_fifo_or_earliest_deadline_first(policy: str, order: list[int]) -> None:
    b = Broker.make(max_batch=1, policy=policy)
    b.ready(T0, W1, slots=1)
    (msg,) = batches(b.request(T0, 1))
    b.request(T0, 2, timeout_ms=3000)
    b.request(T0, 3, timeout_ms=1000)
    b.request(T0, 4, timeout_ms=2000)
    got = []
    for t in (0.01, 0.02, 0.03):
        out, _ = b.result(T0 + t, msg)
        (msg,) = batches(out)
        got += ids(msg)
    assert got == order


def test_carpool_serves_interactive_first_until_bulk_is_urgent() -> None:
    b = Broker.make(max_batch=1, policy="carpool")
    b.ready(T0, W1, slots=1)
    (msg,) = batches(b.request(T0, 1))
    b.request(T0, 2, timeout_ms=1000, priority=Priority.BULK)
    b.request(T0, 3, timeout_ms=3000)
    b.request(T0, 4, timeout_ms=3000)
    out, _ = b.result(T0 + 0.01, msg)
    (msg,) = batches(out)
    assert ids(msg) == [3]  # interactive first, although the bulk deadline is earlier
    out, _ = b.result(T0 + 0.995, msg)
    (msg,) = batches(out)
    assert ids(msg) == [2]  # the bulk request's deadline is near: it goes first now
    out, _ = b.result(T0 + 0.996, msg)
    assert ids(batches(out)[0]) == [4]


def test_carpool_refuses_at_the_door_what_cannot_make_its_deadline() -> None:
    b = Broker.make(max_batch=4, policy="carpool")
    b.ready(T0, W1, slots=1)
    now = calibrate(b, T0)
    # Best case for one sample: full batches of 4 in 6 ms, so 1.5 ms. 1 ms cannot work.
    (err,) = b.request(now, 1, timeout_ms=1)
    assert (err.code, err.rid) == (ErrorCode.DEADLINE_EXCEEDED, 1)
    assert b.core.stats.shed == 1
    assert b.core.queued == 0
    assert ids(batches(b.request(now, 2, timeout_ms=5))[0]) == [2]


def test_carpool_answers_at_once_a_batch_member_that_a_late_worker_left_too_little_time() -> None:
    """Under a backlog the batch is as large as the worker takes, deadlines aside; a
    member it would finish too late is answered now and counted as shed, and the batch
    leaves without it."""
    b = Broker.make(max_batch=4, policy="carpool")
    b.ready(T0, W1, slots=1)
    now = calibrate(b, T0)
    (busy,) = batches(b.request(now, 1, n=4))  # predicted to take 6 ms
    assert b.request(now, 2, n=3) == []
    # Admitted: 6 ms for the busy worker and 6 for a batch of 4 fit 0.9 x 15 ms.
    assert b.request(now, 3, timeout_ms=15) == []
    assert b.request(now, 4, n=3) == []
    # Its RESULT comes 3.5 ms late: request 3 can still be served alone (a batch of one
    # takes 3 ms, so it is not hopeless), but not in the batch of 4 the backlog sends.
    out, _ = b.result(now + 0.0095, busy, compute_ms=6.0)
    (err,) = [m for m in to_clients(out) if m.command is Command.ERROR]
    assert (err.code, err.rid) == (ErrorCode.DEADLINE_EXCEEDED, 3)
    (msg,) = batches(out)
    assert ids(msg) == [2]
    assert b.core.stats.shed == 1


def test_carpool_sheds_queued_requests_that_can_no_longer_make_it() -> None:
    b = Broker.make(max_batch=4, policy="carpool")
    b.ready(T0, W1, slots=1)
    now = calibrate(b, T0)
    (busy,) = batches(b.request(now, 1, n=4))  # predicted to take 6 ms
    # Admitted (the fleet could do one sample in 1.5 ms), but this worker is busy for 6 ms
    # more and a batch takes at least 3 ms: 5 ms is hopeless, so it is answered at once.
    (err,) = b.request(now, 2, timeout_ms=5)
    assert (err.code, err.rid) == (ErrorCode.DEADLINE_EXCEEDED, 2)
    assert b.core.stats.shed == 1
    assert b.request(now, 3, timeout_ms=50) == []
    out, _ = b.result(now + 0.006, busy, compute_ms=6.0)
    assert [(m.to, m.command) for m in out] == [(C1, Command.REPLY)]
    # Batching pays here (2 ms fixed cost), so request 3 waits up to T_max for company.
    wake = b.core.next_wakeup(now + 0.006)
    assert wake == pytest.approx(now + 0.01)
    assert ids(batches(b.tick(wake))[0]) == [3]  # type: ignore[arg-type]
    # Much later: request 3 (never finished) expires; request 2 is not answered twice.
    assert [m.rid for m in to_clients(b.tick(now + 1.0))] == [3]


def test_carpool_never_sends_an_empty_batch() -> None:
    b = Broker.make(max_batch=4, policy="carpool")
    b.ready(T0, W1, slots=1)
    (first,) = batches(b.request(T0, 1))
    b.request(T0, 2, timeout_ms=1000, priority=Priority.BULK)
    b.request(T0, 3, n=6, timeout_ms=2000)  # within the worker's 8, above B_max
    out, _ = b.result(T0 + 0.05, first)
    sent = batches(out)
    assert sent
    assert all(m.meta["requests"] for m in sent)


def test_carpool_batch_of_several_requests_never_exceeds_b_max() -> None:
    b = Broker.make(max_batch=1, policy="carpool")
    b.ready(T0, W1, slots=1)
    (first,) = batches(b.request(T0, 1))
    b.request(T0, 2, n=2, timeout_ms=30, priority=Priority.BULK)
    b.request(T0, 3, timeout_ms=1000)
    b.request(T0, 4, timeout_ms=1000)
    out, _ = b.result(T0 + 0.005, first)
    (msg,) = batches(out)
    assert len(msg.batch.items) == 1 or msg.batch.total_samples <= 1


# --------------------------------------------------------------------------- stats


def test_stats_snapshot_counts() -> None:
    b = Broker.make(max_batch=2)
    b.ready(T0, W1, slots=2)
    b.request(T0, 1)
    (first,) = batches(b.request(T0, 2))
    b.request(T0, 3, model="nope")
    b.request(T0, 4)
    (second,) = batches(b.tick(T0 + 0.01))
    b.request(T0 + 0.02, 5)
    b.result(T0 + 0.05, first, rho=0.5)
    b.core.on_unreachable(T0, Side.FRONTEND, C2)
    snap = b.core.snapshot()
    assert snap == {
        "requests": 5,
        "replies": 2,
        "errors": {"NOT_FOUND": 1},
        "batch_sizes": {"m": {"1": 2, "2": 1}},
        "queued": 0,
        "queued_bytes": 0,
        "inflight_batches": 2,
        "requeued": 0,
        "undeliverable": 1,
        "departed": 0,
        "dropped_unreadable": {
            "frontend": {"receive": 0, "connection": 0},
            "backend": {"receive": 0, "connection": 0, "decode": 0},
        },
        "core_faults": 0,
        "resent": 0,
        "cancelled": 0,
        "late_results": 0,
        "unhealthy": 0,
        "shed": 0,
        "shed_at_door": 0,
        "buckets": {},
        "known_models": 1,
        "models": {
            "m": {
                "workers": 1,
                "healthy_workers": 1,
                "b_max": snap["workers"][0]["lanes"]["m"]["b_max"],
                "max_wait_ms": 10.0,
                "queued": 0,
                "answered": 2,  # requests 1 and 2, of the first batch
                "errors": {},
                "refused": {},
                "latency": {"p50_ms": 50.0, "p95_ms": 50.0, "p99_ms": 50.0, "n": 2},
            }
        },
        # The broker's 2 below the worker's 8 (model_spec's limit) binds.
        "max_batch_bound_by": {"m": "broker"},
        "workers": [
            {
                "name": "w1",
                "models": ["m"],
                "slots": 2,
                "outstanding": 2,
                "rho": 0.5,
                "health": "healthy",
                "lanes": {"m": snap["workers"][0]["lanes"]["m"]},
                "transport": "zeromq",
                "telemetry": {},
            }
        ],
    }
    lane = snap["workers"][0]["lanes"]["m"]
    assert set(lane) == {
        "b_max",
        "max_batch_bound_by",
        "fixed_cost_ms",
        "per_sample_ms",
        "spread",
        "calibrated",
        "cpu_fixed_ms",
        "cpu_per_sample_ms",
    }
    assert lane["max_batch_bound_by"] == "broker"
    assert lane["calibrated"] is False  # one batch size seen so far
    assert ids(second) == [4]
    # Request 5 went out with the credit returned by the first RESULT.
    assert snap["workers"][0]["outstanding"] == 2


def test_stats_over_the_wire(broker: Broker) -> None:
    broker.ready(T0, W1)
    broker.request(T0, 1)
    for frames in ([header(Command.STATS)], encode(Command.STATS, {})):
        (msg,) = broker.client(T0, C2, frames)
        assert (msg.to, msg.command, msg.payloads) == (C2, Command.STATS, [])
        assert msg.meta["queued"] == 1
        assert msg.meta["workers"][0]["name"] == "w1"
    # A STATS meta with an id gets it echoed, so a DEALER can match the reply.
    (msg,) = broker.client(T0, C2, encode(Command.STATS, {"id": 77}))
    assert msg.meta["id"] == 77
    # STATS and invalid messages count as client messages too (docs §6.4).
    broker.client(T0, C2, [b"junk"])
    assert broker.core.snapshot()["requests"] == 5


# --------------------------------------------------------------------------- property


@dataclass
class SimWorker:
    wid: bytes
    max_batch: int
    slots: int = 1


@dataclass
class World:
    """Random peers around a BrokerCore; checks the invariants after every event."""

    b: Broker
    now: float = T0
    next_rid: int = 1
    owner: dict[int, bytes] = field(default_factory=dict)  # rid -> client identity
    answers: dict[int, int] = field(default_factory=dict)  # rid -> replies + errors
    anonymous_sent: int = 0
    anonymous_answers: int = 0
    dispatched_after_answer: list[int] = field(default_factory=list)
    batches: list[Msg] = field(default_factory=list)  # not yet answered by the sim worker
    finished: list[Msg] = field(default_factory=list)
    workers: dict[bytes, SimWorker] = field(default_factory=dict)
    bulk: bool | None = None  # one priority for every request; None: mixed

    def absorb(self, out: list[Msg]) -> None:
        for m in out:
            if m.side is Side.FRONTEND:
                assert m.command in (Command.REPLY, Command.ERROR)
                rid = m.rid
                if rid is None:
                    self.anonymous_answers += 1
                    continue
                assert self.owner[rid] == m.to, "a reply went to the wrong client"
                self.answers[rid] = self.answers.get(rid, 0) + 1
                assert self.answers[rid] == 1, f"request {rid} answered twice"
            elif m.command is Command.BATCH:
                assert m.meta["requests"], "an empty BATCH"
                batch = m.batch
                worker = self.workers[m.to]
                cap = min(self.b.core.config.batching.max_batch, worker.max_batch)
                # A request larger than B_max travels alone; nothing exceeds the worker's max.
                assert batch.total_samples <= worker.max_batch
                assert batch.total_samples <= cap or len(batch.items) == 1
                assert len(m.payloads) == len(batch.items)
                for item in batch.items:
                    if item.request_id in self.answers:
                        self.dispatched_after_answer.append(item.request_id)
                self.batches.append(m)
        for w in self.b.core.registry.all():
            assert len(w.outstanding) <= w.slots
        assert self.b.core.queued >= 0

    def _bulk(self, drawn: bool) -> bool:
        return drawn if self.bulk is None else self.bulk

    def step(self, action: tuple[Any, ...]) -> None:
        kind = action[0]
        b = self.b
        if kind == "request":
            _, cid, n, width, timeout_ms, simple, delimited, bulk = action
            rid = self.next_rid
            self.next_rid += 1
            self.owner[rid] = cid
            frames = b.request_frames(
                rid,
                n,
                model="dyn",
                item=(width,),
                timeout_ms=timeout_ms,
                simple=simple,
                delimited=delimited,
                priority=Priority.BULK if self._bulk(bulk) else Priority.INTERACTIVE,
            )
            self.absorb(b.client(self.now, cid, frames))
        elif kind == "garbage":
            self.anonymous_sent += 1
            self.absorb(b.client(self.now, action[1], [b"garbage", b"\x00"]))
        elif kind == "ready":
            _, wid, slots, max_batch = action
            self.workers[wid] = SimWorker(wid, max_batch, slots)
            spec = model_spec("dyn", max_batch, (("x", F32, (-1, -1)),))
            self.absorb(b.ready(self.now, wid, spec, slots=slots, heartbeat_ms=200))
        elif kind == "disconnect":
            self.absorb(b.disconnect(self.now, action[1]))
        elif kind == "unreachable":
            self.absorb(
                [parse(o) for o in b.core.on_unreachable(self.now, Side.BACKEND, action[1])]
            )
        elif kind == "heartbeat":
            self.absorb(b.heartbeat(self.now, action[1], rho=0.5))
        elif kind in ("result", "failed") and self.batches:
            msg = self.batches.pop(action[1] % len(self.batches))
            self.finished.append(msg)
            if kind == "result":
                cost_ms = 2.0 + msg.batch.total_samples  # lets the cost model calibrate
                self.absorb(b.result(self.now, msg, compute_ms=cost_ms)[0])
            else:
                self.absorb(b.failed(self.now, msg, ErrorCode.INTERNAL))
        elif kind == "replay" and self.finished:
            msg = self.finished[action[1] % len(self.finished)]
            self.absorb(b.result(self.now, msg)[0])
        elif kind == "tick":
            self.now += action[1]
            self.absorb(b.tick(self.now))
            nxt = b.core.next_wakeup(self.now)
            assert nxt is None or nxt >= self.now

    def drain(self) -> None:
        # Far past every deadline and every heartbeat: everything must be settled.
        self.now += 60.0
        self.absorb(self.b.tick(self.now))


WORKERS = st.sampled_from([W1, W2, W3])
REQUEST = st.tuples(
    st.just("request"),
    st.sampled_from([C1, C2]),
    st.integers(1, 3),
    st.sampled_from([4, 6]),
    st.sampled_from([None, 5, 30, 200, 1000]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
FINISH = st.tuples(st.sampled_from(["result", "result", "failed", "replay"]), st.integers(0, 7))
TICK = st.tuples(st.just("tick"), st.sampled_from([0.001, 0.005, 0.02, 0.1, 0.35]))
BY_KIND = {
    "request": REQUEST,
    "finish": FINISH,
    "tick": TICK,
    "garbage": st.tuples(st.just("garbage"), st.sampled_from([C1, C2])),
    "ready": st.tuples(st.just("ready"), WORKERS, st.integers(1, 2), st.sampled_from([3, 4, 8])),
    "disconnect": st.tuples(st.just("disconnect"), WORKERS),
    "unreachable": st.tuples(st.just("unreachable"), WORKERS),
    "heartbeat": st.tuples(st.just("heartbeat"), WORKERS),
}
# Requests, worker answers and time are drawn more often than the rarer events.
KINDS = (
    ["request"] * 6
    + ["finish"] * 4
    + ["tick"] * 4
    + ["heartbeat"] * 2
    + [
        "ready",
        "disconnect",
        "unreachable",
        "garbage",
    ]
)
ACTIONS = st.sampled_from(KINDS).flatmap(BY_KIND.__getitem__)


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    actions=st.lists(ACTIONS, min_size=10, max_size=60),
    b_max=st.sampled_from([1, 2, 4]),
    bulk=st.booleans(),
)
@pytest.mark.parametrize("policy", ["fixed", "seed", "carpool"])
def test_every_request_gets_exactly_one_answer(
    policy: str, actions: list[tuple[Any, ...]], b_max: int, bulk: bool
) -> None:
    broker = Broker.make(max_batch=b_max, max_wait_s=0.01, policy=policy, default_timeout_s=0.5)
    # FIFO policies ignore priorities: mix them. Under EDF, mixing them sends empty
    # batches (see test_carpool_never_sends_an_empty_batch), so one priority per example.
    world = World(broker, bulk=None if policy != "carpool" else bulk)
    world.step(("ready", W1, 1, 4))
    for action in actions:
        world.step(action)
    world.drain()
    assert world.dispatched_after_answer == []
    assert world.answers == dict.fromkeys(world.owner, 1)
    assert world.anonymous_answers == world.anonymous_sent
    assert world.b.core.queued == 0


# --------------------------------------------------------------------------- the fast path


@pytest.mark.parametrize(
    "changes",
    [
        {"rid": True},
        {"rid": -1},
        {"rid": None},
        {"rid": "9"},
        {"timeout_ms": 0},
        {"timeout_ms": 1.5},
        {"timeout_ms": False},
        {"priority": 2},
        {"priority": True},
        {"priority": 1.0},
        {"model": 3},
        {"inputs": "ab"},
        {"inputs": [{"name": "b", "dtype": "uint8", "shape": [True, 2]}, {"name": "a"}]},
        {
            "inputs": [
                {"name": "b", "dtype": "uint8", "shape": [True, 2]},
                {"name": "a", "dtype": F32, "shape": [1, 3]},
            ]
        },
        {
            "inputs": [
                {"name": "b", "dtype": "uint8", "shape": [1.0, 2]},
                {"name": "a", "dtype": F32, "shape": [1, 3]},
            ]
        },
        {"inputs": [{"name": "b", "dtype": "uint8", "shape": [[1], 2]}]},
        {
            "inputs": [
                {"name": "b", "dtype": "uint8", "shape": b"\x01\x02"},
                {"name": "a", "dtype": F32, "shape": [1, 3]},
            ]
        },
        {"payloads": [b"\x01\x02"]},
        {"payloads": [b"\x01\x02\x03", np.arange(3, dtype=np.float32).tobytes()]},
        {"payloads": [np.arange(3, dtype=np.float32).tobytes(), b"\x01\x02"]},
    ],
)
def test_a_known_layout_answers_bad_requests_like_a_fresh_broker(changes: dict[str, Any]) -> None:
    """Once a request layout is cached, a request that differs in any field still gets
    exactly the answer a broker that never saw the layout gives."""
    warm, cold = Broker.make(max_batch=8, max_wait_s=0.0), Broker.make(max_batch=8, max_wait_s=0.0)
    for b in (warm, cold):
        b.ready(T0, W1, SPEC2, slots=2)
    (first,) = batches(warm.client(T0, C2, raw_request(1)))  # caches the layout
    assert ids(first) == [1]
    assert warm.core.layouts.layouts  # the layout is remembered
    frames = raw_request(**changes)
    assert answer(warm, frames) == answer(cold, frames)


def test_the_fast_path_reorders_inputs_into_spec_order(monkeypatch: pytest.MonkeyPatch) -> None:
    b = Broker.make(max_batch=3, max_wait_s=1.0)
    b.ready(T0, W1, SPEC2, slots=2)
    b.client(T0, C1, raw_request(1))  # the full path; the next two take the fast one

    def no_full_check(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a known layout took the full path")

    # A known layout's descriptors and its checks against the model are not made again.
    monkeypatch.setattr("carpool.common.protocol.from_client.tensor_list", no_full_check)
    monkeypatch.setattr("carpool.broker.intake.layout_of", no_full_check)
    b.client(T0, C1, raw_request(2))
    a3 = np.full(3, 7, np.float32).tobytes()
    (msg,) = batches(b.client(T0, C1, raw_request(3, payloads=[b"\x05\x06", a3])))
    assert ids(msg) == [1, 2, 3]
    assert [t.name for t in msg.batch.inputs] == ["a", "b"]
    # Payloads travel in spec order (a, b) per request, whichever path admitted it.
    a0 = np.arange(3, dtype=np.float32).tobytes()
    assert [bytes(p) for p in msg.payloads] == [a0, b"\x01\x02", a0, b"\x01\x02", a3, b"\x05\x06"]


@pytest.mark.parametrize("payloads", [None, [b"\x01\x02"]])
def test_no_live_worker_is_answered_before_the_payload_checks(payloads: Any) -> None:
    """Protocol §6.1's (informative) order: a known model with no live worker is
    UNAVAILABLE even when the payloads are also wrong, with the layout cached or not."""
    b = Broker.make(max_batch=8, max_wait_s=0.0)
    b.ready(T0, W1, SPEC2, slots=2)
    b.client(T0, C2, raw_request(1))  # caches the layout
    b.disconnect(T0, W1)
    changes = {} if payloads is None else {"payloads": payloads}
    assert answer(b, raw_request(5, **changes)) == [(Command.ERROR, 5, int(ErrorCode.UNAVAILABLE))]


def test_a_burst_is_shared_among_idle_workers_where_batching_buys_nothing() -> None:
    """Four requests read in one turn, two idle workers, costs unknown (as
    on a CPU, batching buys nothing): one batch each, not all four on one worker."""
    core = BrokerCore(BrokerConfig(batching=BatchingConfig(max_batch=8, policy="carpool")))
    b = Broker(core)
    b.ready(T0, W1, slots=2)
    b.ready(T0, W2, slots=2)
    for rid in range(1, 5):
        assert core.on_client(T0, C1, b.request_frames(rid)) == []
    sent = batches([parse(o) for o in core.on_tick(T0)])
    assert sorted((m.to, len(m.batch.items)) for m in sent) == [(W1, 2), (W2, 2)]
    assert sorted(i for m in sent for i in ids(m)) == [1, 2, 3, 4]


def test_a_burst_is_shared_among_idle_workers_where_batching_pays() -> None:
    """What the policy lets leave at once is split among the idle workers in the same
    turn; the remainder does not wait for T_max on the second worker."""
    core = BrokerCore(
        BrokerConfig(batching=BatchingConfig(max_batch=8, max_wait_s=0.05, policy="carpool"))
    )
    b = Broker(core)
    b.ready(T0, W1, slots=2)
    b.ready(T0, W2, slots=2)
    key = ("m", (("x", F32, (4,)),))
    for wid in (W1, W2):  # 2 ms + 1 ms per sample, as RESULTs would teach it: batching pays
        lane = core.registry.get(WorkerId(wid)).lanes["m"]  # type: ignore[union-attr]
        for n in (1, 2, 1, 2):
            lane.observe(key, n, 0.002 + 0.001 * n)
        assert lane.cost(key).calibrated
    now = T0
    for rid in range(1, 9):
        assert core.on_client(now, C1, b.request_frames(rid)) == []
    sent = batches([parse(o) for o in core.on_tick(now)])
    assert sorted((m.to, len(m.batch.items)) for m in sent) == [(W1, 4), (W2, 4)]
    assert sorted(i for m in sent for i in ids(m)) == list(range(1, 9))


def test_the_fixed_policy_gives_a_formed_batch_to_one_worker() -> None:
    """The Triton-like baseline keeps Triton's behaviour: a full batch goes to one free
    instance, even with another idle."""
    core = BrokerCore(BrokerConfig(batching=fixed(8, 0.05)))
    b = Broker(core)
    b.ready(T0, W1, slots=2)
    b.ready(T0, W2, slots=2)
    for rid in range(1, 9):
        assert core.on_client(T0, C1, b.request_frames(rid)) == []
    sent = batches([parse(o) for o in core.on_tick(T0)])
    assert [len(m.batch.items) for m in sent] == [8]


def test_the_fleet_rate_cache_is_dropped_with_idle_queues() -> None:
    """Admission caches a best-case rate per request key; clients choose shapes, so the
    cache is started afresh by the same sweep that forgets idle queues."""
    b = Broker.make(max_batch=8, max_wait_s=0.0, policy="carpool")
    b.ready(T0, W1, SPEC_DYN, slots=2)
    for width in range(1, 50):
        b.client(T0, C1, b.request_frames(width, model="dyn", item=(width,)))
    assert len(b.core.fleet.rates) >= 40
    b.core.on_tick(T0 + 5.0)
    assert b.core.fleet.rates == {}


# --------------------------------------------------------------------------- edge cases


def test_an_absurd_compute_time_neither_crashes_overloaded_nor_is_learned() -> None:
    """A worker may report any finite compute_ms; 1.7e308 ms is not learned from, and
    OVERLOADED's retry hint stays a bounded number (the core answers, it does not raise)."""
    b = Broker.make(max_batch=4, max_queued=8, policy="carpool")
    b.ready(T0, W1, slots=1)
    now = T0
    for rid, n in ((901, 1), (902, 2)):
        (msg,) = batches(b.request(now, rid, n=n) + b.tick(now + 0.01))
        b.result(now + 0.01, msg, compute_ms=1.7e308)
        now += 0.02
    lane = b.core.registry.get(WorkerId(W1)).lanes["m"]  # type: ignore[union-attr]
    assert not lane.cost(next(iter(b.core.backlog.queues))).calibrated  # not learned from
    assert len(batches(b.request(now, 1, n=4))) == 1  # the worker is busy now
    for rid in range(2, 10):
        b.request(now, rid)
    assert b.core.queued == 8
    (refused,) = b.request(now, 99)
    assert refused.code is ErrorCode.OVERLOADED
    assert 1 <= refused.meta["retry_after_ms"] <= 3_600_000


def test_a_load_out_of_range_in_a_result_is_ignored() -> None:
    b = Broker.make(max_batch=1, max_wait_s=0.0)
    b.ready(T0, W1, slots=1)
    b.heartbeat(T0, W1, rho=0.25)
    (msg,) = batches(b.request(T0, 1))
    b.result(T0 + 0.01, msg, rho=-5.0)
    assert b.core.registry.get(WorkerId(W1)).rho == 0.25  # type: ignore[union-attr]


def test_a_silent_workers_requests_are_not_sent_to_another_silent_one() -> None:
    """Two workers fall silent together: the requests of the first lost must not be
    dispatched to the second, lost a moment later in the same tick: no attempt is spent
    on a worker known dead, so with max_attempts 2 the request waits for a live one."""
    b = Broker.make(max_batch=1, max_attempts=2)
    b.ready(T0, W1, slots=1)
    b.ready(T0, W2, slots=1)
    assert len(batches(b.request(T0, 1, timeout_ms=60_000))) == 1
    out = b.tick(T0 + 3.0)  # both silent for 3 heartbeat intervals
    assert batches(out) == []
    assert to_clients(out) == []  # 57 s left: requeued, not failed
    (again,) = batches(b.ready(T0 + 3.1, W3))
    assert ids(again) == [1]


def test_a_tick_drops_silent_workers_before_it_pumps_behind_an_expired_request() -> None:
    b = Broker.make(max_batch=4, max_wait_s=0.5, max_attempts=1)
    b.ready(T0, W1, slots=1)
    b.ready(T0, W2, slots=1)
    b.request(T0 + 2.5, 1, timeout_ms=60_000)  # waits for T_max, until T0 + 3.0
    b.request(T0 + 2.5, 2, timeout_ms=500)  # expires at T0 + 3.0
    b.heartbeat(T0 + 2.9, W1, rho=0.5)  # W1 lives; W2 silent since T0
    out = b.tick(T0 + 3.0)
    assert [m.to for m in batches(out)] == [W1]
    assert [(m.rid, m.code) for m in to_clients(out)] == [(2, ErrorCode.DEADLINE_EXCEEDED)]


def test_the_arrival_order_does_not_hold_answered_requests_behind_a_bulk_one() -> None:
    """EDF takes leave the arrival order untouched; a bulk request that interactive ones
    keep overtaking does not pin the answered ones behind it: the queue's entries stay
    bounded by its count."""
    b = Broker.make(max_batch=1, max_wait_s=0.0, policy="carpool")
    b.ready(T0, W1, slots=1)
    now = T0
    (inflight,) = batches(b.request(now, 1))
    b.request(now, 2, timeout_ms=3_600_000, priority=Priority.BULK)
    for rid in range(11, 3011):
        b.request(now, rid)
        now += 0.001
        out, _ = b.result(now, inflight)
        (inflight,) = batches(out)
        assert ids(inflight) == [rid]
    (queue,) = b.core.backlog.queues.values()
    assert queue.count == 1  # the bulk request
    assert len(queue._arrivals) <= 2 * queue.count + 64


@pytest.mark.parametrize("policy", ["fixed", "carpool"])
def test_a_queue_stays_small_while_requests_expire_and_no_worker_is_free(policy: str) -> None:
    """A hung engine that still heartbeats holds its worker's only slot; requests keep
    coming and expiring, and the queue's entries stay bounded by what it holds."""
    b = Broker.make(max_batch=1, max_wait_s=0.0, policy=policy)
    b.ready(T0, W1, slots=1)
    assert len(batches(b.request(T0, 1, timeout_ms=3_600_000))) == 1  # never answered
    now = T0
    for rid in range(2, 5002):
        now += 0.001
        b.request(now, rid, timeout_ms=5)
        b.tick(now)
        if rid % 500 == 0:
            b.heartbeat(now, W1)
    assert b.core.queued <= 6
    (queue,) = b.core.backlog.queues.values()
    bound = 2 * queue.count + 64
    assert len(queue._arrivals) <= bound
    assert all(len(heap) <= bound for heap in queue._heaps)


def test_queued_payload_bytes_are_bounded_too() -> None:
    """max_queued counts requests: 10,000 camera frames of 6 MB would be 60 GB. The
    payload bytes queued are bounded as well (max_queued_mib): OVERLOADED past it, and a
    request larger than the bound by itself is INVALID_ARGUMENT."""
    b = Broker.make(max_batch=1, max_queued_mib=1)
    b.ready(T0, W1, SPEC_DYN, slots=1)
    item = (64 * 1024,)  # float32: 256 KiB a sample
    assert len(batches(b.request(T0, 1, model="dyn", item=item))) == 1  # the worker is busy now
    for rid in (2, 3, 4, 5):
        assert b.request(T0, rid, model="dyn", item=item) == []  # 1 MiB queued
    assert b.core.backlog.queued_bytes == 4 * 256 * 1024
    (full,) = b.request(T0, 6, model="dyn", item=item)
    assert full.code is ErrorCode.OVERLOADED
    assert "bytes" in full.meta["message"]
    (huge,) = b.request(T0, 7, model="dyn", item=(300 * 1024,))  # 1.2 MiB alone
    assert huge.code is ErrorCode.INVALID_ARGUMENT
    assert b.core.snapshot()["queued_bytes"] == 4 * 256 * 1024


# --------------------------------------------------------------------------- stopping


def test_stopping_answers_the_queue_at_once_and_lets_running_batches_finish() -> None:
    """On SIGTERM every queued request is answered at once (not left to the client's own
    timer), and the results of running batches still reach their clients."""
    b = Broker.make(max_batch=2, max_wait_s=0.0)
    b.ready(T0, W1, slots=1)
    b.ready(T0, W2, slots=1)
    (first,) = batches(b.request(T0, 1, C1, n=2))
    (second,) = batches(b.request(T0, 2, C2, n=2))
    assert batches(b.request(T0, 3, C3, n=2) + b.request(T0, 4, C3, n=1)) == []
    out = [parse(o) for o in b.core.begin_stop(T0 + 0.01)]
    assert sorted((m.to, m.rid, m.code) for m in out) == [
        (C3, 3, ErrorCode.UNAVAILABLE),
        (C3, 4, ErrorCode.UNAVAILABLE),
    ]
    assert all(m.meta.get("retry") is True for m in out)  # they did not run (§6.3)
    assert b.core.queued == 0
    # New requests are refused; a running batch still reaches its client.
    (refused,) = to_clients(b.request(T0 + 0.02, 5, C1))
    assert (refused.rid, refused.code) == (5, ErrorCode.UNAVAILABLE)
    assert "stopping" in refused.meta["message"]
    assert refused.meta.get("retry") is True
    done, _ = b.result(T0 + 0.03, first)
    assert [(m.to, m.rid, m.command) for m in to_clients(done)] == [(C1, 1, Command.REPLY)]
    assert batches(done) == []  # nothing more leaves
    # The last word: what is still at a worker fails, every worker hears DISCONNECT.
    final = [parse(o) for o in b.core.finish_stop(T0 + 2.0)]
    assert [(m.to, m.rid, m.code) for m in to_clients(final)] == [(C2, 2, ErrorCode.UNAVAILABLE)]
    assert "retry" not in to_clients(final)[0].meta  # it was running: it may have run
    assert sorted(m.to for m in only(final, Command.DISCONNECT, Side.BACKEND)) == [W1, W2]
    assert b.core.inflight_batches == 0
    late, _ = b.result(T0 + 2.1, second)
    assert to_clients(late) == []  # answered once, never twice


def test_stopping_answers_a_requeued_request_once() -> None:
    """EDF sends the newer request 2 ahead of 1, leaving its arrival entry behind; the
    worker's loss puts 2 at the front again, and the stop answers it once: the queue's
    counters end at zero, never below."""
    b = Broker.make(max_batch=4, max_wait_s=0.0, policy="carpool")
    b.ready(T0, W1, slots=1)
    (first,) = batches(b.request(T0, 10, C3, n=1, timeout_ms=5000))
    b.request(T0, 1, C1, n=3, timeout_ms=5000)  # older, later deadline
    b.request(T0, 2, C2, n=2, timeout_ms=800)  # newer, earlier deadline: leaves first
    out, _ = b.result(T0 + 0.01, first)
    assert [ids(m) for m in batches(out)] == [[2]]
    assert to_clients(b.disconnect(T0 + 0.02, W1)) == []  # 2 requeued
    final = [parse(o) for o in b.core.begin_stop(T0 + 0.03)]
    assert sorted((m.rid, m.code) for m in to_clients(final)) == [
        (1, ErrorCode.UNAVAILABLE),
        (2, ErrorCode.UNAVAILABLE),
    ]
    assert b.core.queued == 0
    assert dict(b.core.backlog.queued_samples) == {"m": [0, 0]}


def test_a_worker_lost_while_stopping_fails_its_requests_not_requeues_them() -> None:
    b = Broker.make(max_batch=2, max_wait_s=0.0)
    b.ready(T0, W1, slots=1)
    b.ready(T0, W2, slots=1)
    (batch,) = batches(b.request(T0, 1, C1, n=2))
    b.core.begin_stop(T0 + 0.01)
    out = b.disconnect(T0 + 0.02, batch.to)
    assert [(m.rid, m.code) for m in to_clients(out)] == [(1, ErrorCode.UNAVAILABLE)]
    assert batches(out) == []
    final = [parse(o) for o in b.core.finish_stop(T0 + 0.03)]
    assert to_clients(final) == []  # nobody answered twice
    other = W2 if batch.to == W1 else W1
    assert [m.to for m in only(final, Command.DISCONNECT, Side.BACKEND)] == [other]


def test_a_just_started_broker_says_unavailable_for_a_model_not_yet_registered() -> None:
    """After a restart the clients' queued requests arrive before the workers' READYs:
    they hear UNAVAILABLE (retried), not NOT_FOUND (a configuration error, not retried)
    until the registration grace has passed."""
    b = Broker.make(register_grace_s=5.0)
    b.core.started_s = T0
    (early,) = to_clients(b.request(T0 + 1.0, 1))
    assert (early.rid, early.code) == (1, ErrorCode.UNAVAILABLE)
    assert "no worker has registered model 'm' yet" in early.meta["message"]
    b.ready(T0 + 2.0, W1)
    assert to_clients(b.request(T0 + 2.0, 2, model="other")) != []
    assert to_clients(b.request(T0 + 2.0, 3, model="other"))[0].code is ErrorCode.UNAVAILABLE
    (late,) = to_clients(b.request(T0 + 5.0, 4, model="other"))
    assert (late.rid, late.code) == (4, ErrorCode.NOT_FOUND)
    # A core not told when it started (the simulator, tests) never waits.
    (plain,) = to_clients(Broker.make().request(T0, 5, model="other"))
    assert plain.code is ErrorCode.NOT_FOUND
