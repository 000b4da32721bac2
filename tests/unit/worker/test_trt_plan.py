"""The pure side of the TensorRT engine: profiles, buffer plans, busy time."""

from __future__ import annotations

import pytest

from carpool.common.errors import ConfigError
from carpool.worker.engines.base import BadInput
from carpool.worker.engines.trt_plan import (
    BusyClock,
    Profile,
    TensorIO,
    numpy_dtype,
    plan_buffers,
    select_profile,
)

SMALL = Profile(0, {"x": ((1, 32), (4, 64), (8, 128)), "m": ((1,), (4,), (8,))})
LARGE = Profile(1, {"x": ((1, 32), (32, 64), (64, 128)), "m": ((1,), (32,), (64,))})
WIDE = Profile(2, {"x": ((1, 128), (4, 256), (8, 512)), "m": ((1,), (4,), (8,))})


@pytest.mark.parametrize(
    ("x", "m", "chosen"),
    [((2, 64), (2,), 0), ((8, 128), (8,), 0), ((9, 64), (9,), 1), ((4, 300), (4,), 2)],
)
def test_select_profile_takes_the_tightest_that_admits_every_input(x, m, chosen):
    assert select_profile([LARGE, SMALL, WIDE], {"x": x, "m": m}).index == chosen


def test_select_profile_takes_the_first_of_equals():
    twin = Profile(3, dict(SMALL.shapes))
    assert select_profile([twin, SMALL], {"x": (2, 64), "m": (2,)}).index == 0


@pytest.mark.parametrize(
    ("x", "m", "reason"),
    [
        ((65, 64), (65,), "the batch (dim 0) is 65, profile 1 takes 1..64"),
        ((2, 16), (2,), "dim 1 is 16, profile 0 takes 32..128"),
        ((2, 64, 1), (2,), "has 3 dims"),
    ],
)
def test_a_shape_outside_every_profile_is_refused_naming_the_dim(x, m, reason):
    with pytest.raises(BadInput, match="outside every optimization profile") as refused:
        select_profile([SMALL, LARGE], {"x": x, "m": m})
    assert reason in str(refused.value)


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
    assert plan.profile == 1


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
