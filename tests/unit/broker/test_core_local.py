"""The in-process hand-off between BrokerCore and an embedded WorkerCore: a BATCH's
typed message (``to_message``) carries the same batch as its frames (``to_frames``), and
a RESULT passes as a typed message (no msgpack between the two); everything else about
the messages is unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.core import BrokerCore, ToClient, ToWorker
from carpool.broker.requests import WorkerId
from carpool.common.protocol import (
    BatchMeta,
    BrokerBatch,
    Command,
    FromWorker,
    ReplyMeta,
    ResultMeta,
    TensorMeta,
    WorkerResult,
    checked_from_worker,
    decode_from_broker,
    decode_from_worker,
    decode_meta,
    encode,
    encode_reply,
    parse_header,
)
from carpool.common.protocol import frames as codec
from carpool.worker.core import JobOutcome, RunBatch, WorkerCore
from tests.unit.broker.harness import SPEC2, T0, W1, raw_request, ready_frames, shm_request


def core() -> BrokerCore:
    batching = BatchingConfig(max_batch=4, max_wait_s=0.0005, policy="fixed")
    return BrokerCore(BrokerConfig(batching=batching))


def batch_out(c: BrokerCore, wid: bytes, *requests: list[Any]) -> ToWorker:
    """Admit ``requests`` from one client in one turn; the BATCH sent to ``wid``."""
    c.on_worker(T0, wid, decode_from_worker(ready_frames(SPEC2, name=wid.decode(), slots=1)))
    for frames in requests:
        c.on_client(T0 + 0.001, b"c1", frames)
    (out,) = [o for o in c.on_tick(T0 + 0.002) if isinstance(o, ToWorker)]
    assert out.identity == wid
    return out


def local_batch(c: BrokerCore, wid: bytes, *requests: list[Any]) -> BrokerBatch:
    """The BATCH for ``wid`` as a worker in the broker's process is handed it."""
    msg = batch_out(c, wid, *requests).message.to_message()
    assert isinstance(msg, BrokerBatch)
    return msg


REQUESTS = [
    raw_request(1),
    shm_request(2, 128),
    raw_request(3, shm_outputs=True),
]


def test_a_local_worker_gets_the_same_batch_as_an_object() -> None:
    out = batch_out(core(), W1, *REQUESTS)
    remote = out.message.to_frames()
    assert parse_header(remote[0]) is Command.BATCH
    decoded = decode_from_broker(remote)
    assert isinstance(decoded, BrokerBatch)
    wire = decoded.batch
    local = out.message.to_message()
    assert isinstance(local, BrokerBatch)
    obj = local.batch
    assert type(obj) is BatchMeta
    assert (obj.batch_id, obj.model, obj.inputs) == (wire.batch_id, wire.model, wire.inputs)
    assert obj.total_samples == wire.total_samples == 3
    for a, b in zip(obj.items, wire.items, strict=True):
        assert (a.request_id, a.samples, a.simple, a.shm, a.shm_outputs) == (
            b.request_id,
            b.samples,
            b.simple,
            b.shm,
            b.shm_outputs,
        )
        assert a.queue_ms == pytest.approx(b.queue_ms, abs=1e-3)
    assert obj.items[1].shm is not None
    assert obj.items[2].shm_outputs
    assert list(local.payloads) == remote[2:]
    assert all(a is b for a, b in zip(local.payloads, remote[2:], strict=True))


def replies_for(batch: BatchMeta) -> tuple[list[int], list[Any]]:
    counts, frames = [], []
    for item in batch.items:
        y = np.full((item.samples, 2), item.request_id, np.float32)
        reply = ReplyMeta(item.request_id, (TensorMeta("y", "float32", y.shape),), 3, 0.0, 1.0)
        enc = encode_reply(reply, [y.tobytes()], simple=item.simple)
        counts.append(len(enc))
        frames += enc
    return counts, frames


def local_result(meta: ResultMeta, frames: list[Any]) -> FromWorker:
    """An embedded worker's RESULT as the core receives it: the typed message itself,
    with the check its in-process transport makes."""
    return checked_from_worker(WorkerResult(meta, frames))


@pytest.mark.parametrize("as_object", [False, True], ids=["msgpack", "object"])
def test_a_result_object_from_a_local_worker_answers_like_the_encoded_one(
    as_object: bool,
) -> None:
    c = core()
    batch = local_batch(c, W1, *REQUESTS).batch
    counts, frames = replies_for(batch)
    meta = ResultMeta(batch.batch_id, 0.25, 2.0, tuple(counts))
    if as_object:
        msg = local_result(meta, frames)
    else:
        msg = decode_from_worker(encode(Command.RESULT, meta.to_wire(), frames))
    out = c.on_worker(T0 + 0.01, W1, msg)
    replies = [o for o in out if isinstance(o, ToClient)]
    assert [codec.unpack(o.frames[1])["id"] for o in replies] == [1, 2, 3]
    assert c.registry.get(WorkerId(W1)).rho == 0.25  # type: ignore[union-attr]
    assert c.stats.replies == 3
    assert not c.stats.late_results


def test_a_local_result_with_the_wrong_frame_count_fails_its_batch() -> None:
    c = core()
    batch = local_batch(c, W1, raw_request(1)).batch
    _, frames = replies_for(batch)
    msg = local_result(ResultMeta(batch.batch_id, 0.0, 1.0, (9,)), frames)
    out = c.on_worker(T0 + 0.01, W1, msg)
    (err,) = [o for o in out if isinstance(o, ToClient)]
    assert parse_header(err.frames[0]) is Command.ERROR


def test_a_worker_core_takes_batch_objects_and_gives_result_objects() -> None:
    c = core()
    batch = local_batch(c, W1, raw_request(1), raw_request(2))
    w = WorkerCore("e", [SPEC2])
    w.on_connect(T0)
    action = w.on_broker(T0, batch)
    assert isinstance(action, RunBatch)
    assert action.batch is batch.batch
    counts, frames = replies_for(action.batch)
    outcome = JobOutcome(action.epoch, action.batch.batch_id, "m", T0, T0 + 0.001, counts, frames)
    msg = w.on_job_done(T0, outcome)
    assert isinstance(msg, WorkerResult)
    assert msg.result.frames == tuple(counts)
    assert list(msg.replies) == frames
    # The same message on a socket: its frames (a worker process).
    wire = msg.to_frames()
    assert decode_meta(wire[1])["batch"] == action.batch.batch_id
    assert wire[2:] == frames


def test_a_result_with_nothing_queued_leaves_no_turn_due() -> None:
    """The server polls with timeout 0 while the core has work due now: a RESULT that
    frees a worker with nothing queued must not ask for an empty turn."""
    c = core()
    batch = local_batch(c, W1, raw_request(1)).batch
    counts, frames = replies_for(batch)
    now = T0 + 0.01
    c.on_worker(now, W1, local_result(ResultMeta(batch.batch_id, 0, 1, tuple(counts)), frames))
    wake = c.next_wakeup(now)
    assert wake is None or wake > now
    # With a request queued behind the busy worker, the RESULT does ask for a pump now.
    batch2 = local_batch(c, W1, raw_request(2), raw_request(3), raw_request(4), raw_request(5))
    c.on_client(now, b"c1", raw_request(6))  # a fifth: waits for the worker
    c.on_tick(now)  # (the arrival's own turn: the worker is busy, it stays queued)
    assert c.next_wakeup(now) != now
    counts, frames = replies_for(batch2.batch)
    result = ResultMeta(batch2.batch.batch_id, 0, 1, tuple(counts))
    c.on_worker(now, W1, local_result(result, frames))
    assert c.next_wakeup(now) == now


def test_a_local_result_claiming_an_empty_reply_is_a_protocol_error() -> None:
    """A reply of zero frames would reach the client as a bare routing id (dropped by
    ROUTER) while the request counted as answered: refused as from_wire refuses it."""
    c = core()
    batch = local_batch(c, W1, raw_request(1), raw_request(2)).batch
    counts, frames = replies_for(batch)
    bad = ResultMeta(batch.batch_id, 0.0, 1.0, (0, counts[0] + counts[1]))
    out = c.on_worker(T0 + 0.01, W1, local_result(bad, frames))
    assert [parse_header(o.message.to_frames()[0]) for o in out if isinstance(o, ToWorker)] == [
        Command.DISCONNECT
    ]
    assert not [o for o in out if isinstance(o, ToClient)]  # requeued, not answered
    assert c.stats.replies == 0
