"""pages.py: deterministic page rendering, preprocessing, and labels the real model agrees with."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("PIL")

from carpool.pages import (
    ANGLES_DEG,
    PAGE_SIZE_PX,
    expected_label,
    preprocess,
    render_page,
)
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.models import locate


def test_rendering_is_deterministic_per_seed() -> None:
    first, again, other = render_page(3), render_page(3), render_page(4)
    assert first.size == (PAGE_SIZE_PX, PAGE_SIZE_PX)
    assert first.mode == "RGB"
    assert first.tobytes() == again.tobytes()
    assert first.tobytes() != other.tobytes()


def test_a_page_has_black_text_on_white() -> None:
    pixels = np.asarray(render_page(0).convert("L"))
    assert pixels[0, 0] == 255  # the margin is white
    assert pixels.min() < 64  # some ink
    assert (pixels == 255).mean() > 0.5  # mostly paper


def test_preprocess_is_imagenet_normalised_nchw() -> None:
    x = preprocess(render_page(0))
    assert x.shape == (1, 3, PAGE_SIZE_PX, PAGE_SIZE_PX)
    assert x.dtype == np.float32
    assert x.flags.c_contiguous
    white = (1.0 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(x[0, :, 0, 0], white, rtol=1e-5)


def test_expected_labels_are_clockwise_indices() -> None:
    # PIL rotates counter-clockwise; the model's labels are clockwise 0/90/180/270.
    assert [expected_label(a) for a in ANGLES_DEG] == [0, 3, 2, 1]
    with pytest.raises(ValueError, match="multiple of 90"):
        expected_label(45)


def test_the_orientation_model_reads_every_rotation() -> None:
    engine = OnnxRuntimeEngine(locate("orientation"), max_batch=16)
    pages = [render_page(seed) for seed in range(3)]
    x = np.concatenate([preprocess(page.rotate(a)) for page in pages for a in ANGLES_DEG])
    labels = [expected_label(a) for _ in pages for a in ANGLES_DEG]
    scores = engine.run({"x": x})["fetch_name_0"]
    assert scores.shape == (len(labels), 4)
    assert np.argmax(scores, axis=1).tolist() == labels
