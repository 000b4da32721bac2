"""Shape buckets end to end over real loopback sockets (protocol §8.1, §8.3, §8.4): a
synthetic worker with a pad rule, and the real PP-OCRv4 detector on CPU workers with
frames of three resolutions in one run. Requests of different shapes in one bucket share
a batch (the broker's per-bucket batch counts say so), each client gets exactly what it
would get alone padded to the same bucket and cropped back, and a shape outside every
bucket is refused with the allowed range."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from carpool.client import Client
from carpool.common.errors import InvalidArgument
from carpool.common.padding import PadRule
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.models import locate
from carpool.worker.shapes import CropConfig, InputConfig, ModelShapes, OutputConfig
from tests.conftest import Fleet

pytestmark = pytest.mark.timeout(120)

RULE = PadRule(multiple_of=(8, 8), buckets=((16, 16), (32, 48)), value=-3.0)


def _pad(x: np.ndarray, bucket: tuple[int, ...], value: float) -> np.ndarray:
    """One request alone, padded bottom and right to ``bucket`` (its item shape)."""
    widths = [(0, 0)] + [(0, b - d) for d, b in zip(x.shape[1:], bucket, strict=True)]
    return np.pad(x, widths, constant_values=value)


def test_a_synthetic_padded_model_batches_by_bucket_and_crops_back(
    fleet_factory: Callable[..., Fleet],
) -> None:
    # The size trigger alone forms batches: four requests per bucket make one batch.
    fleet: Fleet = fleet_factory(max_batch=4, max_wait_s=30.0, policy="fixed")
    crop = OutputConfig((CropConfig(1, "x", 1), CropConfig(2, "x", 2)))
    declared = ModelShapes({"x": InputConfig(pad=RULE)}, {"y": crop})
    fleet.add_worker(
        {"m": lambda: SyntheticEngine(item_shape=(-1, -1), max_batch=4, shapes=declared)}
    )
    client: Client = fleet.ready()
    rng = np.random.default_rng(7)
    shapes = [(9, 16), (16, 3), (16, 16), (1, 1), (20, 33), (32, 48), (17, 40), (25, 9)]
    frames = {s: rng.random((1, *s), dtype=np.float32) for s in shapes}
    futures = {s: client.submit("m", {"x": x}, timeout_s=30) for s, x in frames.items()}
    for shape, future in futures.items():
        got = future.result().outputs["y"]
        bucket = RULE.bucket(shape)
        assert bucket is not None
        want = synthetic_output(_pad(frames[shape], bucket, RULE.value))[:, : shape[0], : shape[1]]
        np.testing.assert_array_equal(got, want)
    with pytest.raises(InvalidArgument, match=r"shape \[1, 33, 8\] fits no bucket.*at most"):
        client.infer("m", {"x": np.zeros((1, 33, 8), np.float32)}, timeout_s=30)
    buckets = client.stats()["buckets"]["m"]
    assert {k: (v["batches"], v["samples"]) for k, v in buckets.items()} == {
        "16x16": (1, 4),
        "32x48": (1, 4),
    }
    own = sum(a * b for a, b in shapes[:4])
    assert buckets["16x16"]["padded_share"] == round(1 - own / (4 * 16 * 16), 4)


# ------------------------------------------------------------------ the real detector

#: Camera buckets for the detector: H and W to multiples of 32, then one of three
#: resolutions (small, so that the test stays fast on a CPU).
CAMERAS = PadRule(multiple_of=(1, 32, 32), buckets=((3, 128, 160), (3, 224, 320), (3, 256, 320)))
#: Three frames per bucket, of different shapes: each bucket's three share one batch.
FRAMES = [(120, 160), (100, 150), (128, 160), (200, 300), (210, 320), (224, 290)]
FRAMES += [(240, 320), (250, 310), (256, 320)]


def _detector() -> OnnxRuntimeEngine:
    crop = OutputConfig((CropConfig(2, "x", 2), CropConfig(3, "x", 3)))
    shapes = ModelShapes({"x": InputConfig(pad=CAMERAS)}, {"sigmoid_0.tmp_0": crop})
    return OnnxRuntimeEngine(locate("ppocr-det"), max_batch=3, shapes=shapes)


@pytest.mark.slow
def test_the_ppocr_detector_batches_three_resolutions_by_bucket(
    fleet_factory: Callable[..., Fleet],
) -> None:
    import onnxruntime as ort

    fleet: Fleet = fleet_factory(max_batch=3, max_wait_s=30.0, policy="fixed")
    fleet.add_worker({"ppocr-det": _detector})
    fleet.add_worker({"ppocr-det": _detector})
    client: Client = fleet.ready()
    rng = np.random.default_rng(19)
    frames = [rng.random((1, 3, h, w), dtype=np.float32) for h, w in FRAMES]
    futures = [client.submit("ppocr-det", {"x": x}, timeout_s=60) for x in frames]
    direct = ort.InferenceSession(str(locate("ppocr-det")), providers=["CPUExecutionProvider"])
    (name,) = (o.name for o in direct.get_outputs())
    for x, future in zip(frames, futures, strict=True):
        got = future.result().outputs[name]
        h, w = x.shape[2:]
        bucket = CAMERAS.bucket(x.shape[1:])
        assert bucket is not None
        (alone,) = direct.run([name], {"x": _pad(x, bucket, 0.0)})
        assert got.shape == (1, 1, h, w)
        np.testing.assert_allclose(got, alone[:, :, :h, :w], rtol=1e-4, atol=1e-5)
    buckets = client.stats()["buckets"]["ppocr-det"]
    assert {k: (v["batches"], v["samples"]) for k, v in buckets.items()} == {
        "3x128x160": (1, 3),
        "3x224x320": (1, 3),
        "3x256x320": (1, 3),
    }
    assert 0 < buckets["3x224x320"]["padded_share"] < 1
    with pytest.raises(InvalidArgument, match=r"shape \[1, 3, 300, 320\] fits no bucket"):
        client.infer("ppocr-det", {"x": np.zeros((1, 3, 300, 320), np.float32)}, timeout_s=30)


@pytest.mark.slow
def test_the_ppocr_recognizer_pads_widths_to_a_bucket_and_crops_its_sequence(
    fleet_factory: Callable[..., Fleet],
) -> None:
    """The catalogue's recognizer: lines 100 and 160 wide share bucket 3x48x160, and
    each gets ceil(W / 8) CTC steps of the run on its line alone, padded to 160."""
    import onnxruntime as ort

    from carpool.worker.config import ModelConfig
    from carpool.worker.factory import engine_factory

    fleet: Fleet = fleet_factory(max_batch=2, max_wait_s=30.0, policy="fixed")
    fleet.add_worker({"ppocr-rec": engine_factory(ModelConfig(name="ppocr-rec", max_batch=2))})
    client: Client = fleet.ready()
    rng = np.random.default_rng(8)
    lines = [rng.random((1, 3, 48, w), dtype=np.float32) for w in (100, 160)]
    futures = [client.submit("ppocr-rec", {"x": x}, timeout_s=60) for x in lines]
    direct = ort.InferenceSession(str(locate("ppocr-rec")), providers=["CPUExecutionProvider"])
    (name,) = (o.name for o in direct.get_outputs())
    for x, future in zip(lines, futures, strict=True):
        got = future.result().outputs[name]
        steps = -(-x.shape[3] // 8)
        (alone,) = direct.run([name], {"x": _pad(x, (3, 48, 160), 0.0)})
        assert got.shape == (1, steps, 6625)
        np.testing.assert_allclose(got, alone[:, :steps], rtol=1e-4, atol=1e-5)
    buckets = client.stats()["buckets"]["ppocr-rec"]
    assert {k: (v["batches"], v["samples"]) for k, v in buckets.items()} == {"3x48x160": (1, 2)}
    with pytest.raises(InvalidArgument, match=r"fits no bucket.*at most \[3, 48, 2560\]"):
        client.infer("ppocr-rec", {"x": np.zeros((1, 3, 48, 2561), np.float32)}, timeout_s=30)
