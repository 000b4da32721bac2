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
    assert engine.info.io.inputs[0].shape == (-1, -1, 3)
    x = np.ones((2, 5, 3), np.int32)
    assert engine.run({"x": x})["y"].dtype == np.int32


def test_output_items_gives_a_classifier_shaped_output() -> None:
    engine = SyntheticEngine(item_shape=(2, 8), output_items=3)
    assert engine.info.io.outputs[0].shape == (-1, 3)
    x = np.arange(32, dtype=np.float32).reshape(2, 2, 8)
    y = engine.run({"x": x})["y"]
    np.testing.assert_array_equal(y, (2 * x + 1).reshape(2, 16)[:, :3])
    np.testing.assert_array_equal(y, synthetic_output(x, 3))
    assert y.flags.c_contiguous


@pytest.mark.parametrize(("item", "k"), [((4,), 5), ((-1,), 2), ((4,), -1)])
def test_output_items_must_fit_a_fixed_sample(item: tuple[int, ...], k: int) -> None:
    with pytest.raises(ValueError, match="output_items"):
        SyntheticEngine(item_shape=item, output_items=k)
