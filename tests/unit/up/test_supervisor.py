"""The supervisor of ``carpool up``: start, restart with backoff, give up, scale, stop."""

from __future__ import annotations

import pytest

from carpool.up.supervisor import BROKER, Action, ChildState, RestartPolicy, Supervisor, Verb


def start(name: str) -> Action:
    return Action(Verb.START, name)


def terminate(name: str) -> Action:
    return Action(Verb.TERMINATE, name)


def kill(name: str) -> Action:
    return Action(Verb.KILL, name)


POLICY = RestartPolicy(base_s=1.0, max_s=8.0, stable_s=10.0, max_restarts=3, stop_timeout_s=5.0)


def _sup(workers: int = 2) -> Supervisor:
    return Supervisor(workers, POLICY)


def test_start_runs_the_broker_then_every_worker() -> None:
    sup = _sup(3)
    assert sup.on_start(0.0) == [
        start(BROKER),
        start("worker-0"),
        start("worker-1"),
        start("worker-2"),
    ]
    assert [c.state for c in sup.snapshot()] == ["running"] * 4
    assert sup.next_wakeup() is None


def test_a_worker_that_dies_is_started_again_after_a_doubling_backoff() -> None:
    sup = _sup()
    sup.on_start(0.0)
    # Quick deaths in a row: 1 s, then 2 s, then 4 s.
    t = 1.0
    for delay_s in (1.0, 2.0, 4.0):
        assert sup.on_exit(t, "worker-1", -9) == []
        assert sup.children["worker-1"].state is ChildState.BACKOFF
        assert sup.next_wakeup() == t + delay_s
        assert sup.on_tick(t + delay_s - 0.01) == []  # not yet
        assert sup.on_tick(t + delay_s) == [start("worker-1")]
        t += delay_s + 0.5
    assert sup.children["worker-1"].restarts == 3
    assert sup.children["worker-0"].state is ChildState.RUNNING  # the others untouched


def test_the_backoff_is_capped() -> None:
    policy = RestartPolicy(base_s=1.0, max_s=8.0, max_restarts=50)
    assert [policy.delay_s(n) for n in (1, 2, 3, 4, 5, 9)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_a_long_run_forgets_the_failures_before_it() -> None:
    sup = _sup()
    sup.on_start(0.0)
    sup.on_exit(1.0, "worker-0", 1)
    sup.on_tick(2.0)
    sup.on_exit(2.5, "worker-0", 1)  # second quick failure: 2 s
    assert sup.next_wakeup() == 4.5
    sup.on_tick(4.5)
    sup.on_exit(4.5 + POLICY.stable_s, "worker-0", 1)  # ran 10 s: back to the first delay
    assert sup.children["worker-0"].failures == 1
    assert sup.next_wakeup() == 4.5 + POLICY.stable_s + 1.0


def test_a_slot_that_keeps_failing_is_given_up_and_a_new_count_retries_it() -> None:
    sup = _sup()
    sup.on_start(0.0)
    t = 0.0
    for _ in range(POLICY.max_restarts):
        sup.on_exit(t, "worker-0", 2)
        t = sup.next_wakeup() or 0.0
        assert sup.on_tick(t) == [start("worker-0")]
    assert sup.on_exit(t, "worker-0", 2) == []
    assert sup.children["worker-0"].state is ChildState.FAILED
    assert sup.next_wakeup() is None
    assert sup.on_tick(t + 100.0) == []  # never started again by itself
    assert not sup.gave_up_broker  # a worker: the fleet goes on
    assert sup.scale(t + 100.0, 2) == [start("worker-0")]


def test_a_broker_that_keeps_failing_is_given_up() -> None:
    sup = _sup(0)
    sup.on_start(0.0)
    t = 0.0
    for _ in range(POLICY.max_restarts + 1):
        sup.on_exit(t, BROKER, 1)
        t = sup.next_wakeup() or t
        sup.on_tick(t)
    assert sup.gave_up_broker


def test_a_start_that_fails_counts_as_a_quick_exit() -> None:
    sup = _sup(1)
    sup.on_start(0.0)
    sup.on_exit(0.0, "worker-0", None)
    assert sup.children["worker-0"].state is ChildState.BACKOFF
    assert sup.children["worker-0"].last_exit is None


def test_scaling_up_starts_the_missing_slots() -> None:
    sup = _sup(1)
    sup.on_start(0.0)
    assert sup.scale(1.0, 3) == [start("worker-1"), start("worker-2")]
    assert sup.scale(2.0, 3) == []


def test_scaling_down_drains_the_top_slots_then_kills_a_straggler() -> None:
    sup = _sup(3)
    sup.on_start(0.0)
    assert sup.scale(1.0, 1) == [terminate("worker-1"), terminate("worker-2")]
    assert sup.next_wakeup() == 1.0 + POLICY.stop_timeout_s
    assert sup.on_exit(2.0, "worker-1", 0) == []  # drained: not started again
    assert "worker-1" not in sup.children
    assert sup.on_tick(6.0) == [kill("worker-2")]
    assert sup.on_exit(6.1, "worker-2", -9) == []
    assert [c.name for c in sup.snapshot()] == [BROKER, "worker-0"]


def test_scaling_back_up_while_a_slot_drains_starts_it_once_it_is_gone() -> None:
    sup = _sup(2)
    sup.on_start(0.0)
    sup.scale(1.0, 1)
    assert sup.scale(1.5, 2) == []  # worker-1 is still draining
    assert sup.on_exit(2.0, "worker-1", 0) == [start("worker-1")]


def test_scaling_down_a_slot_in_backoff_drops_it() -> None:
    sup = _sup(2)
    sup.on_start(0.0)
    sup.on_exit(0.5, "worker-1", 1)
    assert sup.scale(0.6, 1) == []
    assert "worker-1" not in sup.children
    assert sup.on_tick(10.0) == []


def test_stop_drains_the_workers_first_then_the_broker() -> None:
    sup = _sup(2)
    sup.on_start(0.0)
    sup.on_exit(0.2, "worker-1", 1)  # in backoff: nothing to stop, never started again
    assert sup.stop(1.0) == [terminate("worker-0")]
    assert not sup.done
    assert sup.on_tick(5.0) == []
    assert sup.on_exit(2.0, "worker-0", 0) == [terminate(BROKER)]
    assert sup.scale(2.5, 4) == []  # no new workers once stopping
    assert sup.on_tick(2.0 + POLICY.stop_timeout_s) == [kill(BROKER)]
    assert sup.on_exit(7.5, BROKER, -9) == []
    assert sup.done


def test_stop_with_no_workers_stops_the_broker_at_once() -> None:
    sup = _sup(0)
    sup.on_start(0.0)
    assert sup.stop(1.0) == [terminate(BROKER)]
    sup.on_exit(1.5, BROKER, 0)
    assert sup.done


def test_a_worker_that_dies_while_stopping_is_not_started_again() -> None:
    sup = _sup(1)
    sup.on_start(0.0)
    sup.stop(1.0)
    assert sup.on_exit(1.1, "worker-0", -2) == [terminate(BROKER)]
    assert sup.on_tick(100.0) == [kill(BROKER)]


@pytest.mark.parametrize(
    "kwargs",
    [{"base_s": 0.0}, {"max_s": -1.0}, {"stop_timeout_s": 0.0}, {"max_restarts": -1}],
)
def test_a_bad_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="restart policy"):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="workers must be >= 0"):
        _sup(1).scale(0.0, -1)
