"""The OCR pipeline end to end on the real PP-OCRv4 detector and recognizer: seeded text
lines rendered into camera frames of three sizes, read through a fleet (its worker pads
frames to multiples of 32 and lines into width buckets, and batches them) and read
directly on ONNX Runtime (each request alone, padded only as the detector needs).

The suite's sizes are 640x480, 1280x720 and 960x540, not 1920x1080: a 1080p frame costs
about half a second in the detector on this 2-core machine, and the real-model tests
together must stay under a minute. 960x540 keeps the 16:9 frame whose height is not a
multiple of 32 (padded to 544). Lines have at most two words: the recognizer's cost grows
with a line's width. The three camera resolutions themselves, 1080p included, with lines
of three words, run in bench/ocr_buckets.py.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from carpool.ocr.accuracy import Score, score_frame
from carpool.ocr.pipeline import (
    DetectorPad,
    EngineTransport,
    FleetTransport,
    OcrPipeline,
    OcrSteps,
    load_charset,
)
from carpool.ocr.render import Frame, render_frame
from carpool.worker.config import ModelConfig
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.factory import engine_factory
from carpool.worker.models import locate
from tests.conftest import Fleet, loopback_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SIZES = ((640, 480), (1280, 720), (960, 540))  # (W, H)
FRAMES = 3  # of 10 lines each: 30 lines per size
WORDS = 2  # at most, per line (the recognizer's cost grows with the line's width)
MAX_CER = 0.05
MAX_GAP = 0.01  # fleet CER within one point of the direct run's


def _score(pipeline: OcrPipeline, frames: list[Frame]) -> Score:
    readings = pipeline.read([f.pixels for f in frames])
    total = Score()
    for frame, read in zip(frames, readings, strict=True):
        total += score_frame(frame.lines, [(r.box, r.text) for r in read])
    return total


def test_text_read_through_the_fleet_matches_the_rendered_lines_and_a_direct_run() -> None:
    with contextlib.ExitStack() as stack:
        _read_three_sizes(stack)


def _read_three_sizes(stack: contextlib.ExitStack) -> None:
    charset = load_charset(locate("ppocr-rec"))
    direct = OcrPipeline(
        EngineTransport(
            {
                "ppocr-det": OnnxRuntimeEngine(locate("ppocr-det")),
                "ppocr-rec": OnnxRuntimeEngine(locate("ppocr-rec")),
            }
        ),
        OcrSteps(charset, DetectorPad.MINIMAL),
    )
    # The engine watchdog predicts a batch's time from the model's fitted cost, one for
    # all its buckets: a batch of 1280x720 frames after 640x480 ones runs several times
    # the prediction, more so on a loaded machine. A long slack keeps it from marking the
    # only worker unhealthy; its verdicts are tested elsewhere.
    config = dataclasses.replace(
        loopback_config(max_batch=4, max_wait_s=0.01), watchdog_slack_s=60.0
    )
    fleet = Fleet(stack, config)
    fleet.add_worker(
        {
            "ppocr-det": engine_factory(ModelConfig(name="ppocr-det", max_batch=4)),
            "ppocr-rec": engine_factory(ModelConfig(name="ppocr-rec", max_batch=4)),
        }
    )
    client = fleet.ready()
    served = OcrPipeline(FleetTransport(client), OcrSteps(charset, DetectorPad.FLEET))
    lines = 0
    for width_px, height_px in SIZES:
        frames = [render_frame(s, width_px, height_px, words=WORDS) for s in range(FRAMES)]
        assert sum(len(f.lines) for f in frames) >= 30
        want = _score(direct, frames)
        got = _score(served, frames)
        size = f"{width_px}x{height_px}"
        assert got.lines == want.lines >= 30, size
        assert got.cer <= MAX_CER, f"{size}: fleet CER {got.cer:.3f} ({got})"
        assert want.cer <= MAX_CER, f"{size}: direct CER {want.cer:.3f} ({want})"
        assert abs(got.cer - want.cer) <= MAX_GAP, f"{size}: fleet {got}, direct {want}"
        lines += got.lines
    # Frames were padded to their own multiples of 32 in the worker, and batched by bucket;
    # every line the detector found went to a width bucket of the recognizer.
    buckets = client.stats()["buckets"]
    frames_per_bucket = {k: v["samples"] for k, v in buckets["ppocr-det"].items()}
    assert frames_per_bucket == {"3x480x640": FRAMES, "3x736x1280": FRAMES, "3x544x960": FRAMES}
    assert 0 < buckets["ppocr-det"]["3x736x1280"]["padded_share"] < 0.05
    assert buckets["ppocr-det"]["3x480x640"]["padded_share"] == 0.0
    assert sum(v["samples"] for v in buckets["ppocr-rec"].values()) >= lines
