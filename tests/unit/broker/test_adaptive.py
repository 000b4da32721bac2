"""BatchSizeController: the seeds' B_max from the worker's load (the ``seed`` policy), and
why carpool's own policy does not use it."""

from __future__ import annotations

from carpool.broker.adaptive import AdaptiveConfig, BatchSizeController, CostEstimate

GPU = CostEstimate(0.005, 0.0005, calibrated=True)


def rho_of(arrival_rps: float, batch: float, cost: CostEstimate = GPU) -> float:
    """Engine busy fraction at an arrival rate when batches have ``batch`` samples."""
    return min(1.0, arrival_rps * (cost.fixed_cost_s / batch + cost.per_sample_s))


def run(controller: BatchSizeController, arrival_rps: float, steps: int) -> list[int]:
    sizes = []
    for i in range(steps):
        controller.update(i * 1.0, rho_of(arrival_rps, controller.batch_size))
        sizes.append(controller.batch_size)
    return sizes


def test_busy_gets_smaller_batches_idle_larger() -> None:
    """The seeds' letter: busy -> smaller, idle -> larger."""
    seed = BatchSizeController(64, initial=8)
    seed.update(0.0, 0.95)
    seed.update(1.0, 0.95)
    assert seed.batch_size < 8
    seed = BatchSizeController(64, initial=8)
    seed.update(0.0, 0.05)
    assert seed.batch_size > 8


def test_under_saturation_it_collapses_capacity() -> None:
    """At 1300/s a 5 ms + 0.5 ms·B engine needs B >= 22; the seeds' rule shrinks B, and
    with it the engine's throughput, below the arrivals."""
    sizes = run(BatchSizeController(64, initial=32), 1300, 30)
    assert sizes[-1] < 22


def test_steps_at_most_once_per_interval() -> None:
    controller = BatchSizeController(64, initial=8, config=AdaptiveConfig(interval_s=0.5))
    assert controller.update(10.0, 0.95)
    assert not controller.update(10.2, 0.95)
    assert controller.update(10.5, 0.95)
    assert controller.updates == 2


def test_snaps_up_to_preferred_sizes() -> None:
    controller = BatchSizeController(32, preferred=(1, 4, 8, 16, 32), initial=5)
    assert controller.batch_size == 8
    for _ in range(20):
        controller.update(controller.updates * 1.0, 0.01)
    assert controller.batch_size == 32
    assert controller.batch_size in controller.preferred


def test_moves_down_only_on_two_readings_in_a_row() -> None:
    controller = BatchSizeController(16, initial=8)
    controller.update(0.0, 0.9)  # a step of -0.5 * 0.8 = -0.4 in log B: 5.4, snapped to 6
    assert controller.batch_size == 8  # one reading is not enough to go down
    controller.update(1.0, 0.9)  # 3.6, snapped to 4
    assert controller.batch_size == 4


def test_bounded_by_cap_and_one() -> None:
    controller = BatchSizeController(8, initial=8)
    for i in range(10):
        controller.update(float(i), 0.0)
    assert controller.batch_size == 8
    for i in range(10, 40):
        controller.update(float(i), 1.0)
    assert controller.batch_size == 1


def test_out_of_range_rho_is_ignored() -> None:
    controller = BatchSizeController(8, initial=4)
    assert not controller.update(0.0, 1.5)
    assert not controller.update(0.0, -0.1)
    assert controller.batch_size == 4
