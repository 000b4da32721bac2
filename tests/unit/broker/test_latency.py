"""LatencyModel: the online fit of batch duration = fixed_cost_s + per_sample_s * n."""

from __future__ import annotations

import random

import pytest

from carpool.broker.adaptive import CostEstimate, LatencyModel


def test_uncalibrated_until_two_sizes_seen() -> None:
    model = LatencyModel()
    assert model.cost == CostEstimate()
    model.observe(4, 0.007)
    model.observe(4, 0.007)
    cost = model.cost
    assert not cost.calibrated
    assert cost.estimate(4) == pytest.approx(0.007)  # the total stays right
    model.observe(8, 0.009)
    assert model.cost.calibrated


@pytest.mark.parametrize(
    ("fixed_s", "per_sample_s"),
    [(0.005, 0.0005), (0.0, 0.004), (0.02, 0.0), (0.001, 0.001)],
)
def test_recovers_a_linear_cost_from_noisy_observations(
    fixed_s: float, per_sample_s: float
) -> None:
    rng = random.Random(1)
    model = LatencyModel()
    for _ in range(400):
        n = rng.choice([1, 2, 4, 8, 16, 32])
        model.observe(n, (fixed_s + per_sample_s * n) * rng.gauss(1.0, 0.03))
    cost = model.cost
    assert cost.calibrated
    assert cost.fixed_cost_s == pytest.approx(fixed_s, abs=0.0008)
    assert cost.per_sample_s == pytest.approx(per_sample_s, abs=0.00006)


def test_negative_fixed_cost_is_clipped_to_zero() -> None:
    # CPUs: per-item cost grows at large batches, so a straight fit gives alpha < 0.
    model = LatencyModel()
    for n, d in [(1, 0.0039), (2, 0.0075), (4, 0.0147), (8, 0.030), (16, 0.0629)]:
        model.observe(n, d)
    cost = model.cost
    assert cost.fixed_cost_s == 0.0
    assert cost.per_sample_s == pytest.approx(0.0039, rel=0.05)
    assert cost.fixed_share(1) == 0.0


def test_medians_ignore_a_straggler() -> None:
    model = LatencyModel()
    for _ in range(9):
        model.observe(1, 0.0055)
        model.observe(8, 0.009)
    model.observe(8, 0.5)  # one batch stalled behind a GC pause
    assert model.cost.estimate(8) == pytest.approx(0.009, rel=0.01)


def test_history_is_bounded_per_size_and_in_sizes() -> None:
    model = LatencyModel(per_size=4, max_sizes=3)
    for n in (1, 2, 3, 4):
        for _ in range(10):
            model.observe(n, 0.001 * n)
    assert len(model._by_size) == 3
    assert all(len(d) == 4 for d in model._by_size.values())
    assert 1 not in model._by_size  # least recently seen size went first


def test_bad_observations_are_ignored() -> None:
    model = LatencyModel()
    model.observe(0, 0.01)
    model.observe(3, float("nan"))
    model.observe(3, -1.0)
    assert model.observations == 0


def test_spread_measures_the_jitter_of_batch_times() -> None:
    rng = random.Random(3)
    steady, noisy = LatencyModel(), LatencyModel()
    for _ in range(200):
        n = rng.choice([1, 8])
        steady.observe(n, 0.005 + 0.0005 * n)
        noisy.observe(n, (0.005 + 0.0005 * n) * rng.gauss(1.0, 0.1))
    assert steady.cost.spread == 0.0
    assert noisy.cost.spread == pytest.approx(0.1, abs=0.03)
