"""core.py with the deadline-aware policy: priorities, shedding and admission control.

BrokerCore is driven directly with wire frames and injected ``now`` floats, each message
a loop turn ended with a tick (as the server ends each turn): one worker with
``slots=1`` (so a busy worker holds the queue), answers built by hand. Cost calibration
feeds RESULTs with ``compute_ms`` for batch sizes 1 and 2, so the broker's LatencyModel
fits 50 ms + 5 ms·n exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.core import BrokerCore, Outgoing, Side, ToWorker
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    BatchMeta,
    Command,
    ModelSpec,
    Priority,
    Ready,
    ResultMeta,
    Submit,
    TensorMeta,
    decode_from_worker,
    decode_meta,
    encode,
    encode_request,
    header,
)
from carpool.common.protocol import frames as codec

T0 = 100.0
WORKER = b"w1"
CLIENT = b"c1"
F32 = "float32"
INTERACTIVE, BULK = Priority.INTERACTIVE, Priority.BULK
# The cost line the calibration teaches the broker: 50 ms + 5 ms·n.
FIXED_S, PER_SAMPLE_S = 0.050, 0.005


def spec(max_batch: int) -> ModelSpec:
    return ModelSpec(
        "m", (TensorMeta("x", F32, (-1, 4)),), (TensorMeta("y", F32, (-1, 2)),), max_batch
    )


@dataclass
class Msg:
    side: Side
    command: Command
    meta: dict[str, Any]

    @property
    def rid(self) -> Any:
        return self.meta.get("id")

    @property
    def batch(self) -> BatchMeta:
        assert self.command is Command.BATCH
        return BatchMeta.from_wire(self.meta)

    @property
    def ids(self) -> list[int]:
        return [item.request_id for item in self.batch.items]


def parse(out: Outgoing) -> Msg:
    # A worker's message through its wire form, as a worker on a socket gets it.
    frames = out.message.to_frames() if isinstance(out, ToWorker) else out.frames
    command = next(c for c in Command if frames[0] == header(c))
    return Msg(out.side, command, decode_meta(frames[1]))


@dataclass
class Harness:
    """A BrokerCore, its clock, and the batches it sent to the one worker."""

    core: BrokerCore
    now: float = T0
    inflight: dict[int, list[int]] = field(default_factory=dict)  # batch id -> request ids
    dispatched: list[list[int]] = field(default_factory=list)  # request ids, per BATCH
    client_msgs: list[tuple[float, Msg]] = field(default_factory=list)

    @classmethod
    def make(
        cls,
        policy: str = "carpool",
        *,
        max_batch: int = 4,
        max_wait_s: float = 0.005,
        slots: int = 1,
        **config: Any,
    ) -> Harness:
        batching = BatchingConfig(max_batch=max_batch, max_wait_s=max_wait_s, policy=policy)
        h = cls(BrokerCore(BrokerConfig(batching=batching, **config)))
        ready = Ready("w1", slots, (spec(max_batch),), heartbeat_ms=600_000)
        ready_msg = decode_from_worker(encode(Command.READY, ready.to_wire()))
        assert h.core.on_worker(h.now, WORKER, ready_msg) == []
        return h

    def _route(self, outs: list[Outgoing]) -> list[Msg]:
        msgs = [parse(o) for o in outs]
        for m in msgs:
            if m.command is Command.BATCH:
                assert m.side is Side.BACKEND
                self.inflight[m.batch.batch_id] = m.ids
                self.dispatched.append(m.ids)
            elif m.side is Side.FRONTEND:
                self.client_msgs.append((self.now, m))
        return msgs

    def _turn(self, outs: list[Outgoing]) -> list[Msg]:
        """A message's loop turn ends with a tick, as the server ends each turn."""
        return self._route(outs + self.core.on_tick(self.now))

    def at(self, now: float) -> Harness:
        assert now >= self.now
        self.now = now
        return self

    def submit(
        self, rid: int, timeout_ms: int = 1000, priority: Priority = INTERACTIVE
    ) -> list[Msg]:
        submit = Submit(rid, "m", timeout_ms, (TensorMeta("x", F32, (1, 4)),), priority)
        frames = encode_request(submit, [bytes(16)])
        return self._turn(self.core.on_client(self.now, CLIENT, frames))

    def result(self, batch_id: int, compute_ms: float = 0.0, rho: float = 0.5) -> list[Msg]:
        rids = self.inflight.pop(batch_id)
        frames: list[Any] = []
        for rid in rids:
            frames += [header(Command.REPLY), codec.pack({"id": rid})]
        meta = ResultMeta(batch_id, rho, compute_ms, (2,) * len(rids))
        return self._turn(
            self.core.on_worker(
                self.now, WORKER, decode_from_worker(encode(Command.RESULT, meta.to_wire(), frames))
            )
        )

    def tick(self) -> list[Msg]:
        return self._route(self.core.on_tick(self.now))

    def run_until_batch(self, since: int | None = None, max_ticks: int = 20) -> list[int]:
        """Tick at the announced wake-ups until a BATCH has left (counting those sent
        after the first ``since`` batches, if given); its request ids."""
        before = len(self.dispatched) if since is None else since
        for _ in range(max_ticks):
            if len(self.dispatched) > before:
                return self.dispatched[before]
            wake = self.core.next_wakeup(self.now)
            assert wake is not None
            self.at(wake).tick()
        raise AssertionError("no batch left")

    def last_batch_id(self) -> int:
        return max(self.inflight)

    def errors_for(self, rid: int) -> list[tuple[float, Msg]]:
        return [(t, m) for t, m in self.client_msgs if m.rid == rid and m.command is Command.ERROR]

    def replies_for(self, rid: int) -> list[Msg]:
        return [m for _, m in self.client_msgs if m.rid == rid and m.command is Command.REPLY]

    def calibrate(self) -> None:
        """Batches of 1 and 2 with 55 and 60 ms of compute: the fit becomes 50 + 5·n ms."""
        before = len(self.dispatched)
        self.submit(9001)
        assert self.run_until_batch(before) == [9001]
        first = self.last_batch_id()
        self.submit(9002)
        self.submit(9003)
        before = len(self.dispatched)
        self.at(self.now + 0.055).result(first, compute_ms=55.0)
        assert self.run_until_batch(before) == [9002, 9003]
        self.at(self.now + 0.060).result(self.last_batch_id(), compute_ms=60.0)
        assert not self.inflight
        lane = self.core.snapshot()["workers"][0]["lanes"]["m"]
        assert lane["calibrated"] is True
        assert lane["fixed_cost_ms"] == pytest.approx(1000 * FIXED_S)
        assert lane["per_sample_ms"] == pytest.approx(1000 * PER_SAMPLE_S)
        assert self.core.snapshot()["shed"] == 0
        self.client_msgs.clear()
        self.dispatched.clear()


def error_code(msg: Msg) -> ErrorCode:
    assert msg.command is Command.ERROR
    return ErrorCode(msg.meta["code"])


# --------------------------------------------------------------------------- priorities


# Each arrival: (request id, priority, timeout in ms), all 1 ms after request 1 occupied
# the worker. Then one RESULT at a time (at T0 + offset) and the ids of the next BATCH.
ArrivalSpec = tuple[int, Priority, int]


@pytest.mark.parametrize(
    ("policy", "max_batch", "arrivals", "steps"),
    [
        pytest.param(
            "carpool",
            2,
            [
                (2, BULK, 900),
                (3, BULK, 500),
                (4, INTERACTIVE, 800),
                (5, INTERACTIVE, 600),
                (6, INTERACTIVE, 2000),
                (7, BULK, 3000),
            ],
            # Interactive first, earliest deadline first; then bulk, EDF.
            [(0.010, [5, 4]), (0.020, [6, 3]), (0.030, [2, 7])],
            id="interactive-first-each-edf",
        ),
        pytest.param(
            "carpool",
            1,
            [
                (2, INTERACTIVE, 500),
                (3, INTERACTIVE, 600),
                (4, BULK, 30),  # deadline T0 + 31 ms
                (5, BULK, 2000),
            ],
            [
                (0.005, [2]),  # bulk 4 still has slack: it waits behind interactive ones
                (0.025, [4]),  # its deadline is near: promoted ahead of interactive 3
                (0.027, [3]),
                (0.029, [5]),
            ],
            id="urgent-bulk-promoted",
        ),
        pytest.param(
            "fixed",
            2,
            [
                (2, BULK, 900),
                (3, BULK, 500),
                (4, INTERACTIVE, 800),
                (5, INTERACTIVE, 600),
                (6, INTERACTIVE, 2000),
                (7, BULK, 3000),
            ],
            # The fixed policy is FIFO: priorities and deadlines are ignored.
            [(0.010, [2, 3]), (0.020, [4, 5]), (0.030, [6, 7])],
            id="fixed-is-fifo",
        ),
    ],
)
def test_service_order(
    policy: str,
    max_batch: int,
    arrivals: list[ArrivalSpec],
    steps: list[tuple[float, list[int]]],
) -> None:
    h = Harness.make(policy, max_batch=max_batch, max_wait_s=0.0)
    h.submit(1)
    assert h.dispatched == [[1]]
    h.at(T0 + 0.001)
    for rid, priority, timeout_ms in arrivals:
        assert h.submit(rid, timeout_ms, priority) == []  # the worker is busy: all queue
    assert h.core.snapshot()["queued"] == len(arrivals)
    for offset, expected in steps:
        msgs = h.at(T0 + offset).result(h.last_batch_id())
        batches = [m.ids for m in msgs if m.command is Command.BATCH]
        assert batches == [expected]
    assert h.core.snapshot()["queued"] == 0
    assert h.dispatched == [[1], *(ids for _, ids in steps)]
    h.at(h.now + 0.001).result(h.last_batch_id())
    # Every request was answered exactly once, with its result.
    for rid in [1, *(a[0] for a in arrivals)]:
        assert len(h.replies_for(rid)) == 1
    assert not any(m.command is Command.ERROR for _, m in h.client_msgs)


def test_bulk_is_served_when_no_interactive_request_waits() -> None:
    h = Harness.make(max_batch=1, max_wait_s=0.0)
    h.submit(1)
    h.at(T0 + 0.001)
    h.submit(2, 5000, BULK)
    h.submit(3, 4000, BULK)
    msgs = h.at(T0 + 0.002).result(h.last_batch_id())
    assert [m.ids for m in msgs if m.command is Command.BATCH] == [[3]]
    h.submit(4, 9000, INTERACTIVE)  # arrives while 3 runs: goes before bulk 2
    msgs = h.at(T0 + 0.003).result(h.last_batch_id())
    assert [m.ids for m in msgs if m.command is Command.BATCH] == [[4]]
    msgs = h.at(T0 + 0.004).result(h.last_batch_id())
    assert [m.ids for m in msgs if m.command is Command.BATCH] == [[2]]


# --------------------------------------------------------------------------- admission


@pytest.mark.parametrize(
    "timeout_ms",
    [
        1,
        10,  # below the best case at the door: 1 sample / (4 per 70 ms) = 17.5 ms
        30,  # below a batch of one: 55 ms
        54,
        # A batch of one would just make it, with nothing to spare for its spread (at
        # least 2%) within the door's headroom (10% of the timeout).
        56,
        60,
    ],
)
def test_hopeless_request_is_answered_at_once(timeout_ms: int) -> None:
    h = Harness.make()
    h.calibrate()
    msgs = h.submit(77, timeout_ms)
    assert len(msgs) == 1
    (msg,) = msgs
    assert msg.side is Side.FRONTEND
    assert msg.command is Command.ERROR
    assert msg.rid == 77
    assert msg.meta["code"] == 3
    assert error_code(msg) is ErrorCode.DEADLINE_EXCEEDED
    snapshot = h.core.snapshot()
    assert snapshot["shed"] == 1
    assert snapshot["errors"] == {"DEADLINE_EXCEEDED": 1}
    assert snapshot["queued"] == 0
    # Nothing more happens for it: no batch, no second answer.
    h.at(h.now + 2.0).tick()
    assert all(77 not in ids for ids in h.dispatched)
    assert len(h.errors_for(77)) == 1
    assert h.core.snapshot()["shed"] == 1


@pytest.mark.parametrize("timeout_ms", [65, 100, 1000])
def test_request_that_can_make_it_is_served(timeout_ms: int) -> None:
    h = Harness.make()
    h.calibrate()
    msgs = h.submit(78, timeout_ms)
    assert all(m.command is Command.BATCH for m in msgs)  # no early answer
    assert h.run_until_batch(0) == [78]
    h.at(h.now + 0.055).result(h.last_batch_id(), compute_ms=55.0)
    assert len(h.replies_for(78)) == 1
    assert h.errors_for(78) == []
    assert h.core.snapshot()["shed"] == 0


def test_hopeless_requests_are_not_shed_before_calibration() -> None:
    # Without a fitted cost the broker cannot know a request is hopeless: it serves it.
    h = Harness.make()
    msgs = h.submit(1, 1)
    assert [m.command for m in msgs] == [Command.BATCH]
    assert h.dispatched == [[1]]
    assert h.core.snapshot()["shed"] == 0


def test_fixed_policy_admits_hopeless_requests() -> None:
    h = Harness.make("fixed")
    h.calibrate()
    assert h.submit(77, 10) == []  # queued, no early answer
    assert h.run_until_batch() == [77]  # and even sent to the worker (at T_max)
    assert h.core.snapshot()["shed"] == 0


# --------------------------------------------------------------------------- shedding in queue


def _queue_behind_busy_worker(h: Harness, timeout_ms: int = 200) -> tuple[float, float]:
    """Occupy the worker with request 10, queue request 11; its (arrival, deadline)."""
    before = len(h.dispatched)
    h.submit(10, 1000)
    assert h.run_until_batch(before) == [10]
    h.at(h.now + 0.001)
    assert h.submit(11, timeout_ms) == []
    return h.now, h.now + timeout_ms / 1000


@pytest.mark.parametrize(
    ("policy", "shed_early"),
    [("carpool", True), ("fixed", False)],
)
def test_queued_request_turning_hopeless(policy: str, shed_early: bool) -> None:
    """The worker holds a batch longer than predicted; request 11 waits behind it.

    carpool answers it DEADLINE_EXCEEDED as soon as a batch of one started now would end
    past its deadline (55 ms before it); the fixed policy only at the deadline. The driver
    ticks at the announced wake-ups, a microsecond later at the earliest (as the
    simulator does).
    """
    h = Harness.make(policy)
    h.calibrate()
    arrival, deadline = _queue_behind_busy_worker(h)
    answered_at = None
    for _ in range(50):
        wake = h.core.next_wakeup(h.now)
        assert wake is not None
        h.at(max(wake, h.now + 1e-6)).tick()
        errors = h.errors_for(11)
        if errors:
            answered_at = errors[0][0]
            break
    assert answered_at is not None
    (_, msg), *more = h.errors_for(11)
    assert more == []
    assert error_code(msg) is ErrorCode.DEADLINE_EXCEEDED
    if shed_early:
        # Hopeless from deadline − est(1) on; answered then, not at the deadline.
        assert deadline - (FIXED_S + PER_SAMPLE_S) <= answered_at < deadline - 0.05
        assert h.core.snapshot()["shed"] == 1
    else:
        assert answered_at == pytest.approx(deadline)
        assert answered_at >= deadline
        assert h.core.snapshot()["shed"] == 0
    assert h.core.snapshot()["queued"] == 0
    # The worker finally answers request 10; request 11 never reaches it.
    h.at(h.now + 0.001).result(h.last_batch_id(), compute_ms=55.0)
    assert len(h.replies_for(10)) == 1
    assert all(11 not in ids for ids in h.dispatched)
    assert len(h.errors_for(11)) == 1
    assert arrival < answered_at


def test_tick_at_the_announced_time_makes_progress() -> None:
    """A driver that ticks exactly at ``next_wakeup`` must see the hopeless request
    answered: after ``on_tick(t)`` with nothing left to do at ``t``, the next wake-up
    must lie after ``t``."""
    h = Harness.make()
    h.calibrate()
    _, deadline = _queue_behind_busy_worker(h)
    for _ in range(50):
        wake = h.core.next_wakeup(h.now)
        assert wake is not None
        h.at(wake).tick()
        if h.errors_for(11):
            break
        later = h.core.next_wakeup(h.now)
        assert later is not None
        assert later > h.now, f"wake-up re-announced at {h.now} without progress"
    assert h.errors_for(11)
    assert h.errors_for(11)[0][0] < deadline


def test_a_queue_behind_a_busy_worker_wakes_when_its_verdict_can_change() -> None:
    """While the worker is busy, whether a queued request is hopeless does not change
    with time (its predicted start is the worker's predicted free time), so its queue
    wakes at that time at the earliest, not again and again before it.

    Request 15 is left behind by a full batch of 11..14 (EDF: their deadlines come first)
    with 0.1 ms of slack: a batch of one started when the worker is predicted free
    (70 ms on) would end 0.1 ms before its deadline. Waking at "deadline less (backlog
    plus a batch of one)", re-read at each wake-up, kept that 0.1 ms ahead of the clock:
    ~700 wake-ups before the worker's RESULT.
    """
    h = Harness.make(max_batch=4)
    h.calibrate()
    before = len(h.dispatched)
    h.submit(10)
    assert h.run_until_batch(before) == [10]
    free_s = h.now + FIXED_S + PER_SAMPLE_S  # the worker's predicted free time
    h.at(h.now + 0.0001)
    for rid in (11, 12, 13, 14):
        assert h.submit(rid, 170) == []
    assert h.submit(15, 180) == []
    before = len(h.dispatched)
    h.at(free_s).result(h.last_batch_id(), compute_ms=1000 * (FIXED_S + PER_SAMPLE_S))
    assert h.dispatched[before:] == [[11, 12, 13, 14]]
    busy_until_s = free_s + FIXED_S + 4 * PER_SAMPLE_S
    wakes = 0
    while (wake := h.core.next_wakeup(h.now)) is not None and wake < busy_until_s:
        wakes += 1
        if wakes > 20:
            break
        h.at(wake).tick()
    assert wakes <= 1
    assert h.errors_for(15) == []
    # The worker answers on time; request 15 still makes it.
    before = len(h.dispatched)
    h.at(busy_until_s).result(h.last_batch_id(), compute_ms=1000 * (FIXED_S + 4 * PER_SAMPLE_S))
    assert h.run_until_batch(before) == [15]
    assert h.errors_for(15) == []


# --------------------------------------------------------------------------- overload


@pytest.mark.parametrize(
    ("calibrated", "retry_after_ms"),
    [
        # No fitted cost: the drain time is unknown; a modest 50 ms pause.
        (False, 50),
        # Two queued at 4 per 70 ms (50 + 5·4 ms): 35 ms to drain.
        (True, 35),
    ],
)
def test_full_queue_answers_overloaded(calibrated: bool, retry_after_ms: int) -> None:
    h = Harness.make(max_queued=2)
    if calibrated:
        h.calibrate()
    h.submit(1)
    assert h.run_until_batch(0) == [1]
    h.at(h.now + 0.001)
    assert h.submit(2) == []
    assert h.submit(3) == []
    msgs = h.submit(4)
    assert len(msgs) == 1
    msg = msgs[0]
    assert msg.side is Side.FRONTEND
    assert msg.rid == 4
    assert msg.meta["code"] == 4
    assert error_code(msg) is ErrorCode.OVERLOADED
    assert msg.meta["retry_after_ms"] == retry_after_ms
    assert msg.meta["retry_after_ms"] > 0
    snapshot = h.core.snapshot()
    assert snapshot["queued"] == 2
    assert snapshot["errors"] == {"OVERLOADED": 1}
    assert snapshot["shed"] == 0
    # Once the worker drains the queue, requests are admitted again.
    h.at(h.now + 0.06).result(h.last_batch_id(), compute_ms=55.0)
    assert h.run_until_batch(1) == [2, 3]
    assert h.submit(5) == []
    assert h.core.snapshot()["queued"] == 1
    assert h.errors_for(5) == []
    assert all(4 not in ids for ids in h.dispatched)
