"""The engine watchdog (protocol §10.6), on BrokerCore with an injected clock: a batch
past max(factor × predicted, predicted + slack) makes its worker UNHEALTHY, its requests
go to other workers while their attempts and deadlines allow, its late RESULT is dropped
and counted, and the worker gets batches again only after it shows progress. Uses
harness.py."""

from __future__ import annotations

import math
from typing import Any

import pytest

from carpool.broker.registry import Health
from carpool.broker.requests import WorkerId
from carpool.common.errors import ErrorCode
from carpool.common.protocol import Command, encode
from tests.unit.broker.harness import C1, C2, T0, W1, W2, Broker, Msg, batches, ids, to_clients


def health(b: Broker, wid: bytes) -> Health:
    worker = b.core.registry.get(WorkerId(wid))
    assert worker is not None
    return worker.health


def taught(b: Broker, compute_ms: float, now: float = T0) -> float:
    """The only worker runs one batch of one sample in ``compute_ms``: its lane predicts
    that much per sample from now on. Returns when the result came."""
    (first,) = batches(b.request(now, 99, timeout_ms=60_000) + b.tick(now + 0.5))
    done = now + 0.5
    b.result(done, first, compute_ms=compute_ms)
    return done


def busy(b: Broker, now: float, wid: bytes, busy_ms: int | None) -> list[Msg]:
    meta = {} if busy_ms is None else {"busy_ms": busy_ms}
    return b.worker(now, wid, encode(Command.HEARTBEAT, meta))


# --------------------------------------------------------------------------- the timing rule


@pytest.mark.parametrize(
    ("compute_ms", "config", "limit_s"),
    [
        (100.0, {}, 1.1),  # predicted + slack
        (400.0, {}, 2.0),  # 5 × predicted
        (400.0, {"watchdog_factor": 3.0, "watchdog_slack_s": 0.5}, 1.2),
        (100.0, {"watchdog_factor": 3.0, "watchdog_slack_s": 0.5}, 0.6),
    ],
    ids=["slack", "factor", "factor-configured", "slack-configured"],
)
def test_a_batch_past_its_limit_goes_to_another_worker(
    compute_ms: float, config: dict[str, Any], limit_s: float
) -> None:
    b = Broker.make(max_batch=1, **config)
    b.ready(T0, W1, slots=1)
    start = taught(b, compute_ms)
    b.ready(start, W2, slots=1)
    (msg,) = batches(b.request(start, 1, timeout_ms=10_000))
    assert msg.to == W1  # the tie goes to the first worker
    due = start + limit_s
    assert b.core.registry.next_due_s() == pytest.approx(due)
    assert b.core.next_wakeup(start + 0.001) <= due  # type: ignore[operator]
    assert batches(b.tick(math.nextafter(due, 0) - 1e-9)) == []
    assert health(b, W1) is Health.HEALTHY
    (again,) = batches(b.tick(due))
    assert (again.to, ids(again)) == (W2, [1])
    assert again.batch.batch_id != msg.batch.batch_id
    assert health(b, W1) is Health.UNHEALTHY
    stats = b.core.stats
    assert (stats.unhealthy, stats.requeued) == (1, 1)
    snap = b.core.snapshot()
    assert snap["unhealthy"] == 1
    assert [w["health"] for w in snap["workers"]] == ["unhealthy", "healthy"]


def test_a_workers_first_batch_is_timed_by_what_another_worker_of_the_model_showed() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, slots=1)
    start = taught(b, 400.0)
    b.ready(start, W2, slots=2)  # more free credits: the next batch goes to it
    (msg,) = batches(b.request(start, 1, timeout_ms=10_000))
    assert msg.to == W2
    assert b.core.registry.next_due_s() == pytest.approx(start + 2.0)  # 5 × W1's 0.4 s


def test_without_any_prediction_a_batch_may_run_until_its_last_deadline() -> None:
    """Nothing is known of the model yet: slow cannot be told from hung, so the watchdog
    waits for the batch's last deadline (the slack at least)."""
    b = Broker.make(max_batch=2, max_wait_s=0.5)
    b.ready(T0, W1, slots=1)
    b.request(T0, 1, timeout_ms=4_000)
    (msg,) = batches(b.request(T0, 2, timeout_ms=500))
    assert ids(msg) == [1, 2]
    assert b.core.registry.next_due_s() == pytest.approx(T0 + 4.0)
    for t in (T0 + 1.0, T0 + 2.0, T0 + 3.0):
        b.heartbeat(t, W1)
        b.tick(t)
    assert b.core.stats.unhealthy == 0
    # A slow first batch is answered, not given up on.
    out, _ = b.result(T0 + 3.5, msg, compute_ms=3500.0)
    assert 1 in [m.rid for m in to_clients(out)]


def test_a_batch_behind_another_is_timed_from_when_the_first_is_answered() -> None:
    """A worker runs its batches in order: the second waits its turn without penalty."""
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, slots=2)
    start = taught(b, 10.0)
    first, second = batches(
        b.request(start, 1, timeout_ms=10_000) + b.request(start, 2, timeout_ms=10_000)
    )
    answered = start + 0.9  # the first took 0.9 s: within its limit of 1.01 s
    b.result(answered, first, compute_ms=900.0)
    assert batches(b.tick(start + 1.5)) == []  # the second: 1.5 s since its dispatch
    assert health(b, W1) is Health.HEALTHY
    # Its own limit (the lane now predicts more: at least predicted + 1 s) counts from
    # the answer to the first.
    assert b.core.registry.next_due_s() > answered + 1.0  # type: ignore[operator]
    out, _ = b.result(start + 1.6, second, compute_ms=700.0)
    assert [(m.to, m.rid) for m in to_clients(out)] == [(C1, 2)]
    assert b.core.stats.unhealthy == 0


def test_a_worker_that_answers_in_time_is_never_marked() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, slots=1)
    now = T0
    for rid in range(1, 20):
        (msg,) = batches(b.request(now, rid, timeout_ms=10_000))
        now += 0.9  # each batch just inside the slack
        b.heartbeat(now, W1)
        out, _ = b.result(now, msg, compute_ms=10.0)
        assert [m.rid for m in to_clients(out)] == [rid]
    assert b.core.stats.unhealthy == 0
    assert b.core.registry.next_due_s() is None  # nothing left to watch


# --------------------------------------------------------------------------- redispatch


def test_every_batch_the_worker_holds_goes_back_and_each_request_is_answered_once() -> None:
    b = Broker.make(max_batch=2, max_attempts=2)
    b.ready(T0, W1, slots=2)
    start = taught(b, 10.0)
    first, second = batches(
        b.request(start, 1, timeout_ms=10_000)
        + b.request(start, 2, C2, timeout_ms=10_000)
        + b.request(start, 3, timeout_ms=10_000)
        + b.request(start, 4, C2, timeout_ms=10_000)
    )
    assert (ids(first), ids(second)) == ([1, 2], [3, 4])
    now = start + 1.1
    assert batches(b.tick(now)) == []  # nobody else serves the model: they queue
    assert b.core.queued == 4
    assert b.core.inflight_batches == 0
    sent = batches(b.ready(now, W2, slots=2))
    assert [ids(m) for m in sent] == [[1, 2], [3, 4]]  # FIFO kept
    replies = []
    for msg in sent:
        replies += to_clients(b.result(now + 0.1, msg)[0])
    # The late RESULTs of the hung worker answer nobody again.
    for msg in (first, second):
        out, _ = b.result(now + 0.2, msg)
        assert to_clients(out) == []
    assert sorted((m.to, m.rid) for m in replies) == [(C1, 1), (C1, 3), (C2, 2), (C2, 4)]
    assert b.core.stats.late_results == 2
    assert b.core.stats.replies == 5  # with the teaching one


def test_requests_out_of_attempts_or_time_are_answered_not_requeued() -> None:
    b = Broker.make(max_batch=3, max_attempts=1)
    b.ready(T0, W1, slots=1)
    start = taught(b, 10.0)
    b.ready(start, W2, slots=1)
    b.request(start, 1, timeout_ms=500)  # expires while its batch runs
    b.request(start, 2, timeout_ms=5_000)
    (msg,) = batches(b.request(start, 3, C2, timeout_ms=5_000))
    (expired,) = to_clients(b.tick(start + 0.5))
    assert (expired.rid, expired.code) == (1, ErrorCode.DEADLINE_EXCEEDED)
    out = b.tick(start + 1.1)
    assert batches(out) == []
    errors = sorted((m.to, m.rid, m.code) for m in to_clients(out))
    assert errors == [(C1, 2, ErrorCode.UNAVAILABLE), (C2, 3, ErrorCode.UNAVAILABLE)]
    assert "watchdog" in to_clients(out)[0].meta["message"]
    assert to_clients(b.result(start + 1.5, msg)[0]) == []  # and the late RESULT: nothing


def test_the_hung_batch_teaches_its_cost_and_its_requests_get_a_second_go() -> None:
    """A model that became slower than its limit: the batch trips, but its late RESULT
    teaches the lane, so the next one is given its time."""
    b = Broker.make(max_batch=1, max_attempts=2)
    b.ready(T0, W1, slots=1)
    start = taught(b, 100.0)
    (msg,) = batches(b.request(start, 1, timeout_ms=60_000))
    b.tick(start + 1.1)
    assert health(b, W1) is Health.UNHEALTHY
    (again,) = batches(b.result(start + 3.0, msg, compute_ms=3000.0)[0])
    assert (again.to, ids(again)) == (W1, [1])
    assert health(b, W1) is Health.PROBATION
    b.heartbeat(start + 5.0, W1)
    assert batches(b.tick(start + 6.0)) == []  # the lane now predicts more than 1 s
    out, _ = b.result(start + 6.0, again, compute_ms=3000.0)
    assert [(m.to, m.rid) for m in to_clients(out)] == [(C1, 1)]
    assert health(b, W1) is Health.HEALTHY
    assert b.core.stats.late_results == 1


# --------------------------------------------------------------------------- recovery


def test_an_unhealthy_worker_waits_for_a_sign_of_progress_then_gets_one_credit() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, slots=2)
    start = taught(b, 10.0)
    batches(b.request(start, 1, timeout_ms=10_000) + b.request(start, 2, timeout_ms=10_000))
    tripped = start + 1.1
    b.tick(tripped)
    for rid in (3, 4):
        assert batches(b.request(tripped, rid, timeout_ms=10_000)) == []
    # A HEARTBEAT says nothing without busy_ms, and a thread still on the hung batch
    # (busy since before the trip) is no progress.
    assert batches(busy(b, tripped + 0.5, W1, None)) == []
    assert batches(busy(b, tripped + 1.0, W1, 2000)) == []
    assert health(b, W1) is Health.UNHEALTHY
    # Idle, or a batch begun after the trip: probation, one batch at a time.
    (one,) = batches(busy(b, tripped + 1.2, W1, 100))
    assert ids(one) == [1]
    assert health(b, W1) is Health.PROBATION
    assert b.core.queued == 3
    # An answer to a batch it holds: healthy, every credit back.
    out, _ = b.result(tripped + 1.3, one)
    assert [m.rid for m in to_clients(out)] == [1]
    assert [ids(m) for m in batches(out)] == [[2], [3]]
    assert health(b, W1) is Health.HEALTHY


def test_a_worker_on_probation_that_hangs_again_is_unhealthy_again() -> None:
    b = Broker.make(max_batch=1, max_attempts=3)
    b.ready(T0, W1, slots=4)
    start = taught(b, 10.0)
    batches(b.request(start, 1, timeout_ms=30_000) + b.request(start, 2, timeout_ms=30_000))
    b.tick(start + 1.1)
    assert len(batches(busy(b, start + 1.5, W1, 0))) == 1
    b.heartbeat(start + 2.6, W1)
    assert batches(b.tick(start + 2.6)) == []  # the probation batch trips too
    assert health(b, W1) is Health.UNHEALTHY
    assert b.core.stats.unhealthy == 2
    assert b.core.queued == 2


def test_a_peer_that_takes_every_credit_and_answers_nothing_loses_them() -> None:
    """1,024 credits and no answer: after its limit (from what the real worker showed of
    the model) its batches go to the real worker, and every request is answered within
    its deadline."""
    b = Broker.make(max_batch=4)
    bad, good = b"bad", b"good"
    b.ready(T0, good, slots=2)
    start = taught(b, 10.0)
    b.ready(start, bad, slots=1024)
    sent = []
    for rid in range(1, 21):
        sent += batches(b.request(start, rid, timeout_ms=3_000))
    assert {m.to for m in sent} == {bad}
    now = start + 1.1
    out = busy(b, now, bad, None) + b.tick(now)  # it keeps its registration alive
    pending = batches(out)
    answered: list[int | None] = []
    while pending:
        msg = pending.pop(0)
        assert msg.to == good
        now += 0.01
        out, _ = b.result(now, msg, compute_ms=10.0)
        answered += [m.rid for m in to_clients(out)]
        pending += batches(out)
    assert sorted(rid or 0 for rid in answered) == list(range(1, 21))
    assert now < start + 3.0
    assert health(b, bad) is Health.UNHEALTHY
    assert all(m.to == good for m in batches(b.request(now, 21, timeout_ms=10_000)))


def test_answered_batches_leave_no_timers_behind() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, slots=2)
    for rid in range(1, 200):
        (msg,) = batches(b.request(T0, rid, timeout_ms=10_000))
        b.result(T0, msg, compute_ms=1.0)
    assert b.core.registry.next_due_s() is None
    assert b.core.next_wakeup(T0) == T0 + 1.0  # the heartbeat, not a stale timer
