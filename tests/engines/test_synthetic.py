"""SyntheticEngine: a known cost model and a known answer."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.common.testing import FakeClock
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output


@pytest.mark.parametrize(("batch", "cost_s"), [(1, 0.0055), (4, 0.007), (16, 0.013)])
def test_batch_costs_fixed_plus_per_sample(batch: int, cost_s: float) -> None:
    clock = FakeClock(0.0)
    engine = SyntheticEngine(fixed_cost_s=0.005, per_sample_s=0.0005, clock=clock, max_batch=16)
    x = np.arange(batch * 16, dtype=np.float32).reshape(batch, 16)
    out = engine.run({"x": x})
    assert clock.now() == pytest.approx(cost_s)
    np.testing.assert_array_equal(out["y"], synthetic_output(x))
    np.testing.assert_array_equal(out["y"], 2 * x + 1)
    assert list(engine.batches) == [(batch, (16,))]


def test_oversize_batch_is_refused() -> None:
    engine = SyntheticEngine(max_batch=2)
    with pytest.raises(ValueError, match="max_batch"):
        engine.run({"x": np.zeros((3, 16), np.float32)})


def test_dtype_and_item_shape_are_configurable() -> None:
    engine = SyntheticEngine(item_shape=(-1, 3), dtype="int32")
    assert engine.info.inputs[0].shape == (-1, -1, 3)
    x = np.ones((2, 5, 3), np.int32)
    assert engine.run({"x": x})["y"].dtype == np.int32
