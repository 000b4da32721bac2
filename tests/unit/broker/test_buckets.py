"""Shape buckets at the broker (protocol §8.1, §8.3, §8.4, §6.4): a padded model's
requests queue by bucket, requests of different shapes in one bucket share a batch whose
``inputs`` carry the bucket's shape and whose items say their own, payloads go as they
came, a shape outside every bucket is refused at the door with the allowed range, and
STATS counts batches and the padded share per bucket. Uses harness.py."""

from __future__ import annotations

from typing import Any

import numpy as np

from carpool.common.errors import ErrorCode
from carpool.common.padding import CropAxis, PadRule
from carpool.common.protocol import (
    Command,
    ModelSpec,
    ReplyMeta,
    ResultMeta,
    TensorMeta,
    encode,
    encode_reply,
)
from carpool.common.protocol import frames as codec
from carpool.common.shape_rules import ShapeRule
from tests.unit.broker.harness import C1, F32, T0, W1, W2, Broker, Msg, batches, ids, to_clients

#: Item shapes [H, W]: H rounded up to 32s, then the smallest of two buckets.
BUCKETS = PadRule(multiple_of=(32, 1), buckets=((64, 8), (128, 16)), value=-1.0)


def padded(rule: PadRule = BUCKETS, rules: tuple[ShapeRule | None, ...] = ()) -> ModelSpec:
    return ModelSpec(
        "m",
        (TensorMeta("x", F32, (-1, -1, -1)),),
        (TensorMeta("y", F32, (-1, -1, -1)),),
        8,
        (),
        rules,
        (rule,),
        ((CropAxis(1, "x", 1), CropAxis(2, "x", 2)),),
    )


def result(b: Broker, batch: Msg, padding: tuple[int, int] | None) -> list[Msg]:
    meta = batch.batch
    replies = []
    for item in meta.items:
        reply = ReplyMeta(item.request_id, (TensorMeta("y", F32, (item.samples, 2)),), 1, 0.0, 1.0)
        replies.append(
            encode_reply(reply, [np.zeros((item.samples, 2), np.float32).tobytes()], simple=False)
        )
    wire = ResultMeta(meta.batch_id, 0.0, 1.0, tuple(len(r) for r in replies), padding).to_wire()
    return b.worker(T0, batch.to, encode(Command.RESULT, wire, [f for r in replies for f in r]))


def test_requests_of_one_bucket_share_a_batch_in_the_bucket_shape() -> None:
    b = Broker.make(max_batch=3, max_wait_s=0.5)
    b.ready(T0, W1, padded(), slots=4)
    out: list[Msg] = []
    for rid, item in ((1, (40, 8)), (2, (64, 5)), (3, (100, 10)), (4, (64, 8))):
        out += b.request(T0, rid, item=item)
    assert to_clients(out) == []
    (batch,) = batches(out)  # 1, 2 and 4 are in bucket 64x8; 3 waits in 128x16
    meta = batch.batch
    assert ids(batch) == [1, 2, 4]
    assert meta.inputs == (TensorMeta("x", F32, (-1, 64, 8)),)
    assert [i.shapes for i in meta.items] == [((40, 8),), ((64, 5),), None]
    # Each request's frame as it came, its own size (never decoded, never padded).
    assert batch.payloads == [b.sent[1][0], b.sent[2][0], b.sent[4][0]]
    assert [len(p) for p in batch.payloads] == [40 * 8 * 4, 64 * 5 * 4, 64 * 8 * 4]
    # The fast path (a layout seen before) queues by bucket too.
    out = b.request(T0, 5, item=(40, 8)) + b.request(T0, 6, item=(120, 16))
    out += b.tick(T0 + 0.5)
    formed = {tuple(ids(m)): m.batch for m in batches(out)}
    assert set(formed) == {(3, 6), (5,)}
    assert formed[3, 6].inputs[0].shape == (-1, 128, 16)
    assert [i.shapes for i in formed[3, 6].items] == [((100, 10),), ((120, 16),)]
    assert formed[5,].items[0].shapes == ((40, 8),)


def test_a_shape_outside_every_bucket_is_refused_with_the_range() -> None:
    b = Broker.make(max_batch=1, max_wait_s=0.0)
    b.ready(T0, W1, padded(), slots=4)
    for rid, item in ((1, (129, 4)), (2, (30, 17))):
        (msg,) = to_clients(b.request(T0, rid, item=item))
        assert (msg.rid, msg.code) == (rid, ErrorCode.INVALID_ARGUMENT)
        text = msg.meta["message"]
        assert f"input 'x': shape [1, {item[0]}, {item[1]}] fits no bucket" in text, text
        assert "[64, 8], [128, 16] (at most [128, 16])" in text, text
    # Shape rules hold for the bucket, the shape the engine runs: [40, 5] rides as [64, 8],
    # which a rule of multiples of 16 refuses; [100, 9] rides as [128, 16].
    b = Broker.make(max_batch=1, max_wait_s=0.0)
    b.ready(T0, W1, padded(rules=(ShapeRule(multiple_of=(1, 1, 16)),)), slots=4)
    (msg,) = to_clients(b.request(T0, 1, item=(40, 5)))
    assert msg.code is ErrorCode.INVALID_ARGUMENT
    assert "shape [64, 8] (without dim 0): dim 2 is 8" in msg.meta["message"]
    assert [ids(m) for m in batches(b.request(T0, 2, item=(100, 9)))] == [[2]]


def test_a_padded_input_in_shared_memory_must_have_its_bucket_shape() -> None:
    """(§5.4: the worker reads it straight into the batch; the broker checks this, on
    the fast path too, where the same layout came inline before.)"""
    b = Broker.make(max_batch=1, max_wait_s=0.0)
    b.ready(T0, W1, padded(), slots=4)
    assert [ids(m) for m in batches(b.request(T0, 1, item=(40, 8)))] == [[1]]
    shm = {"region": "carpool-7-c1", "offset": 64, "key": "5e" * 16}
    for rid, item in ((2, [1, 40, 8]), (3, [1, 64, 8])):
        t = {"name": "x", "dtype": F32, "shape": item, "shm": shm}
        meta = {"id": rid, "model": "m", "inputs": [t], "timeout_ms": 1000}
        out = b.client(T0, C1, encode(Command.REQUEST, meta, [b""]))
        if rid == 2:
            (msg,) = to_clients(out)
            assert msg.code is ErrorCode.INVALID_ARGUMENT
            assert "shared memory must have its bucket's shape" in msg.meta["message"]
        else:  # the bucket's own shape: as any shared-memory input
            (batch,) = batches(out)
            assert batch.batch.items[0].shm is not None
            assert batch.batch.items[0].shapes is None


def test_stats_count_batches_and_the_padded_share_per_bucket() -> None:
    b = Broker.make(max_batch=2, max_wait_s=0.5)
    b.ready(T0, W1, padded(), slots=4)
    first = batches(b.request(T0, 1, item=(40, 8)) + b.request(T0, 2, item=(64, 8)))
    second = batches(b.request(T0, 3, item=(100, 10)) + b.tick(T0 + 0.5))
    assert [ids(m) for m in first + second] == [[1, 2], [3]]
    for batch in first + second:
        items = batch.batch.items
        bucket = int(np.prod(batch.batch.inputs[0].shape[1:]))
        own = [int(np.prod(i.shapes[0])) if i.shapes else bucket for i in items]
        replies = to_clients(result(b, batch, (sum(bucket - o for o in own), bucket * len(own))))
        assert [m.command for m in replies] == [Command.REPLY] * len(items)
    stats: dict[str, Any] = b.core.snapshot()
    buckets = stats["buckets"]["m"]
    assert set(buckets) == {"64x8", "128x16"}
    assert buckets["64x8"]["samples"] == 2
    assert buckets["64x8"]["padded_share"] == round((64 - 40) * 8 / (2 * 64 * 8), 4)
    assert buckets["128x16"] == {
        "batches": 1,
        "samples": 1,
        "padded_elements": 128 * 16 - 100 * 10,
        "bucket_elements": 128 * 16,
        "padded_share": round(1 - 100 * 10 / (128 * 16), 4),
    }


def test_an_unpadded_model_keeps_exact_shapes_and_no_bucket_stats() -> None:
    b = Broker.make(max_batch=2, max_wait_s=0.0)
    spec = ModelSpec("m", (TensorMeta("x", F32, (-1, -1)),), (TensorMeta("y", F32, (-1, 2)),), 8)
    b.ready(T0, W1, spec, slots=4)
    out = b.request(T0, 1, item=(4,)) + b.request(T0, 2, item=(5,))
    out += b.tick(T0 + 1)
    assert sorted(ids(m) for m in batches(out)) == [[1], [2]]
    assert all(i.shapes is None for m in batches(out) for i in m.batch.items)
    assert "shapes" not in batches(out)[0].meta["requests"][0]
    for batch in batches(out):
        result(b, batch, None)
    assert b.core.snapshot()["buckets"] == {}


def test_queued_requests_meet_a_re_registered_model_by_their_own_shapes() -> None:
    """(§8.1) A model re-registered with other buckets: a queued request whose bucket
    changed is sent back to be resent; one whose bucket holds rides as it is."""
    b = Broker.make(max_batch=4, max_wait_s=0.1)
    b.ready(T0, W1, padded(), slots=1)
    b.request(T0, 3, item=(120, 16))
    assert [ids(m) for m in batches(b.tick(T0 + 0.1))] == [[3]]  # W1's one credit
    b.request(T0, 1, item=(40, 8))  # bucket 64x8
    b.request(T0, 2, item=(100, 16))  # bucket 128x16
    b.disconnect(T0 + 0.1, W1)  # (request 3 goes back to its queue)
    other = PadRule(multiple_of=(32, 1), buckets=((64, 16), (128, 16)), value=-1.0)
    out = b.ready(T0 + 0.1, W2, padded(other), slots=1)
    (msg,) = to_clients(out)
    assert (msg.rid, msg.code) == (1, ErrorCode.UNAVAILABLE)
    assert "other buckets" in msg.meta["message"]
    out += b.tick(T0 + 0.2)
    (batch,) = batches(out)
    assert sorted(ids(batch)) == [2, 3]


def test_a_worker_whose_pad_rules_differ_from_the_live_spec_is_refused() -> None:
    """Every worker of a model must take the buckets the broker batches by."""
    b = Broker.make()
    b.ready(T0, W1, padded())
    other = PadRule(multiple_of=(32, 1), buckets=((64, 16), (128, 16)), value=-1.0)
    out = b.ready(T0, W2, padded(other))
    assert [(m.to, m.command) for m in out] == [(W2, Command.DISCONNECT)]
    assert W2 not in b.core.registry


def test_a_batch_for_a_worker_in_the_broker_process_carries_the_own_shapes() -> None:
    """(The embedded transport hands the typed BATCH over; the socket one its frames.)"""
    from carpool.broker.dispatcher import DispatchedBatch, batch_inputs
    from tests.unit.broker.pending import pending_request

    req = pending_request(1)
    req.shapes = ((3,),)
    batch = DispatchedBatch(7, "m", batch_inputs(req.key), [req], req.payloads, 0.0)
    assert batch.to_message().batch.items[0].shapes == ((3,),)
    assert codec.unpack(batch.to_frames()[1])["requests"][0]["shapes"] == [[3]]
