"""The pure side of the TensorRT engine: buffer plans, types, busy time (its profiles:
tests/unit/worker/tensorrt/test_profiles.py)."""

from __future__ import annotations

import pytest

from carpool.common.errors import ConfigError
from carpool.worker.engines.trt_plan import (
    BufferPlan,
    BusyClock,
    TensorIO,
    largest,
    numpy_dtype,
    plan_buffers,
)
from carpool.worker.tensorrt.profiles import InputRange, Profile

LARGE = Profile(
    (InputRange("x", (1, 32), (32, 64), (64, 128)), InputRange("m", (1,), (32,), (64,)))
)


def test_buffer_plan_sizes_every_tensor_at_the_profiles_max():
    io = [
        TensorIO("x", True, "float16", (-1, -1)),
        TensorIO("m", True, "int64", (-1,)),
        TensorIO("y", False, "float32", (-1, 10)),
        TensorIO("boxes", False, "float32", (-1, -1, 4)),
    ]
    plan = plan_buffers(io, LARGE, {"y": (64, 10), "boxes": (64, -1, 4)}, {"boxes": 4096})
    assert plan.nbytes == {"x": 64 * 128 * 2, "m": 64 * 8, "y": 64 * 10 * 4, "boxes": 4096}
    assert plan.data_dependent == {"boxes"}


def test_one_buffer_set_serves_every_profile_at_the_most_each_tensor_needs():
    wide = BufferPlan({"x": 4096, "y": 40, "boxes": 100}, frozenset({"boxes"}))
    tall = BufferPlan({"x": 1024, "y": 400, "boxes": 800}, frozenset({"boxes"}))
    assert largest([wide, tall]) == BufferPlan(
        {"x": 4096, "y": 400, "boxes": 800}, frozenset({"boxes"})
    )


def test_numpy_dtype_names_what_carpool_cannot_carry():
    assert numpy_dtype("HALF", "x") == "float16"
    with pytest.raises(ConfigError, match="BF16"):
        numpy_dtype("BF16", "x")


@pytest.mark.parametrize(
    ("batches", "busy"),
    [
        ([(0.010, None), (0.010, 0.5)], 0.020),  # apart: both count
        ([(0.010, None), (0.010, -0.004)], 0.016),  # the second starts 4 ms before the first ends
        ([(0.010, None), (0.002, -0.008)], 0.010),  # wholly inside the first
        # inside the first, then one starting 1 ms after the first's end (which lies 6 ms
        # beyond the second's end event)
        ([(0.010, None), (0.002, -0.008), (0.003, 0.007)], 0.013),
        ([(0.010, None), (0.010, 0.0)], 0.020),  # back to back
    ],
)
def test_busy_clock_counts_overlapping_batches_once(batches, busy):
    clock = BusyClock()
    for compute_s, gap_s in batches:
        clock.add(compute_s, gap_s)
    assert clock.total_s == pytest.approx(busy)
