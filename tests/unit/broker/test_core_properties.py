"""Properties of the broker core under random interleavings (hypothesis).

For every policy: a batch never exceeds B_max nor mixes item shapes; no request is
dispatched after its deadline; every request ends exactly once (a reply or a typed error);
the next wake-up never lies in the past.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.core import BrokerCore, Outgoing, ToClient
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    BatchMeta,
    BrokerBatch,
    Command,
    FailedMeta,
    ModelSpec,
    Priority,
    Ready,
    ResultMeta,
    Submit,
    TensorMeta,
    decode_from_broker,
    decode_from_worker,
    decode_meta,
    encode,
    encode_request,
    header,
)
from carpool.common.protocol import frames as codec

B_MAX = 4
ITEM_SHAPES = [(4,), (6,)]
SPEC = ModelSpec(
    "m",
    (TensorMeta("x", "float32", (-1, -1)),),
    (TensorMeta("y", "float32", (-1, -1)),),
    max_batch=8,
)

arrive = st.tuples(
    st.just("arrive"),
    st.sampled_from([0, 1]),  # item shape
    st.integers(1, 3),  # samples
    st.sampled_from([5, 20, 50, 200]),  # timeout_ms
    st.sampled_from([0, 1]),  # priority
)
advance = st.tuples(st.just("advance"), st.integers(0, 30))
finish = st.tuples(st.just("finish"), st.integers(0, 1), st.integers(1, 40))
fail = st.tuples(st.just("fail"), st.integers(0, 1))
lose = st.tuples(st.just("lose"), st.integers(0, 1))
ops = st.lists(
    st.one_of(arrive, arrive, arrive, advance, advance, finish, finish, fail, lose),
    max_size=80,
)
# Several messages a turn (as the server reads them): they pile up until a loop turn
# ends with a tick.
turn = st.tuples(st.just("turn"))
turn_ops = st.lists(
    st.one_of(arrive, arrive, arrive, advance, finish, finish, fail, lose, turn, turn),
    max_size=100,
)


@dataclass
class FakeWorker:
    wid: bytes
    batches: deque[BatchMeta] = field(default_factory=deque)


@dataclass
class World:
    policy: str
    core: BrokerCore
    now: float = 100.0
    workers: list[FakeWorker] = field(default_factory=list)
    generation: int = 0
    requests: dict[int, tuple[int, float]] = field(default_factory=dict)  # rid -> (shape, dl)
    answers: Counter[int] = field(default_factory=Counter)
    next_rid: int = 1
    # Every op is a turn of its own, ended with a tick; with ``turns``, a tick only ends a
    # turn ("turn" op) or comes before time passes, as in the server, where every loop
    # turn (of up to 256 messages a socket) ends with one.
    turns: bool = False

    def route(self, outgoing: list[Outgoing]) -> None:
        for out in outgoing:
            if isinstance(out, ToClient):
                meta = decode_meta(out.frames[1])
                rid = meta["id"]
                assert rid in self.requests, out.frames
                self.answers[rid] += 1
                continue
            msg = decode_from_broker(out.message.to_frames())
            if not isinstance(msg, BrokerBatch):
                continue
            batch = msg.batch
            assert batch.total_samples <= B_MAX
            (spec,) = batch.inputs
            for item in batch.items:
                shape_index, deadline_s = self.requests[item.request_id]
                assert spec.shape[1:] == ITEM_SHAPES[shape_index], "shapes mixed in a batch"
                assert self.now <= deadline_s, "dispatched after its deadline"
            worker = next(w for w in self.workers if w.wid == out.identity)
            worker.batches.append(batch)

    def tick(self) -> None:
        for _ in range(100):
            wake = self.core.next_wakeup(self.now)
            assert wake is None or wake >= self.now
            if wake is None or wake > self.now:
                return
            self.route(self.core.on_tick(self.now))
        raise AssertionError("next_wakeup kept returning now")

    def join(self, index: int) -> None:
        self.generation += 1
        worker = FakeWorker(f"w{index}-{self.generation}".encode())
        if index < len(self.workers):
            self.workers[index] = worker
        else:
            self.workers.append(worker)
        ready = Ready(worker.wid.decode(), 2, (SPEC,), 1000)
        self.route(
            self.core.on_worker(
                self.now, worker.wid, decode_from_worker(encode(Command.READY, ready.to_wire()))
            )
        )

    def apply(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "turn" or (self.turns and kind in ("advance", "finish")):
            self.tick()  # the turn ends (before time passes)
            if kind == "turn":
                return
        if kind == "arrive":
            _, shape_index, samples, timeout_ms, priority = op
            rid = self.next_rid
            self.next_rid += 1
            self.requests[rid] = (shape_index, self.now + timeout_ms / 1000)
            shape = (samples, *ITEM_SHAPES[shape_index])
            submit = Submit(
                rid, "m", timeout_ms, (TensorMeta("x", "float32", shape),), Priority(priority)
            )
            payload = bytes(4 * samples * ITEM_SHAPES[shape_index][0])
            self.route(self.core.on_client(self.now, b"client", encode_request(submit, [payload])))
        elif kind == "advance":
            self.now += op[1] / 1000
        elif kind in ("finish", "fail"):
            worker = self.workers[op[1]]
            if not worker.batches:
                return
            batch = worker.batches.popleft()
            if kind == "finish":
                self.now += op[2] / 1000
                frames: list[object] = []
                for item in batch.items:
                    frames += [header(Command.REPLY), codec.pack({"id": item.request_id})]
                meta = ResultMeta(batch.batch_id, 0.5, float(op[2]), (2,) * len(batch.items))
                msg = encode(Command.RESULT, meta.to_wire(), frames)
            else:
                failed = FailedMeta(batch.batch_id, ErrorCode.INTERNAL, "boom", 0.5)
                msg = encode(Command.FAILED, failed.to_wire())
            self.route(self.core.on_worker(self.now, worker.wid, decode_from_worker(msg)))
        elif kind == "lose":
            worker = self.workers[op[1]]
            bye = encode(Command.DISCONNECT, {"reason": "test"})
            self.route(self.core.on_worker(self.now, worker.wid, decode_from_worker(bye)))
            self.join(op[1])
        if not self.turns:
            self.tick()

    def drain(self) -> None:
        """Finish everything: run all batches, then let every deadline pass."""
        for _ in range(1000):
            self.tick()
            busy = [i for i, w in enumerate(self.workers) if w.batches]
            if not busy:
                break
            self.apply(("finish", busy[0], 5))
        self.tick()
        self.now += 10.0
        self.tick()
        for _ in range(1000):
            self.tick()
            busy = [i for i, w in enumerate(self.workers) if w.batches]
            if not busy:
                break
            self.apply(("finish", busy[0], 5))


@pytest.mark.parametrize("policy", ["carpool", "fixed", "seed"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=ops)
def test_every_request_ends_exactly_once_within_the_rules(policy: str, script: list[Any]) -> None:
    config = BrokerConfig(
        batching=BatchingConfig(max_batch=B_MAX, max_wait_s=0.005, policy=policy),
        max_queued=50,
    )
    world = World(policy, BrokerCore(config))
    world.join(0)
    world.join(1)
    for op in script:
        world.apply(op)
    world.drain()
    assert set(world.answers) == set(world.requests)
    assert all(count == 1 for count in world.answers.values()), world.answers
    snapshot = world.core.snapshot()
    assert snapshot["queued"] == 0
    assert snapshot["queued_bytes"] == 0  # every byte counted in was counted out
    assert snapshot["inflight_batches"] == 0


@pytest.mark.parametrize("policy", ["carpool", "fixed", "seed"])
@pytest.mark.parametrize("max_queued", [3, 50])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=turn_ops)
def test_several_messages_a_turn_end_every_request_exactly_once(
    policy: str, max_queued: int, script: list[Any]
) -> None:
    """Several messages per loop turn, batches formed at its end, a full queue that
    pumps before it refuses."""
    config = BrokerConfig(
        batching=BatchingConfig(max_batch=B_MAX, max_wait_s=0.005, policy=policy),
        max_queued=max_queued,
    )
    world = World(policy, BrokerCore(config), turns=True)
    world.join(0)
    world.join(1)
    for op in script:
        world.apply(op)
    world.drain()
    assert set(world.answers) == set(world.requests)
    assert all(count == 1 for count in world.answers.values()), world.answers
    snapshot = world.core.snapshot()
    assert snapshot["queued"] == 0
    assert snapshot["queued_bytes"] == 0  # every byte counted in was counted out
    assert snapshot["inflight_batches"] == 0


@pytest.mark.parametrize("policy", ["fixed", "carpool"])
def test_answered_requests_release_payloads_and_heaps_stay_bounded(policy: str) -> None:
    """A long run must not keep tensors of answered requests, nor deadline-heap entries
    that FIFO dispatch never pops."""
    config = BrokerConfig(batching=BatchingConfig(max_batch=B_MAX, max_wait_s=0.0, policy=policy))
    world = World(policy, BrokerCore(config))
    world.join(0)
    kept = []
    for i in range(2000):
        world.apply(("arrive", 0, 1, 200, 0))
        if world.workers[0].batches:
            world.apply(("finish", 0, 0))
        if i == 10:
            kept = [r for q in world.core.backlog.queues.values() for r in q._heaps[0]]
    world.drain()
    assert all(count == 1 for count in world.answers.values())
    queues = list(world.core.backlog.queues.values())
    assert all(len(heap) <= 64 + 2 * q.count for q in queues for heap in q._heaps)
    assert all(entry[2].payloads == () for entry in kept)  # answered long ago: no tensors
