"""10,000 requests through the broker's core in one process, with a fake clock, after as
many to warm it up: what the broker keeps does not grow with the requests it has served.

Four clients send framed REQUESTs (one of every eight in the simple form, some from
behind a REQ delimiter) to one model served by two workers; each loop turn ends with
``on_tick``, as the server's does; each BATCH is encoded to frames, as a socket
transport sends it, and answered by a RESULT decoded as the transport decodes it; every
reply is checked to reach its own client. Memory is what ``tracemalloc`` traces after a
warm-up and a collection, so that caches filled once (request layouts, the cost model's
windows, counters) do not count. (The worker's core takes 50,000, tests/unit/worker;
the broker's costs more per request, and tracing multiplies it, so it takes fewer.)

The broker does hold some answered requests for a while: its deadline heap drops them
lazily, when it holds 1,024 entries or twice its live ones, so up to about 400 KiB of
them come and go whatever the run's length. The bound allows for that.
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import numpy as np

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.core import BrokerCore, ToClient, ToWorker
from carpool.broker.dispatcher import DispatchedBatch
from carpool.common.protocol import (
    Command,
    ModelSpec,
    Ready,
    ReplyMeta,
    ResultMeta,
    Submit,
    TensorMeta,
    decode_from_worker,
    encode,
    encode_reply,
    encode_request,
    encode_simple_request,
)

REQUESTS = 10_000
WARM_UP = 10_000
PER_TURN = 8  # requests that arrive in one loop turn
CLIENTS = [b"c0", b"c1", b"c2", b"c3"]
WORKERS = [b"w0", b"w1"]
ITEM = 4
#: Traced memory the broker may gain over REQUESTS requests after its warm-up.
GROWTH_BYTES = 1 << 20
SPEC = ModelSpec(
    "m", (TensorMeta("x", "float32", (-1, ITEM)),), (TensorMeta("y", "float32", (-1, ITEM)),), 8
)


def _request(rid: int) -> list[Any]:
    """Request ``rid``'s frames: framed, simple (every eighth) or behind a delimiter."""
    data = np.full((1, ITEM), rid % 97, np.float32).tobytes()
    submit = Submit(rid, "m", 5000, (TensorMeta("x", "float32", (1, ITEM)),))
    if rid % 8 == 7:
        return [encode_simple_request(submit, [data])]
    frames = encode_request(submit, [data])
    return [b"", *frames] if rid % 8 == 3 else frames


class Broker:
    """A BrokerCore, its clients' requests (made once, sent in turn) and its workers."""

    def __init__(self) -> None:
        batching = BatchingConfig(max_batch=8, max_wait_s=0.002)
        self.core = BrokerCore(BrokerConfig(batching=batching))
        self.now = 100.0
        self.requests = [_request(rid) for rid in range(64)]
        self.sent = 0
        self.answered = 0
        self.beats = 0
        for wid in WORKERS:
            ready = Ready(wid.decode(), 2, (SPEC,), 1000)
            self.core.on_worker(
                self.now, wid, decode_from_worker(encode(Command.READY, ready.to_wire()))
            )

    def serve(self, requests: int) -> None:
        core = self.core
        for _ in range(requests // PER_TURN):
            out = []
            for _ in range(PER_TURN):
                rid = self.sent % len(self.requests)
                client = CLIENTS[self.sent % len(CLIENTS)]
                self.sent += 1
                out += core.on_client(self.now, client, self.requests[rid])
            out += core.on_tick(self.now)
            self.now += 0.001
            while out:
                self.now += 0.0002
                out = self.handle(out)
            if self.now >= self.beats + 0.5:  # the workers' heartbeats
                self.beats = int(self.now)
                for wid in WORKERS:
                    beat = decode_from_worker(encode(Command.HEARTBEAT, {"rho": 0.5}))
                    core.on_worker(self.now, wid, beat)
                core.on_tick(self.now)

    def handle(self, out: list[Any]) -> list[Any]:
        """Deliver ``out``: check each reply, answer each BATCH; what that sends back."""
        more: list[Any] = []
        for msg in out:
            if isinstance(msg, ToClient):
                self.answered += 1
                assert msg.identity in CLIENTS
            else:
                assert isinstance(msg, ToWorker)
                batch = msg.message
                if not isinstance(batch, DispatchedBatch):
                    continue  # a heartbeat
                batch.to_frames()  # what a socket transport sends
                more += self.core.on_worker(self.now, msg.identity, _result(batch))
        return more + self.core.on_tick(self.now)


def _result(batch: DispatchedBatch) -> Any:
    """The worker's RESULT for ``batch``, decoded as the transport decodes it."""
    replies = []
    for request in batch.requests:
        meta = ReplyMeta(request.request_id, (TensorMeta("y", "float32", (1, ITEM)),), 1)
        out = np.full((1, ITEM), request.request_id % 97, np.float32).tobytes()
        replies.append(encode_reply(meta, [out], simple=request.simple))
    result = ResultMeta(batch.batch_id, 0.5, 1.0, tuple(len(r) for r in replies))
    return decode_from_worker(
        encode(Command.RESULT, result.to_wire(), [f for r in replies for f in r])
    )


def test_the_broker_core_holds_no_memory_per_request() -> None:
    broker = Broker()
    broker.serve(WARM_UP)
    gc.collect()
    tracemalloc.start()  # from here on: what is allocated and still held at the end
    try:
        broker.serve(REQUESTS)
        gc.collect()
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert broker.answered == broker.sent == WARM_UP + REQUESTS
    stats = broker.core.snapshot()
    assert stats["replies"] == broker.sent
    assert stats["queued"] == stats["inflight_batches"] == 0
    assert grown < GROWTH_BYTES, f"grew {grown} bytes"
