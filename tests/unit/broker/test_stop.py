"""begin_stop (protocol.md §11) on BrokerCore with an injected clock: of the queued
requests whose cost is known, those predicted to be answered within the stop grace stay
queued and are dispatched as usual; the others are answered UNAVAILABLE at once. Uses
harness.py."""

from __future__ import annotations

from carpool.common.errors import ErrorCode
from tests.unit.broker.harness import C1, T0, W1, Broker, batches, ids, to_clients


def taught(b: Broker) -> float:
    """The only worker runs a batch of one in 400 ms and one of two in 800 ms: its cost
    is known (0.4 s a sample) from then on. Returns when the second result came."""
    (first,) = batches(b.request(T0, 97, timeout_ms=60_000))
    b.request(T0, 98, timeout_ms=60_000)
    b.request(T0, 99, timeout_ms=60_000)
    done, _ = b.result(T0 + 0.4, first, compute_ms=400.0)
    (pair,) = batches(done)
    assert ids(pair) == [98, 99]
    b.result(T0 + 1.2, pair, compute_ms=800.0)
    return T0 + 1.2


def test_a_stop_keeps_the_queued_requests_that_finish_within_the_grace_and_refuses_the_rest() -> (
    None
):
    b = Broker.make(max_batch=2, max_wait_s=0.0)
    b.ready(T0, W1, slots=1)
    now = taught(b) + 1.0
    (running,) = batches(b.request(now, 1, C1, timeout_ms=60_000))
    assert ids(running) == [1]
    for rid in (2, 3, 4, 5):
        assert batches(b.request(now, rid, C1, timeout_ms=60_000)) == []
    assert b.core.queued == 4
    # The worker is free in 0.4 s; then 2 is answered by 0.8 s, 3 (with 2) by 1.2 s, 4 by
    # 1.6 s and 5 (with 4) by 2.0 s: with 1.3 s of grace, 4 and 5 are refused at once.
    out = to_clients(b._turn(now, b.core.begin_stop(now, now + 1.3)))
    assert sorted((m.rid, m.code) for m in out) == [
        (4, ErrorCode.UNAVAILABLE),
        (5, ErrorCode.UNAVAILABLE),
    ]
    assert all("stopping" in m.meta["message"] for m in out)
    assert b.core.queued == 2
    # The kept ones are dispatched when the worker is free, and answered.
    done, _ = b.result(now + 0.4, running, compute_ms=400.0)
    assert [m.rid for m in to_clients(done)] == [1]
    (pair,) = batches(done)
    assert ids(pair) == [2, 3]
    done, _ = b.result(now + 1.2, pair, compute_ms=800.0)
    assert [m.rid for m in to_clients(done)] in ([2, 3], [3, 2])
    assert b.core.queued == 0
    assert batches(done) == []


def test_a_stop_without_a_grace_refuses_every_queued_request() -> None:
    b = Broker.make(max_batch=1, max_wait_s=0.0)
    b.ready(T0, W1, slots=1)
    (running,) = batches(b.request(T0, 1, C1, timeout_ms=60_000))
    for rid in (2, 3):
        b.request(T0, rid, C1, timeout_ms=60_000)
    out = to_clients(b._turn(T0, b.core.begin_stop(T0)))
    assert sorted((m.rid, m.code) for m in out) == [
        (2, ErrorCode.UNAVAILABLE),
        (3, ErrorCode.UNAVAILABLE),
    ]
    assert b.core.queued == 0
    assert [m.rid for m in to_clients(b.result(T0 + 0.1, running)[0])] == [1]


def test_every_answer_with_retry_says_how_long_the_stopping_broker_may_still_be_there() -> None:
    """``retry_after_ms``: the time left until ``closes_s``, the latest the server will
    have closed its frontend (begin_stop's, then finish_stop's once the grace is over),
    on the queued requests answered at the stop, on those arriving during it, and at the
    last word; an answer without ``retry`` carries none."""
    b = Broker.make(max_batch=2, max_wait_s=0.0)
    b.ready(T0, W1, slots=1)
    now = taught(b) + 1.0
    (_running,) = batches(b.request(now, 1, C1, timeout_ms=60_000))
    for rid in (2, 3, 4, 5):
        b.request(now, rid, C1, timeout_ms=60_000)
    out = to_clients(b._turn(now, b.core.begin_stop(now, now + 1.3, now + 3.3)))
    assert sorted((m.rid, m.meta["retry"], m.meta["retry_after_ms"]) for m in out) == [
        (4, True, 3300),
        (5, True, 3300),
    ]
    (late,) = to_clients(b.request(now + 0.5, 6, C1))
    assert (late.code, late.meta["retry"], late.meta["retry_after_ms"]) == (
        ErrorCode.UNAVAILABLE,
        True,
        2800,
    )
    final = to_clients(b._turn(now + 1.3, b.core.finish_stop(now + 1.3, now + 2.3)))
    by_id = {m.rid: m.meta for m in final}
    assert set(by_id) == {1, 2, 3}  # 2 and 3 still waited for the worker
    assert by_id[1].get("retry") is None  # at a worker: it may have run
    assert "retry_after_ms" not in by_id[1]
    assert all(by_id[r]["retry_after_ms"] == 1000 for r in by_id if r != 1)
    (last,) = to_clients(b.request(now + 2.0, 7, C1))
    assert last.meta["retry_after_ms"] == 300
