"""BatchSizeController: B_max from the worker's load, by the seed's rule and by carpool's."""

from __future__ import annotations

import pytest

from carpool.broker.adaptive import AdaptiveConfig, BatchSizeController, CostEstimate

GPU = CostEstimate(0.005, 0.0005, calibrated=True)


def rho_of(arrival_rps: float, batch: float, cost: CostEstimate = GPU) -> float:
    """Engine busy fraction at an arrival rate when batches have ``batch`` samples."""
    return min(1.0, arrival_rps * (cost.fixed_cost_s / batch + cost.per_sample_s))


def run(controller: BatchSizeController, arrival_rps: float, steps: int) -> list[int]:
    sizes = []
    for i in range(steps):
        b = controller.batch_size
        controller.update(i * 1.0, rho_of(arrival_rps, b), GPU, float(b))
        sizes.append(controller.batch_size)
    return sizes


@pytest.mark.parametrize("arrival_rps", [50, 150, 400, 1000, 1300])
def test_settles_at_constant_load_and_does_not_oscillate(arrival_rps: float) -> None:
    controller = BatchSizeController(64)
    sizes = run(controller, arrival_rps, 40)
    tail = sizes[-15:]
    assert len(set(tail)) == 1, f"still moving: {sizes}"
    # Settled at the smallest size whose load is at or under the target; where no size
    # reaches the target (arrivals x per-sample cost alone exceed it), at the cap.
    b = tail[0]
    target = controller.config.target_rho
    if arrival_rps * GPU.per_sample_s >= target:
        assert b == 64
        return
    assert rho_of(arrival_rps, b) <= target + 1e-9
    if b > 1:
        assert rho_of(arrival_rps, b - 1) > target


def test_busy_engine_gets_bigger_batches_idle_one_smaller() -> None:
    controller = BatchSizeController(64, initial=8)
    controller.update(0.0, 0.95, GPU, 8.0)
    assert controller.batch_size > 8
    controller = BatchSizeController(64, initial=8)
    controller.update(0.0, 0.05, GPU, 8.0)
    controller.update(1.0, 0.05, GPU, 8.0)
    assert controller.batch_size < 8


def test_the_seed_rule_goes_the_other_way() -> None:
    seed = BatchSizeController(64, initial=8, config=AdaptiveConfig(rule="seed"))
    seed.update(0.0, 0.95, GPU, 8.0)
    seed.update(1.0, 0.95, GPU, 8.0)
    assert seed.batch_size < 8  # busy -> smaller: the seed's letter


def test_seed_rule_under_saturation_collapses_capacity() -> None:
    """At 1300/s a 5 ms + 0.5 ms·B engine needs B >= 22; the seed rule shrinks B instead."""
    seed = BatchSizeController(64, initial=32, config=AdaptiveConfig(rule="seed"))
    carpool = BatchSizeController(64, initial=32)
    seed_sizes = run(seed, 1300, 30)
    carpool_sizes = run(carpool, 1300, 30)
    assert seed_sizes[-1] < 22 <= carpool_sizes[-1]


def test_steps_at_most_once_per_interval() -> None:
    controller = BatchSizeController(64, initial=8, config=AdaptiveConfig(interval_s=0.5))
    assert controller.update(10.0, 0.95, GPU)
    assert not controller.update(10.2, 0.95, GPU)
    assert controller.update(10.5, 0.95, GPU)
    assert controller.updates == 2


def test_snaps_up_to_preferred_sizes() -> None:
    controller = BatchSizeController(32, preferred=(1, 4, 8, 16, 32), initial=5)
    assert controller.batch_size == 8
    for _ in range(20):
        controller.update(controller.updates * 1.0, 0.99, GPU)
    assert controller.batch_size == 32
    assert controller.batch_size in controller.preferred


def test_without_a_fixed_cost_moves_by_a_fixed_factor() -> None:
    cpu = CostEstimate(0.0, 0.004, calibrated=True)
    controller = BatchSizeController(16, initial=8)
    controller.update(0.0, 0.1, cpu, 8.0)
    assert controller.batch_size == 8  # one reading is not enough to go down
    controller.update(1.0, 0.1, cpu, 8.0)
    # Two steps of the learning rate: 8 / 2**0.5 / 2**0.5 = 4.
    assert controller.batch_size == 4


def test_bounded_by_cap_and_one() -> None:
    controller = BatchSizeController(8, initial=8)
    for i in range(10):
        controller.update(float(i), 1.0, GPU, float(controller.batch_size))
    assert controller.batch_size == 8
    for i in range(10, 40):
        controller.update(float(i), 0.0, GPU, float(controller.batch_size))
    assert controller.batch_size == 1


def test_out_of_range_rho_is_ignored() -> None:
    controller = BatchSizeController(8, initial=4)
    assert not controller.update(0.0, 1.5, GPU)
    assert not controller.update(0.0, -0.1, GPU)
    assert controller.batch_size == 4
