"""policy.py: DeadlinePolicy (carpool's rule) against FixedPolicy (the minibus rule).

Every case uses concrete numbers. Cost lines (docs/batching.md):

* GPU-like: 5 ms + 0.5 ms·n — batching pays (fixed share of a one-sample batch ≈ 0.91);
* CPU-like: 0 + 4 ms·n — batching buys nothing;
* unknown: not calibrated yet.

DeadlinePolicy defaults: margin 2 ms; predictions are stretched by the cost's measured
spread (the GPU and CPU lines here have a spread of 10%), so a batch of n sent to an idle
worker is held against a deadline as ``1.1·(5 + 0.5·n) ms + 2 ms``.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.broker.adaptive import CostEstimate
from carpool.broker.policy import (
    Capacity,
    DeadlinePolicy,
    Decision,
    Dispatch,
    FixedPolicy,
    QueueView,
    WaitUntil,
)

GPU = CostEstimate(0.005, 0.0005, calibrated=True, spread=0.1)
CPU = CostEstimate(0.0, 0.004, calibrated=True, spread=0.1)
UNKNOWN = CostEstimate()
INF = math.inf
NOW = 10.0


def carpool(max_batch: int = 32, max_wait_s: float = 0.005) -> DeadlinePolicy:
    return DeadlinePolicy(max_batch, max_wait_s)


def assert_decision(got: Decision, expected: Decision) -> None:
    assert type(got) is type(expected), f"{got} != {expected}"
    if isinstance(expected, WaitUntil):
        assert isinstance(got, WaitUntil)
        assert got.t == pytest.approx(expected.t, abs=1e-9)
    else:
        assert got == expected


# --------------------------------------------------------------------------- FixedPolicy


@pytest.mark.parametrize(
    ("now", "queue", "capacity", "expected"),
    [
        # Full: the policy's B_max or the worker's room, whichever is smaller.
        (NOW, QueueView(8, NOW), Capacity(16), Dispatch(8)),
        (NOW, QueueView(30, NOW), Capacity(16), Dispatch(8)),
        (NOW, QueueView(5, NOW), Capacity(5), Dispatch(5)),
        # Not full: wait for exactly oldest + T_max, whatever the deadline or the cost.
        (NOW, QueueView(3, NOW), Capacity(16), WaitUntil(NOW + 0.005)),
        (NOW, QueueView(3, NOW - 0.002, NOW + 0.001), Capacity(16, 0.0, GPU), WaitUntil(10.003)),
        (NOW, QueueView(1, NOW, NOW + 0.05, 5000.0), Capacity(16, 0.5, CPU), WaitUntil(10.005)),
        # T_max reached exactly, or passed: leave, with room for a full batch.
        (NOW + 0.005, QueueView(3, NOW), Capacity(16), Dispatch(8)),
        (NOW + 1.0, QueueView(1, NOW), Capacity(16), Dispatch(8)),
        (NOW + 0.005, QueueView(3, NOW), Capacity(2), Dispatch(2)),
    ],
)
def test_fixed_policy_leaves_when_full_or_at_t_max(
    now: float, queue: QueueView, capacity: Capacity, expected: Decision
) -> None:
    assert_decision(FixedPolicy(8, 0.005).decide(now, queue, capacity), expected)


@pytest.mark.parametrize("oldest", [0.0, 10.0, 123.456, 1e6 + 0.1])
def test_fixed_policy_waits_until_exactly_oldest_plus_t_max(oldest: float) -> None:
    policy = FixedPolicy(8, 0.0125)
    decision = policy.decide(oldest, QueueView(1, oldest), Capacity(8))
    assert decision == WaitUntil(oldest + 0.0125)


@pytest.mark.parametrize("cost", [GPU, CPU, UNKNOWN])
def test_fixed_policy_never_sheds_early_and_serves_fifo(cost: CostEstimate) -> None:
    policy = FixedPolicy(8, 0.005)
    # Even a request 1 ms from its deadline behind a 50 ms backlog is not called hopeless.
    assert policy.shed_before(NOW, Capacity(8, 0.05, cost)) == NOW
    assert policy.edf is False


# --------------------------------------------------------------------------- DeadlinePolicy: when


@pytest.mark.parametrize(
    ("queue", "capacity", "expected"),
    [
        # CPU: no fixed cost to amortise, so waiting only adds latency: leave at once.
        pytest.param(QueueView(1, NOW), Capacity(16, 0.0, CPU), Dispatch(16), id="cpu-one"),
        pytest.param(QueueView(3, NOW), Capacity(16, 0.0, CPU), Dispatch(16), id="cpu-few"),
        # ... even with a deadline (the guard shrinks to 10: 1.1·4 ms·10 <= 48 ms of slack)
        pytest.param(
            QueueView(3, NOW, NOW + 0.05), Capacity(16, 0.0, CPU), Dispatch(10), id="cpu-deadline"
        ),
        # ... and even while the worker is busy.
        pytest.param(QueueView(3, NOW), Capacity(16, 0.1, CPU), Dispatch(16), id="cpu-busy"),
        # Unknown cost (not calibrated): no reason to wait yet.
        pytest.param(QueueView(1, NOW), Capacity(16, 0.0, UNKNOWN), Dispatch(16), id="unknown"),
        pytest.param(
            QueueView(3, NOW, NOW + 0.05),
            Capacity(16, 0.1, UNKNOWN),
            Dispatch(16),
            id="unknown-busy",
        ),
        # One size seen only: the fit is all per-sample and uncalibrated.
        pytest.param(
            QueueView(2, NOW),
            Capacity(16, 0.0, CostEstimate(0.0, 0.0055, calibrated=False)),
            Dispatch(16),
            id="one-size-seen",
        ),
        # Fixed share exactly 0.2 (1 ms of 5 ms) pays; just under does not.
        pytest.param(
            QueueView(1, NOW),
            Capacity(16, 0.0, CostEstimate(0.001, 0.004, calibrated=True)),
            WaitUntil(NOW + 0.005),
            id="share-0.2-waits",
        ),
        pytest.param(
            QueueView(1, NOW),
            Capacity(16, 0.0, CostEstimate(0.0009, 0.004, calibrated=True)),
            Dispatch(16),
            id="share-0.18-leaves",
        ),
    ],
)
def test_dispatches_at_once_when_batching_buys_nothing(
    queue: QueueView, capacity: Capacity, expected: Decision
) -> None:
    assert_decision(carpool().decide(NOW, queue, capacity), expected)


@pytest.mark.parametrize(
    ("now", "queue", "expected"),
    [
        # No deadline pressure: T_max after the oldest arrival.
        pytest.param(NOW, QueueView(3, NOW, NOW + 0.05), WaitUntil(10.005), id="t-max"),
        pytest.param(NOW, QueueView(3, NOW, INF), WaitUntil(10.005), id="no-deadline"),
        pytest.param(
            NOW + 0.003, QueueView(3, NOW, NOW + 0.05), WaitUntil(10.005), id="t-max-later"
        ),
        # Latest start of the most urgent request comes first, sized by who is aboard (3):
        # 10.012 − 1.1·(0 + 5 + 0.5·3) ms − 2 ms = 10.00285
        pytest.param(NOW, QueueView(3, NOW, NOW + 0.012), WaitUntil(10.00285), id="latest-start"),
        # 10.011 − 1.1·6.5 ms − 2 ms = 10.00185
        pytest.param(NOW, QueueView(3, NOW, NOW + 0.011), WaitUntil(10.00185), id="tighter"),
        # T_max or latest start reached: leave.
        pytest.param(NOW + 0.005, QueueView(3, NOW, NOW + 0.05), Dispatch(16), id="t-max-due"),
        # Re-deciding later does not move the moment: the latest start of three aboard is
        # 10.020 − 7.15 ms − 2 ms = 10.01085, after T_max at 10.005.
        pytest.param(
            NOW + 0.0038, QueueView(3, NOW, NOW + 0.02), WaitUntil(10.005), id="t-max-first"
        ),
        # Seven aboard, room for eight: wait to 10.012 − 1.1·8.5 ms − 2 ms = 10.00065; once
        # only seven fit, leave.
        pytest.param(NOW, QueueView(7, NOW, NOW + 0.012), WaitUntil(10.00065), id="seven-of-8"),
        pytest.param(NOW + 0.0002, QueueView(7, NOW, NOW + 0.012), Dispatch(7), id="start-due"),
        # Slack for only what is queued (1.1·(5 + 1.5) ms <= 7.5 ms): leave at once.
        pytest.param(NOW, QueueView(3, NOW, NOW + 0.0095), Dispatch(3), id="no-room-to-wait"),
        # The deadline has passed: a batch of one, never zero.
        pytest.param(NOW, QueueView(3, NOW, NOW), Dispatch(1), id="deadline-passed"),
        # Full (the adaptive B_max of 16) and the worker idle: leave.
        pytest.param(NOW, QueueView(16, NOW, NOW + 0.05), Dispatch(16), id="full"),
    ],
)
def test_gpu_waits_until_t_max_or_the_latest_start(
    now: float, queue: QueueView, expected: Decision
) -> None:
    assert_decision(carpool().decide(now, queue, Capacity(16, 0.0, GPU)), expected)


def test_latest_start_formula() -> None:
    """deadline − (1 + spread)·(ready_in + est(n)) − margin, with n the samples aboard; the
    stretch is at least min_jitter_share when the measured spread is smaller."""
    policy = DeadlinePolicy(64, 1.0, margin_s=0.003, min_jitter_share=0.25)
    cost = CostEstimate(0.004, 0.001, calibrated=True)
    capacity = Capacity(10, 0.001, cost)  # ready in 1 ms: under the 3 ms margin, not busy
    deadline = NOW + 0.1
    queue = QueueView(2, NOW, deadline)
    assert policy.batch_limit(NOW, queue, capacity) == 10
    expected = deadline - 1.25 * (0.001 + 0.004 + 0.001 * 2) - 0.003
    assert expected == pytest.approx(10.08825)
    decision = policy.decide(NOW, queue, capacity)
    assert isinstance(decision, WaitUntil)
    assert decision.t == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("now", "ready_in_s", "deadline", "expected"),
    [
        # Full but the worker needs 10 ms more: fill until 2 ms (margin) before it is free.
        pytest.param(NOW, 0.010, NOW + 0.1, WaitUntil(10.008), id="until-nearly-free"),
        # Under the margin from free: leave now.
        pytest.param(10.008, 0.002, NOW + 0.1, Dispatch(16), id="nearly-free"),
        pytest.param(NOW, 0.0025, NOW + 0.1, WaitUntil(10.0005), id="just-over-margin"),
        # The urgent request's latest start comes before the worker is free:
        # 10.035 − 1.1·(10 + 5 + 8) ms − 2 ms = 10.0077
        pytest.param(NOW, 0.010, NOW + 0.035, WaitUntil(10.0077), id="latest-start-first"),
        # Too late to wait for the worker at all: what fits (one) leaves now.
        pytest.param(NOW, 0.030, NOW + 0.035, Dispatch(1), id="too-late-to-wait"),
    ],
)
def test_full_batch_keeps_filling_while_the_worker_is_busy(
    now: float, ready_in_s: float, deadline: float, expected: Decision
) -> None:
    queue = QueueView(16, NOW, deadline)
    assert_decision(carpool().decide(now, queue, Capacity(16, ready_in_s, GPU)), expected)


def test_busy_worker_stretches_the_wait_of_a_partial_batch_past_t_max() -> None:
    # T_max would end at 10.005, but the worker is busy until 10.010: wait to 10.008.
    decision = carpool().decide(NOW, QueueView(3, NOW, NOW + 0.1), Capacity(16, 0.010, GPU))
    assert_decision(decision, WaitUntil(10.008))
    # Idle worker, same queue: T_max.
    decision = carpool().decide(NOW, QueueView(3, NOW, NOW + 0.1), Capacity(16, 0.0, GPU))
    assert_decision(decision, WaitUntil(10.005))


# --------------------------------------------------------------------------- DeadlinePolicy: size


@pytest.mark.parametrize(
    ("deadline", "ready_in_s", "expected"),
    [
        (INF, 0.0, 16),
        # 1.1·(5 + 8) ms = 14.3 ms fits in 48 ms of slack.
        (NOW + 0.05, 0.0, 16),
        # slack 10 ms: 1.1·(5 + 0.5·8) = 9.9 ms fits, n = 9 (10.45 ms) does not.
        (NOW + 0.012, 0.0, 8),
        # slack 18 ms with a 10 ms backlog: 1.1·(10 + 5 + 0.5·n) <= 18 → n <= 2.7.
        (NOW + 0.020, 0.010, 2),
        # Hopeless: still one request, never zero.
        (NOW + 0.001, 0.0, 1),
        (NOW - 1.0, 0.5, 1),
    ],
)
def test_deadline_guard_shrinks_the_batch(
    deadline: float, ready_in_s: float, expected: int
) -> None:
    policy = carpool()
    queue = QueueView(12, NOW, deadline)
    capacity = Capacity(16, ready_in_s, GPU)
    limit = policy.batch_limit(NOW, queue, capacity)
    assert limit == expected
    # What the guard keeps fits in the slack (unless it is down to one request) ...
    slack = deadline - NOW - policy.margin_s
    assert limit == 1 or policy.finish_in_s(capacity, limit) <= slack
    # ... and one more would not.
    if limit < 16:
        assert policy.finish_in_s(capacity, limit + 1) > slack


def test_deadline_guard_decides_the_dispatched_size() -> None:
    # 12 queued, 16 allowed, but the most urgent request only has room for 8.
    decision = carpool().decide(NOW, QueueView(12, NOW, NOW + 0.012), Capacity(16, 0.0, GPU))
    assert decision == Dispatch(8)


@pytest.mark.parametrize(
    ("policy_max", "samples", "capacity", "expected"),
    [
        # Adaptive B_max 8, engine 64: a backlog of 20 leaves as one batch of 20 ...
        (32, 20, Capacity(8, 0.0, GPU, 64), 20),
        # ... up to the policy's cap (32) ...
        (32, 50, Capacity(8, 0.0, GPU, 64), 32),
        # ... or the engine's limit.
        (128, 100, Capacity(8, 0.0, GPU, 64), 64),
        (128, 100, Capacity(8, 0.0, UNKNOWN, 64), 64),
        # No engine limit given: the hard limit is B_max itself (no backlog growth).
        (32, 20, Capacity(8, 0.0, GPU), 8),
        # Not a backlog (12 <= 16): the target, shrunk by the deadline guard.
        (32, 12, Capacity(16, 0.0, GPU, 64), 8),
    ],
)
def test_backlog_takes_up_to_the_engine_limit(
    policy_max: int, samples: int, capacity: Capacity, expected: int
) -> None:
    policy = DeadlinePolicy(policy_max, 0.005)
    # A tight deadline does not shrink a backlog batch: its late members are shed instead.
    queue = QueueView(samples, NOW, NOW + 0.012)
    assert policy.batch_limit(NOW, queue, capacity) == expected
    assert policy.decide(NOW, queue, capacity) == Dispatch(expected)


@pytest.mark.parametrize(
    ("max_batch", "engine_max", "hard"),
    [(8, 0, 8), (8, 64, 64), (8, 4, 8), (1, 1, 1)],
)
def test_hard_max(max_batch: int, engine_max: int, hard: int) -> None:
    assert Capacity(max_batch, engine_max=engine_max).hard_max == hard


# --------------------------------------------------------------------------- floor


@pytest.mark.parametrize(
    ("arrival_sps", "cost", "policy_max", "capacity", "expected"),
    [
        (0.0, GPU, 32, Capacity(8, 0.0, GPU, 64), 1),
        # λα/(1 − λβ) with α = 5 ms, β = 0.5 ms:
        (100.0, GPU, 32, Capacity(8, 0.0, GPU, 64), 1),  # 0.5/0.95 = 0.53
        (600.0, GPU, 32, Capacity(8, 0.0, GPU, 64), 5),  # 3/0.7 = 4.29
        (900.0, GPU, 32, Capacity(8, 0.0, GPU, 64), 9),  # 4.5/0.55 = 8.18
        (1700.0, GPU, 128, Capacity(8, 0.0, GPU, 64), 57),  # 8.5/0.15 = 56.7
        # capped at min(policy B_max, engine limit)
        (1700.0, GPU, 32, Capacity(8, 0.0, GPU, 64), 32),
        (1700.0, GPU, 128, Capacity(8, 0.0, GPU, 40), 40),
        # no room: the engine cannot keep up at any size → the cap
        (2000.0, GPU, 32, Capacity(8, 0.0, GPU, 64), 32),
        (2500.0, GPU, 128, Capacity(8, 0.0, GPU, 64), 64),
        # no fixed cost, or no fitted cost: no floor
        (5000.0, CPU, 32, Capacity(8, 0.0, CPU, 64), 1),
        (5000.0, UNKNOWN, 32, Capacity(8, 0.0, UNKNOWN, 64), 1),
    ],
)
def test_floor_keeps_up_with_the_arrival_rate(
    arrival_sps: float,
    cost: CostEstimate,
    policy_max: int,
    capacity: Capacity,
    expected: int,
) -> None:
    policy = DeadlinePolicy(policy_max, 0.005)
    floor = policy.floor(QueueView(1, NOW, INF, arrival_sps), capacity)
    assert floor == expected
    cap = min(policy_max, capacity.hard_max)
    room = 1.0 - arrival_sps * cost.per_sample_s
    if cost.calibrated and cost.fixed_cost_s > 0 and arrival_sps > 0 and room > 0:
        formula = math.ceil(arrival_sps * cost.fixed_cost_s / room)
        assert floor == min(cap, max(1, formula))
        if floor < cap:
            # The floor's throughput keeps up; one less would not.
            assert floor / cost.estimate(floor) >= arrival_sps
            if floor > 1:
                assert (floor - 1) / cost.estimate(floor - 1) < arrival_sps


def test_floor_raises_the_target_above_a_lagging_adaptive_size() -> None:
    policy = carpool()
    # Adaptive B_max 4, but 900/s needs batches of 9.
    queue = QueueView(3, NOW, NOW + 0.1, 900.0)
    capacity = Capacity(4, 0.0, GPU, 64)
    assert policy.batch_limit(NOW, queue, capacity) == 9
    # Three aboard of nine: wait as long as nine take to arrive at 900/s, counted from the
    # oldest arrival (10 ms), past T_max (5 ms).
    assert_decision(policy.decide(NOW, queue, capacity), WaitUntil(NOW + 9 / 900))
    # Re-deciding later does not push that moment on.
    later = QueueView(5, NOW, NOW + 0.1, 900.0)
    assert_decision(policy.decide(NOW + 0.004, later, capacity), WaitUntil(NOW + 9 / 900))
    # Without the arrival rate: B_max 4, T_max.
    assert_decision(
        policy.decide(NOW, QueueView(3, NOW, NOW + 0.1), capacity), WaitUntil(NOW + 0.005)
    )


@pytest.mark.parametrize(
    ("samples", "deadline", "arrival_sps", "expected"),
    [
        # 1400/s needs batches of 24 (7/0.3 = 23.3). The most urgent request's slack
        # (14.8 ms, the worker busy for 9 more) fits no batch at all: the floor leaves.
        (40, NOW + 0.0168, 1400.0, 24),
        # Fewer queued than the floor: what is queued.
        (10, NOW + 0.0168, 1400.0, 10),
        # Slack for more than the floor: 1.1·(9 + 5 + 0.5·n) <= 48 ms → n <= 59.
        (40, NOW + 0.050, 1400.0, 59),
        # No arrival rate measured: no floor, the guard shrinks to one.
        (40, NOW + 0.0168, 0.0, 1),
        # Overload: no size keeps up with 2500/s (the floor is the engine's 64), so the
        # guard serves the most urgent request that can still make it.
        (40, NOW + 0.0168, 2500.0, 1),
    ],
)
def test_deadline_guard_stops_at_the_floor(
    samples: int, deadline: float, arrival_sps: float, expected: int
) -> None:
    """A shrink below the floor would leave the queue growing, and the next urgent request
    with less slack still: batches of one, and nearly everything shed."""
    policy = DeadlinePolicy(64, 0.005)
    queue = QueueView(samples, NOW - 0.03, deadline, arrival_sps)
    capacity = Capacity(63, 0.009, GPU, 64)
    assert policy.floor(queue, capacity) == {0.0: 1, 1400.0: 24, 2500.0: 64}[arrival_sps]
    assert policy.batch_limit(NOW, queue, capacity) == expected


# --------------------------------------------------------------------------- shedding


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [
        (Capacity(16, 0.0, GPU), NOW + 0.0055),
        (Capacity(16, 0.010, GPU), NOW + 0.0155),
        (Capacity(16, 0.010, CPU), NOW + 0.014),
        (Capacity(16, 0.010, UNKNOWN), NOW),
        (Capacity(16, 0.0, CostEstimate(0.0, 0.0055, calibrated=False)), NOW),
    ],
)
def test_shed_before(capacity: Capacity, expected: float) -> None:
    policy = carpool()
    assert policy.edf is True
    got = policy.shed_before(NOW, capacity)
    assert got == pytest.approx(expected, abs=1e-12)


# --------------------------------------------------------------------------- properties

costs = st.builds(
    CostEstimate,
    st.floats(0.0, 0.1),
    st.floats(0.0, 0.01),
    st.booleans(),
)
capacities = st.builds(
    Capacity,
    st.integers(1, 256),
    st.floats(0.0, 1.0),
    costs,
    st.integers(0, 512),
)


@st.composite
def situations(draw: st.DrawFn) -> tuple[float, QueueView]:
    now = draw(st.floats(0.0, 1e4))
    age = draw(st.floats(0.0, 10.0))
    deadline = draw(st.one_of(st.just(INF), st.floats(-1.0, 10.0).map(lambda d: now + d)))
    view = QueueView(
        draw(st.integers(1, 300)),
        now - age,
        deadline,
        draw(st.one_of(st.just(0.0), st.floats(0.0, 1e5))),
    )
    return now, view


@settings(max_examples=400, deadline=None)
@given(
    situations(),
    capacities,
    st.integers(1, 256),
    st.floats(0.0, 1.0),
    st.floats(0.0, 0.01),
    st.floats(0.0, 1.0),
)
def test_deadline_policy_never_waits_into_the_past(
    situation: tuple[float, QueueView],
    capacity: Capacity,
    max_batch: int,
    max_wait_s: float,
    margin_s: float,
    min_jitter_share: float,
) -> None:
    now, queue = situation
    policy = DeadlinePolicy(max_batch, max_wait_s, margin_s, min_jitter_share)
    decision = policy.decide(now, queue, capacity)
    if isinstance(decision, WaitUntil):
        assert math.isfinite(decision.t)
        assert decision.t > now
        # The wait is bounded by T_max, the worker's backlog and the moment the floor should
        # have filled, counted from the oldest arrival.
        filled_at = -math.inf
        if queue.arrival_sps > 0:
            filled_at = queue.oldest_arrival_s + policy.floor(queue, capacity) / queue.arrival_sps
        bound = max(queue.oldest_arrival_s + max_wait_s, now + capacity.ready_in_s, filled_at)
        assert decision.t <= bound + 1e-9
    else:
        assert 1 <= decision.max_samples <= min(max_batch, capacity.hard_max)
    shed = policy.shed_before(now, capacity)
    assert shed >= now


@settings(max_examples=300, deadline=None)
@given(situations(), capacities, st.integers(1, 256), st.floats(0.0, 1.0))
def test_fixed_policy_never_waits_into_the_past(
    situation: tuple[float, QueueView], capacity: Capacity, max_batch: int, max_wait_s: float
) -> None:
    now, queue = situation
    policy = FixedPolicy(max_batch, max_wait_s)
    decision = policy.decide(now, queue, capacity)
    if isinstance(decision, WaitUntil):
        assert decision.t > now
        assert decision.t == queue.oldest_arrival_s + max_wait_s
    else:
        assert 1 <= decision.max_samples <= min(max_batch, capacity.max_batch)
    assert policy.shed_before(now, capacity) == now
