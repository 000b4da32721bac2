"""A model's shape rules end to end (protocol §8.1), on the real PP-OCRv4 detector over
real sockets: a frame whose H or W is not a multiple of 32 fails inside the model. The
catalogue's detector pads such a frame to the next multiples and crops its answer back;
the same ONNX file served with a shape rule instead has the broker answer INVALID_ARGUMENT,
saying what to pad to, rather than the batch failing INTERNAL."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from carpool.client import Client
from carpool.common.errors import InvalidArgument
from carpool.worker.config import ModelConfig
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.factory import engine_factory
from carpool.worker.models import locate
from carpool.worker.shapes import InputConfig
from tests.conftest import Fleet

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def _image(h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(h * w)
    return rng.random((1, 3, h, w), dtype=np.float32)


def test_the_rule_is_real_the_model_itself_fails_off_the_grid() -> None:
    engine = OnnxRuntimeEngine(locate("ppocr-det"))
    with pytest.raises(Exception, match=r"(?i)broadcast|shape|dimension"):
        engine.run({"x": _image(100, 96)})
    assert engine.run({"x": _image(96, 64)})[engine.info.io.outputs[0].name].shape == (1, 1, 96, 64)


def test_the_broker_refuses_off_grid_frames_and_serves_the_rest(
    fleet_factory: Callable[..., Fleet],
) -> None:
    fleet: Fleet = fleet_factory(max_batch=4, max_wait_s=0.01)
    rule = InputConfig(multiple_of=(1, 1, 32, 32))
    config = ModelConfig(name="ppocr-det", path=str(locate("ppocr-det")), inputs={"x": rule})
    fleet.add_worker({"ppocr-det": engine_factory(config)})
    client: Client = fleet.ready()
    with pytest.raises(InvalidArgument, match=r"dim 2 is 100, the model takes multiples of 32 "):
        client.infer("ppocr-det", {"x": _image(100, 96)}, timeout_s=30)
    with pytest.raises(InvalidArgument, match=r"dim 3 is 70, .*\(pad to 96\)"):
        client.infer("ppocr-det", {"x": _image(64, 70)}, timeout_s=30)
    reference = OnnxRuntimeEngine(locate("ppocr-det"))
    (name,) = (t.name for t in reference.info.io.outputs)
    image = _image(96, 64)
    got = client.infer("ppocr-det", {"x": image}, timeout_s=30)[name]
    np.testing.assert_allclose(got, reference.run({"x": image})[name], rtol=1e-5, atol=1e-6)
    # Only the good frame reached the worker, as a batch of one; nothing failed there.
    stats = client.stats()
    assert stats["errors"] == {"INVALID_ARGUMENT": 2}, stats["errors"]
    assert sum(stats["batch_sizes"]["ppocr-det"].values()) == 1


def test_the_catalogue_detector_pads_off_grid_frames_and_crops_the_answer(
    fleet_factory: Callable[..., Fleet],
) -> None:
    """A 100 x 70 frame runs padded to 128 x 96 (with zeros, bottom and right) and is
    answered at 100 x 70: the direct run on that padded frame, cropped back."""
    fleet: Fleet = fleet_factory(max_batch=4, max_wait_s=0.01)
    fleet.add_worker({"ppocr-det": engine_factory(ModelConfig(name="ppocr-det"))})
    client: Client = fleet.ready()
    reference = OnnxRuntimeEngine(locate("ppocr-det"))
    (name,) = (t.name for t in reference.info.io.outputs)
    image = _image(100, 70)
    got = client.infer("ppocr-det", {"x": image}, timeout_s=30)[name]
    padded = np.pad(image, ((0, 0), (0, 0), (0, 28), (0, 26)))
    want = reference.run({"x": padded})[name][:, :, :100, :70]
    assert got.shape == (1, 1, 100, 70)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    buckets = client.stats()["buckets"]["ppocr-det"]
    assert list(buckets) == ["3x128x96"]
    assert buckets["3x128x96"]["batches"] == 1
