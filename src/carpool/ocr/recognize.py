"""recognize.py: text boxes to the PP-OCRv4 recognizer's inputs, and CTC decoding.

Follows RapidOCR 1.4.4's ``TextRecognizer`` and ``CTCLabelDecode``: a line is resized to
48 rows keeping its aspect ratio (width ``ceil(48 * w / h)``), normalised as
``(x / 255 - 0.5) / 0.5``, and read by greedy CTC over ``blank``, the dictionary stored in
the model's metadata (key ``character``, one symbol a line) and a space. Unlike RapidOCR,
a line is not padded to the widest line of its batch (or to 320 columns): it goes at its
own width, and the fleet pads it into its width bucket (the worker pads with 0.0, what
RapidOCR pads with) and crops the sequence back to ``W / 8`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from carpool.ocr.detect import Box
from carpool.pages import require_pillow

INPUT = "x"
OUTPUT = "softmax_11.tmp_0"
HEIGHT_PX = 48
METADATA_KEY = "character"


@dataclass(frozen=True, slots=True)
class Charset:
    """The CTC symbols: index 0 is the blank, the last one a space."""

    symbols: tuple[str, ...]

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> Charset:
        """From the recognizer's ONNX metadata (``OnnxRuntimeEngine.metadata``).

        Raises:
            KeyError: the metadata has no ``character`` key.
        """
        return cls(("blank", *metadata[METADATA_KEY].splitlines(), " "))

    def decode(self, probs: NDArray[np.float32]) -> tuple[str, float]:
        """Greedy CTC over one line's ``[T, symbols]`` probabilities: the text, and the
        mean probability of its kept steps (0.0 for none)."""
        if probs.shape[-1] != len(self.symbols):
            raise ValueError(f"{probs.shape[-1]} classes, the charset has {len(self.symbols)}")
        best = probs.argmax(axis=-1)
        keep = best != 0
        keep[1:] &= best[1:] != best[:-1]
        text = "".join(self.symbols[i] for i in best[keep])
        confidence = float(probs.max(axis=-1)[keep].mean()) if keep.any() else 0.0
        return text, confidence


def line_input(pixels: NDArray[np.uint8], box: Box) -> NDArray[np.float32]:
    """The box's crop of an RGB frame as the recognizer's ``x``: ``[1, 3, 48, W]``."""
    image_module = require_pillow()
    crop = pixels[box.y0 : box.y1, box.x0 : box.x1]
    h, w = crop.shape[:2]
    width_px = max(1, math.ceil(HEIGHT_PX * w / h))
    resized = image_module.fromarray(np.ascontiguousarray(crop), "RGB").resize(
        (width_px, HEIGHT_PX), image_module.Resampling.BILINEAR
    )
    chw = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) * np.float32(1 / 255.0)
    return ((chw - np.float32(0.5)) / np.float32(0.5))[np.newaxis]
