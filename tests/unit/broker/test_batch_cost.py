"""What a batch costs the policy: the engine's fitted time, and the share of the worker's
own CPU per batch (RESULT ``cpu_ms``) that its busy host takes from the engine; and why
each batch leaves (docs/batching.md §3-§5)."""

from __future__ import annotations

import logging

import pytest

from carpool.broker.adaptive import CostEstimate
from carpool.broker.policy import (
    COST,
    DEADLINE,
    FULL,
    WAITED,
    Capacity,
    DeadlinePolicy,
    Dispatch,
    FixedPolicy,
    QueueView,
    WaitUntil,
)
from carpool.common.protocol import Telemetry

from .harness import T0, W1, Broker, batches, model_spec

CPU = CostEstimate(0.0, 0.001, calibrated=True)  # batching alone buys nothing
GPU = CostEstimate(0.005, 0.0005, calibrated=True)
OVERHEAD = CostEstimate(0.002, 0.0, calibrated=True)  # the worker's 2 ms per batch
NOW = 10.0


def test_the_worker_cpu_counts_as_far_as_its_host_is_busy() -> None:
    policy = DeadlinePolicy(16, 0.005)
    idle_host = Capacity(16, 0.0, CPU, 16, OVERHEAD, 0.0)
    busy_host = Capacity(16, 0.0, CPU, 16, OVERHEAD, 0.9)
    assert idle_host.batch_cost() == pytest.approx((0.0, 0.001))
    assert busy_host.batch_cost() == pytest.approx((0.0018, 0.001))
    queue = QueueView(1, NOW, NOW + 1.0, arrival_sps=500.0)
    # Cores to spare: the worker's CPU costs the engine nothing, and waiting buys nothing.
    at_once = policy.decide(NOW, queue, idle_host)
    assert at_once == Dispatch(16)
    assert isinstance(at_once, Dispatch)
    assert at_once.reason == COST
    # A busy host: each batch takes 1.8 ms from the engine, which a fuller batch shares.
    assert isinstance(policy.decide(NOW, queue, busy_host), WaitUntil)
    # ... and the floor that keeps up with 500/s grows with it: 500 * 1.8 / (1 - 0.5) = 1.8.
    assert policy.floor(queue, busy_host) == 2
    assert policy.floor(queue, idle_host) == 1


@pytest.mark.parametrize(
    ("queue", "capacity", "reason"),
    [
        (QueueView(16, NOW), Capacity(16, 0.0, GPU), FULL),
        (QueueView(3, NOW - 0.005), Capacity(16, 0.0, GPU), WAITED),
        # Due in 8 ms: a batch of 3 takes 1.02 * 6.5 ms + 2 ms of margin; leave now.
        (QueueView(3, NOW, NOW + 0.008), Capacity(16, 0.0, GPU), DEADLINE),
        (QueueView(3, NOW), Capacity(16, 0.0, CPU), COST),
        # Full; the worker frees within the margin: it leaves full.
        (QueueView(16, NOW - 0.008), Capacity(16, 0.001, GPU), FULL),
    ],
)
def test_each_batch_says_why_it_leaves(queue: QueueView, capacity: Capacity, reason: str) -> None:
    decision = DeadlinePolicy(16, 0.005).decide(NOW, queue, capacity)
    assert isinstance(decision, Dispatch)
    assert decision.reason == reason


def test_a_full_batch_waits_for_its_busy_worker_and_leaves_as_it_frees() -> None:
    policy = DeadlinePolicy(16, 0.005)
    queue = QueueView(16, NOW - 0.008)
    assert policy.decide(NOW, queue, Capacity(16, 0.010, GPU)) == WaitUntil(NOW + 0.008)
    decision = policy.decide(NOW + 0.008, queue, Capacity(16, 0.002, GPU))
    assert isinstance(decision, Dispatch)
    assert decision.reason == FULL


def test_fixed_leaves_full_or_waited() -> None:
    policy = FixedPolicy(8, 0.005)
    full = policy.decide(NOW, QueueView(8, NOW), Capacity(8))
    waited = policy.decide(NOW, QueueView(2, NOW - 0.005), Capacity(8))
    assert isinstance(full, Dispatch)
    assert isinstance(waited, Dispatch)
    assert (full.reason, waited.reason) == (FULL, WAITED)


def _teach(b: Broker, cpu_ms: float, telemetry: Telemetry | None) -> float:
    """Two RESULTs of a CPU-like engine (1 ms a sample, nothing fixed), of one and two
    samples, with ``cpu_ms`` of the worker's own per batch; returns the time after."""
    b.ready(T0, W1, model_spec(max_batch=8), slots=1)
    now = T0
    (first,) = batches(b.request(now, 1))  # unknown cost: it leaves at once
    b.request(now, 2)
    b.request(now, 3)  # (both queue behind the one the worker holds)
    now += 0.001
    msgs, _ = b.result(now, first, compute_ms=1.0, cpu_ms=cpu_ms, telemetry=telemetry)
    (second,) = batches(msgs)
    assert second.batch.total_samples == 2
    now += 0.002
    msgs, _ = b.result(now, second, compute_ms=2.0, cpu_ms=cpu_ms, telemetry=telemetry)
    assert batches(msgs) == []
    return now


def test_a_busy_hosts_worker_makes_a_cpu_engine_wait_for_a_batch() -> None:
    b = Broker.make(max_batch=8, max_wait_s=0.005, policy="carpool")
    now = _teach(b, 3.0, Telemetry(host_cpu_pct=90.0))
    assert batches(b.request(now, 4)) == []  # waits: a batch costs 2.7 ms of the engine
    assert [m.batch.total_samples for m in batches(b.tick(now + 0.005))] == [1]


@pytest.mark.parametrize("telemetry", [None, Telemetry(host_cpu_pct=0.0)])
def test_with_cores_to_spare_a_cpu_engine_does_not_wait(telemetry: Telemetry | None) -> None:
    b = Broker.make(max_batch=8, max_wait_s=0.005, policy="carpool")
    now = _teach(b, 3.0, telemetry)
    assert len(batches(b.request(now, 4))) == 1


def test_the_default_keeps_the_configured_b_max_whatever_the_load() -> None:
    """carpool's policy has no ρ controller: a light load does not shrink B_max (each
    smaller batch would cost the host's CPU per request more than the minibus's)."""
    b = Broker.make(max_batch=8, max_wait_s=0.005, policy="carpool")
    b.ready(T0, W1, model_spec(max_batch=8), slots=1)
    for i in range(20):
        b.heartbeat(T0 + i, W1, rho=0.02)
    stats = b.core.snapshot()
    (worker,) = stats["workers"]
    assert worker["lanes"]["m"]["b_max"] == 8
    seed = Broker.make(max_batch=8, max_wait_s=0.005, policy="seed")
    seed.ready(T0, W1, model_spec(max_batch=8), slots=1)
    for i in range(20):
        seed.heartbeat(T0 + i, W1, rho=0.95)
    (worker,) = seed.core.snapshot()["workers"]
    assert worker["lanes"]["m"]["b_max"] < 8  # the seeds' rule: busy -> smaller


def test_each_dispatch_is_logged_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    b = Broker.make(max_batch=2, max_wait_s=0.005, policy="fixed")
    b.ready(T0, W1, model_spec(max_batch=8), slots=1)
    with caplog.at_level(logging.DEBUG, logger="carpool.broker.dispatcher"):
        b.request(T0, 1)
        (batch,) = batches(b.request(T0, 2))  # full: B_max 2
    assert batch.batch.total_samples == 2
    assert any("n=2" in r.getMessage() and "reason=full" in r.getMessage() for r in caplog.records)
