"""registry.py: workers, credits, liveness, load."""

from __future__ import annotations

import pytest

from carpool.broker.registry import HEALTH_MOVES, Health, WorkerRegistry
from carpool.broker.requests import WorkerId
from carpool.common.protocol import ModelSpec, Ready, TensorMeta
from tests.unit.broker.pending import pending_request

#: The queue key of model "m"'s requests of one item shape (the registry reads its model).
KEY = ("m", (("x", "float32", (4,)),))


def spec(name: str = "m", max_batch: int = 8, item: int = 4) -> ModelSpec:
    return ModelSpec(
        name,
        (TensorMeta("x", "float32", (-1, item)),),
        (TensorMeta("y", "float32", (-1, 2)),),
        max_batch,
    )


def ready(name: str = "w", slots: int = 2, *models: ModelSpec) -> Ready:
    return Ready(name, slots, models or (spec(),))


W1, W2, W3 = WorkerId(b"w1"), WorkerId(b"w2"), WorkerId(b"w3")


def test_add_get_remove() -> None:
    reg = WorkerRegistry()
    assert len(reg) == 0
    state = reg.add(10.0, W1, ready("one", 3), 0.5)
    assert W1 in reg
    assert len(reg) == 1
    assert reg.get(W1) is state
    assert (state.name, state.slots, state.free_slots) == ("one", 3, 3)
    assert state.heartbeat_s == 0.5
    assert state.last_seen_s == 10.0
    assert state.next_heartbeat_s == 10.5
    assert list(state.models) == ["m"]
    assert reg.serving("m") == [state]
    assert reg.remove(W1) is state
    assert W1 not in reg
    assert reg.serving("m") == []
    assert reg.remove(W1) is None
    assert reg.get(W1) is None


def test_first_spec_wins_and_is_remembered() -> None:
    reg = WorkerRegistry()
    reg.add(0.0, W1, ready("a", 1, spec(max_batch=4)), 1.0)
    reg.add(0.0, W2, ready("b", 1, spec(max_batch=16)), 1.0)
    assert reg.specs["m"].max_batch == 4
    reg.remove(W1)
    reg.remove(W2)
    assert "m" in reg.specs  # a model once served is known (NOT_FOUND vs UNAVAILABLE)


def test_conflicts() -> None:
    reg = WorkerRegistry()
    assert reg.conflicts(ready("a", 1, spec())) == []
    reg.add(0.0, W1, ready("a", 1, spec(), spec("n")), 1.0)
    # A different max_batch is fine; different inputs or outputs are not.
    assert reg.conflicts(ready("b", 1, spec(max_batch=2))) == []
    assert reg.conflicts(ready("b", 1, spec(item=5), spec("n"), spec("new", item=9))) == ["m"]
    other_out = ModelSpec("n", spec().inputs, (TensorMeta("y", "float16", (-1, 2)),), 8)
    assert reg.conflicts(ready("b", 1, other_out)) == ["n"]


def test_a_model_no_live_worker_serves_takes_the_next_spec() -> None:
    reg = WorkerRegistry()
    reg.add(0.0, W1, ready("a", 1, spec(), spec("n")), 1.0)
    wide = ready("b", 1, spec(item=5), spec("n"))
    assert reg.replaced(wide) == []  # "m" is served: a conflict, not a replacement
    reg.remove(W1)
    assert reg.conflicts(wide) == []
    assert reg.replaced(wide) == [spec(item=5)]  # "n" is the same spec: kept as it is
    reg.add(1.0, W2, wide, 1.0)
    assert reg.specs["m"] == spec(item=5)
    assert reg.conflicts(ready("c", 1, spec())) == ["m"]
    # Another max_batch alone is no replacement; the last spec registered is kept.
    reg.remove(W2)
    assert reg.replaced(ready("c", 1, spec(item=5, max_batch=2))) == []


def test_readd_replaces() -> None:
    reg = WorkerRegistry()
    reg.add(0.0, W1, ready("a", 1), 1.0)
    state = reg.add(5.0, W1, ready("a2", 4), 2.0)
    assert len(reg) == 1
    assert reg.serving("m") == [state]
    assert reg.get(W1) is state


def test_max_batch_over_live_workers() -> None:
    reg = WorkerRegistry()
    assert reg.max_batch("m") == 0
    reg.add(0.0, W1, ready("a", 1, spec(max_batch=4)), 1.0)
    reg.add(0.0, W2, ready("b", 1, spec(max_batch=16)), 1.0)
    assert reg.max_batch("m") == 16
    reg.remove(W2)
    assert reg.max_batch("m") == 4
    assert reg.max_batch("other") == 0


def test_best_free_prefers_free_credits_then_low_rho() -> None:
    reg = WorkerRegistry()
    a = reg.add(0.0, W1, ready("a", 2), 1.0)
    b = reg.add(0.0, W2, ready("b", 2), 1.0)
    a.rho, b.rho = 0.9, 0.1
    assert reg.best_free(KEY, 1) is b
    b.outstanding.add(1)
    assert reg.best_free(KEY, 1) is a  # more free credits beats lower load
    a.outstanding.update({2, 3})
    assert reg.best_free(KEY, 1) is b
    b.outstanding.add(4)
    assert reg.best_free(KEY, 1) is None
    assert reg.best_free(("other", KEY[1]), 1) is None


def test_health_sets_the_credits_and_only_moves_along_its_table() -> None:
    reg = WorkerRegistry()
    w = reg.add(0.0, W1, ready("w", 4), 1.0)
    other = reg.add(0.0, W2, ready("o", 1), 1.0)
    assert (w.health, w.free_slots) == (Health.HEALTHY, 4)
    reg.set_health(5.0, w, Health.UNHEALTHY)
    assert (w.free_slots, w.unhealthy_since_s) == (0, 5.0)
    assert reg.best_free(KEY, 1) is other  # the fewer credits of a healthy worker win
    reg.set_health(6.0, w, Health.PROBATION)
    assert w.free_slots == 1
    w.outstanding.add(1)
    assert w.free_slots == 0
    reg.set_health(7.0, w, Health.HEALTHY)
    assert w.free_slots == 3
    for frm in Health:
        for to in Health:
            if (frm, to) not in HEALTH_MOVES:
                w.health = frm
                with pytest.raises(AssertionError, match="worker health"):
                    reg.set_health(8.0, w, to)


def test_set_credits_changes_the_slots_and_the_credits_within_the_health() -> None:
    reg = WorkerRegistry()
    w = reg.add(0.0, W1, ready("w", 2), 1.0)
    assert (w.slots, w.credits, w.free_slots) == (2, 2, 2)
    w.outstanding.update({1, 2})
    reg.set_credits(w, 4)
    assert (w.slots, w.credits, w.free_slots) == (4, 4, 2)
    assert reg.best_free(KEY, 1) is w
    # Fewer than it holds: what it holds stays, and it gets nothing more.
    reg.set_credits(w, 1)
    assert (w.slots, w.credits, w.free_slots) == (1, 1, -1)
    assert reg.best_free(KEY, 1) is None
    w.outstanding.clear()
    # Within its health: none while UNHEALTHY, one on PROBATION, the slots once HEALTHY.
    reg.set_health(1.0, w, Health.UNHEALTHY)
    reg.set_credits(w, 3)
    assert (w.slots, w.credits) == (3, 0)
    reg.set_health(2.0, w, Health.PROBATION)
    assert (w.slots, w.credits) == (3, 1)
    reg.set_credits(w, 5)
    assert (w.slots, w.credits) == (5, 1)
    reg.set_health(3.0, w, Health.HEALTHY)
    assert (w.slots, w.credits, w.free_slots) == (5, 5, 5)


def test_best_free_respects_max_batch() -> None:
    reg = WorkerRegistry()
    small = reg.add(0.0, W1, ready("small", 4, spec(max_batch=2)), 1.0)
    big = reg.add(0.0, W2, ready("big", 1, spec(max_batch=8)), 1.0)
    assert reg.best_free(KEY, 2) is small
    assert reg.best_free(KEY, 3) is big
    big.outstanding.add(1)
    assert reg.best_free(KEY, 3) is None
    assert reg.best_free(KEY, 9) is None


@pytest.mark.parametrize(
    ("liveness", "hb", "silent_s", "expired"),
    [
        (3, 1.0, 2.99, False),
        (3, 1.0, 3.0, True),
        (1, 0.25, 0.24, False),
        (1, 0.25, 0.25, True),
        (5, 0.1, 10.0, True),
    ],
)
def test_expired(liveness: int, hb: float, silent_s: float, expired: bool) -> None:
    reg = WorkerRegistry(liveness=liveness)
    state = reg.add(100.0, W1, ready(), hb)
    assert reg.expired(100.0 + silent_s) == ([state] if expired else [])


def test_touch_keeps_alive() -> None:
    reg = WorkerRegistry(liveness=3)
    state = reg.add(0.0, W1, ready(), 1.0)
    assert reg.touch(2.5, W1) is state
    assert reg.expired(3.0) == []
    assert reg.expired(5.5) == [state]
    assert reg.touch(1.0, W2) is None


def test_next_event() -> None:
    reg = WorkerRegistry(liveness=3)
    assert reg.next_event_s() is None
    a = reg.add(10.0, W1, ready("a"), 1.0)
    assert reg.next_event_s() == 11.0  # heartbeat due before expiry at 13
    a.next_heartbeat_s = 20.0
    assert reg.next_event_s() == 11.0  # cached until the caller says times changed
    reg.reschedule()
    assert reg.next_event_s() == 13.0  # expiry is earlier now
    reg.touch(12.0, W1)
    assert reg.next_event_s() == 13.0  # a later expiry: the cached time is early, never late
    reg.reschedule()
    assert reg.next_event_s() == 15.0
    reg.add(10.0, W2, ready("b"), 0.5)
    assert reg.next_event_s() == 10.5
    reg.remove(W2)
    assert reg.next_event_s() == 15.0


def test_max_batch_follows_workers() -> None:
    reg = WorkerRegistry()
    assert reg.max_batch("m") == 0
    reg.add(0.0, W1, ready("a", 2, spec("m", max_batch=4)), 1.0)
    reg.add(0.0, W2, ready("b", 2, spec("m", max_batch=16)), 1.0)
    assert reg.max_batch("m") == 16
    reg.remove(W2)
    assert reg.max_batch("m") == 4
    reg.remove(W1)
    assert reg.max_batch("m") == 0


def test_all_lists_live_workers() -> None:
    reg = WorkerRegistry()
    reg.add(0.0, W1, ready("a"), 1.0)
    reg.add(0.0, W2, ready("b"), 1.0)
    reg.add(0.0, W3, ready("c", 1, spec("n")), 1.0)
    assert sorted(w.name for w in reg.all()) == ["a", "b", "c"]
    assert [w.name for w in reg.serving("n")] == ["c"]


def test_the_batches_at_a_worker_change_its_credits_in_use_and_its_free_time() -> None:
    """The registry holds the batches at its workers: a dispatch takes a credit and moves
    the worker's predicted free time; an answer gives the credit back and restarts the
    worker's queue from then; taking them all frees it. A batch with no prediction is
    watched until its last deadline (slow cannot be told from hung)."""
    reg = WorkerRegistry(watchdog_factor=5.0, watchdog_slack_s=1.0)
    worker = reg.add(10.0, W1, ready("one", 3), 0.5)
    first = reg.dispatched(10.0, worker, [pending_request(1)], KEY, 1, 0.2)
    second = reg.dispatched(10.0, worker, [pending_request(2, deadline_s=40.0)], KEY, 1, 0.0)
    assert [first.watch_s, second.watch_s] == pytest.approx([1.2, 30.0])
    assert (worker.outstanding, worker.free_slots) == ({first.batch_id, second.batch_id}, 1)
    assert worker.free_at_s == pytest.approx(10.2)
    assert reg.next_due_s() == pytest.approx(11.2)  # the head's: dispatched at 10.0
    assert reg.answered(10.5, worker, first.batch_id) is first
    assert reg.answered(10.5, worker, first.batch_id) is None  # answered once
    assert worker.free_at_s == pytest.approx(10.5)  # (the second predicts nothing)
    assert reg.next_due_s() == pytest.approx(40.5)  # the second is the head from 10.5
    assert reg.take_all(worker) == [second]
    assert (worker.outstanding, reg.batches_held, reg.next_due_s()) == (set(), 0, None)
