"""A model's shape rules end to end (protocol §8.1), on the real PP-OCRv4 detector over
real sockets: a frame whose H or W is not a multiple of 32 fails inside the model, so the
worker announces the rule and the broker answers INVALID_ARGUMENT, saying what to pad
to, instead of the batch failing INTERNAL."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from carpool.client import Client
from carpool.common.errors import InvalidArgument
from carpool.worker.config import ModelConfig
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.models import locate
from tests.conftest import Fleet

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def _image(h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(h * w)
    return rng.random((1, 3, h, w), dtype=np.float32)


def test_the_rule_is_real_the_model_itself_fails_off_the_grid() -> None:
    engine = OnnxRuntimeEngine(locate("ppocr-det"))
    with pytest.raises(Exception, match=r"(?i)broadcast|shape|dimension"):
        engine.run({"x": _image(100, 96)})
    assert engine.run({"x": _image(96, 64)})[engine.info.outputs[0].name].shape == (1, 1, 96, 64)


def test_the_broker_refuses_off_grid_frames_and_serves_the_rest(
    fleet_factory: Callable[..., Fleet],
) -> None:
    fleet: Fleet = fleet_factory(max_batch=4, max_wait_s=0.01)
    fleet.add_worker({"ppocr-det": ModelConfig(name="ppocr-det").factory()})
    client: Client = fleet.ready()
    with pytest.raises(InvalidArgument, match=r"dim 2 is 100, the model takes multiples of 32 "):
        client.infer("ppocr-det", {"x": _image(100, 96)}, timeout_s=30)
    with pytest.raises(InvalidArgument, match=r"dim 3 is 70, .*\(pad to 96\)"):
        client.infer("ppocr-det", {"x": _image(64, 70)}, timeout_s=30)
    reference = OnnxRuntimeEngine(locate("ppocr-det"))
    (name,) = (t.name for t in reference.info.outputs)
    image = _image(96, 64)
    got = client.infer("ppocr-det", {"x": image}, timeout_s=30)[name]
    np.testing.assert_allclose(got, reference.run({"x": image})[name], rtol=1e-5, atol=1e-6)
    # Only the good frame reached the worker, as a batch of one; nothing failed there.
    stats = client.stats()
    assert stats["errors"] == {"INVALID_ARGUMENT": 2}, stats["errors"]
    assert sum(stats["batch_sizes"]["ppocr-det"].values()) == 1
