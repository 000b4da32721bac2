"""policy.py: FixedPolicy, the minibus rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.broker.policy import Capacity, Dispatch, FixedPolicy, QueueView, WaitUntil


@pytest.mark.parametrize(
    ("max_batch", "max_wait_s", "now", "samples", "oldest", "room", "expected"),
    [
        # full by the policy's size
        (4, 0.01, 10.0, 4, 10.0, 8, Dispatch(4)),
        (4, 0.01, 10.0, 9, 10.0, 8, Dispatch(4)),
        # full by the worker's room, which is smaller than B_max
        (8, 0.01, 10.0, 3, 10.0, 3, Dispatch(3)),
        (8, 0.01, 10.0, 5, 10.0, 3, Dispatch(3)),
        # not full: wait for the oldest request's T_max
        (4, 0.01, 10.0, 3, 10.0, 8, WaitUntil(10.01)),
        (4, 0.01, 10.005, 1, 10.0, 8, WaitUntil(10.01)),
        (8, 0.5, 3.0, 7, 2.9, 8, WaitUntil(3.4)),
        # T_max reached exactly, or passed
        (4, 0.01, 10.01, 1, 10.0, 8, Dispatch(4)),
        (4, 0.01, 99.0, 1, 10.0, 8, Dispatch(4)),
        (8, 0.01, 10.01, 1, 10.0, 2, Dispatch(2)),
        # T_max of zero: never wait
        (4, 0.0, 10.0, 1, 10.0, 8, Dispatch(4)),
    ],
)
def test_fixed_policy(
    max_batch: int,
    max_wait_s: float,
    now: float,
    samples: int,
    oldest: float,
    room: int,
    expected: Dispatch | WaitUntil,
) -> None:
    policy = FixedPolicy(max_batch, max_wait_s)
    decision = policy.decide(now, QueueView(samples, oldest), Capacity(room))
    assert type(decision) is type(expected)
    if isinstance(expected, WaitUntil):
        assert isinstance(decision, WaitUntil)
        assert decision.t == pytest.approx(expected.t)
        assert decision.t == oldest + max_wait_s
    else:
        assert decision == expected


@settings(max_examples=200, database=None)
@given(
    max_batch=st.integers(1, 64),
    max_wait_s=st.floats(0.0, 5.0),
    oldest=st.floats(0.0, 1000.0),
    age=st.floats(0.0, 10.0),
    samples=st.integers(1, 200),
    room=st.integers(1, 64),
)
def test_fixed_policy_properties(
    max_batch: int, max_wait_s: float, oldest: float, age: float, samples: int, room: int
) -> None:
    now = oldest + age
    policy = FixedPolicy(max_batch, max_wait_s)
    decision = policy.decide(now, QueueView(samples, oldest), Capacity(room))
    if isinstance(decision, Dispatch):
        # Never more than the policy or the worker allows.
        assert decision.max_samples == min(max_batch, room)
        assert samples >= min(max_batch, room) or now >= oldest + max_wait_s
    else:
        # A wait is always in the future and never past the oldest request's T_max.
        assert decision.t > now
        assert decision.t == oldest + max_wait_s
        assert samples < min(max_batch, room)


def test_fixed_policy_ignores_deadlines_until_they_pass() -> None:
    """FIFO, no shedding: FixedPolicy only sees B_max and T_max, never the deadlines."""
    policy = FixedPolicy(4, 0.01)
    assert policy.edf is False
    urgent = QueueView(1, 10.0, earliest_deadline_s=10.001)
    assert policy.decide(10.0, urgent, Capacity(8)) == WaitUntil(10.0 + 0.01)
    assert policy.shed_before(10.0, Capacity(8)) == 10.0
    assert policy.shed_before(12.5, Capacity(1, ready_in_s=3.0)) == 12.5
