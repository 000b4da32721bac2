"""pipeline.py: frames to text, over a transport that runs the two models.

:class:`OcrSteps` is the whole of the OCR logic: the detector's input for each frame, its
probability map to boxes, each box to a recognizer input, each CTC output to text.
:class:`OcrPipeline` runs those steps over a :class:`Transport`: :class:`EngineTransport`
calls ONNX Runtime in this process one request at a time; :class:`FleetTransport` sends
every request to a carpool broker at once through a ``Client`` and waits for them all.
The two differ only in transport, batching and padding, so comparing their text
measures what the fleet changes.

Padding of the detector's frames (:class:`DetectorPad`) is the pipeline's choice:
``MINIMAL`` pads each frame here to the next multiples of 32 (what the model needs, and
what a direct run must do), ``FLEET`` sends frames at their own size for the fleet's pad
rule to pad (to the same multiples of 32, in the worker), and a fixed ``(H, W)`` pads
every frame here to one static shape (as a fleet without buckets would need). Outputs are
cropped back to each frame before post-processing in every case. Text lines always go at
their own width: the fleet pads them into its width buckets; a direct run does not pad.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from carpool.client import Client
from carpool.ocr import detect, recognize
from carpool.ocr.detect import Box, DbParams
from carpool.ocr.recognize import Charset

DETECTOR = "ppocr-det"
RECOGNIZER = "ppocr-rec"


class DetectorPad(Enum):
    MINIMAL = "minimal"  # pad here to multiples of 32
    FLEET = "fleet"  # send as is; the fleet's pad rule pads


class Transport(Protocol):
    """Runs one model on requests of one sample each; returns one output per request."""

    def run(self, model: str, output: str, inputs: Sequence[NDArray[np.float32]]) -> list[Any]:
        """The ``output`` of ``model`` for each of ``inputs`` (each fed as ``x``), in order."""
        ...


class _Runs(Protocol):
    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]: ...


class EngineTransport:
    """ONNX Runtime engines in this process (``OnnxRuntimeEngine``), by model name; each
    request runs alone."""

    def __init__(self, engines: Mapping[str, _Runs]) -> None:
        self._engines = dict(engines)

    def run(self, model: str, output: str, inputs: Sequence[NDArray[np.float32]]) -> list[Any]:
        engine = self._engines[model]
        return [engine.run({"x": x})[output] for x in inputs]


class FleetTransport:
    """A carpool fleet: every request submitted at once, then all awaited (each fails
    with the client's ``RequestError`` subclass if the fleet refuses it)."""

    def __init__(self, client: Client, timeout_s: float = 30.0) -> None:
        self._client = client
        self._timeout_s = timeout_s

    def run(self, model: str, output: str, inputs: Sequence[NDArray[np.float32]]) -> list[Any]:
        futures = [self._client.submit(model, {"x": x}, self._timeout_s) for x in inputs]
        return [f.result().outputs[output] for f in futures]


@dataclass(frozen=True, slots=True)
class Reading:
    """One text box of a frame and what was read in it."""

    box: Box
    text: str
    confidence: float


@dataclass(frozen=True, slots=True)
class OcrSteps:
    """The OCR logic without a transport: each frame's detector input, boxes from its
    output, text from a recognizer output (for callers that run the models themselves,
    such as the demo's open-loop cameras)."""

    charset: Charset
    detector_pad: DetectorPad | tuple[int, int] = DetectorPad.MINIMAL
    params: DbParams = field(default_factory=DbParams)

    def detector_input(self, pixels: NDArray[np.uint8]) -> NDArray[np.float32]:
        """A frame as the detector's ``x``, padded as ``detector_pad`` says."""
        x = detect.preprocess(pixels)
        if self.detector_pad is DetectorPad.FLEET:
            return x
        if self.detector_pad is DetectorPad.MINIMAL:
            return detect.pad_to(x, *detect.padded_shape(*pixels.shape[:2]))
        return detect.pad_to(x, *self.detector_pad)

    def boxes(self, pixels: NDArray[np.uint8], prob: NDArray[np.float32]) -> list[Box]:
        """Text boxes from the detector's output ``[1, 1, H', W']`` for ``pixels``."""
        height_px, width_px = pixels.shape[:2]
        return detect.boxes(prob[0, 0, :height_px, :width_px], self.params)

    def text(self, probs: NDArray[np.float32]) -> tuple[str, float]:
        """Text and confidence from the recognizer's output ``[1, T, symbols]``."""
        return self.charset.decode(probs[0])


@dataclass(frozen=True, slots=True)
class OcrPipeline:
    """Reads text in RGB frames ``[H, W, 3]`` uint8: ``steps`` over ``transport``."""

    transport: Transport
    steps: OcrSteps
    detector: str = DETECTOR
    recognizer: str = RECOGNIZER

    def read(self, frames: Sequence[NDArray[np.uint8]]) -> list[list[Reading]]:
        """What each frame says: its boxes top to bottom and their texts."""
        steps = self.steps
        maps = self.transport.run(
            self.detector, detect.OUTPUT, [steps.detector_input(p) for p in frames]
        )
        found = [steps.boxes(p, m) for p, m in zip(frames, maps, strict=True)]
        lines = [
            recognize.line_input(p, b) for p, bs in zip(frames, found, strict=True) for b in bs
        ]
        outputs = iter(self.transport.run(self.recognizer, recognize.OUTPUT, lines))
        return [[Reading(b, *steps.text(next(outputs))) for b in bs] for bs in found]


def load_charset(path: str | Path) -> Charset:
    """The recognizer's charset from its ONNX file's metadata (needs onnxruntime)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    model = ort.InferenceSession(str(path), sess_options=options)
    return Charset.from_metadata(dict(model.get_modelmeta().custom_metadata_map))
