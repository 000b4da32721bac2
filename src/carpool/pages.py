"""pages.py: synthetic document pages for the demo — render, rotate, preprocess.

A page is a white 224x224 image with lines of black text, different per seed and the same
for the same seed. :func:`preprocess` turns a (possibly rotated) page into the input of the
catalogue's ``orientation`` model; :func:`expected_label` says which class it should give.

Pillow is an optional dependency (``pip install 'carpool[demo]'``); this module imports it
lazily so that importing carpool never needs it.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from numpy.typing import NDArray

PAGE_SIZE_PX = 224
ANGLES_DEG = (0, 90, 180, 270)
"""Rotations the demo applies (counter-clockwise, as ``PIL.Image.rotate`` does)."""

_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)
_TEXT = (
    "the quick brown fox jumps over a lazy dog while invoices pile up on the desk "
    "shipping manifest order total amount due payment terms net thirty days carrier "
    "broker worker batch deadline latency camera frame page scan orientation model "
    "please sign and return this copy to the accounts department before friday"
)
_MARGIN_PX = 10
_LINE_PX = 18
_LINE_CHARS = 28


def require_pillow() -> Any:
    """Import Pillow's ``Image`` module, or raise ImportError that says how to get it."""
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(
            "the demo renders pages with Pillow, which is not installed: "
            "pip install 'carpool[demo]'"
        ) from None
    return Image


def render_page(seed: int) -> Any:
    """A white page with lines of black text chosen by ``seed`` (deterministic).

    Returns:
        An RGB ``PIL.Image.Image`` of 224x224 pixels.
    """
    image_module = require_pillow()
    from PIL import ImageDraw, ImageFont

    rng = random.Random(seed)
    words = _TEXT.split()
    page = image_module.new("RGB", (PAGE_SIZE_PX, PAGE_SIZE_PX), "white")
    draw = ImageDraw.Draw(page)
    font = ImageFont.load_default(size=14)
    y_px = _MARGIN_PX
    while y_px + _LINE_PX <= PAGE_SIZE_PX - _MARGIN_PX:
        line = ""
        while True:
            word = rng.choice(words)
            if len(line) + 1 + len(word) > _LINE_CHARS:
                break
            line = f"{line} {word}" if line else word
        draw.text((_MARGIN_PX, y_px), line, fill="black", font=font)
        y_px += _LINE_PX
    return page


def preprocess(image: Any) -> NDArray[np.float32]:
    """A page as the orientation model's input ``x``: float32 [1,3,224,224], ImageNet-
    normalised ((x/255 - mean) / std per channel)."""
    rgb = image.convert("RGB")
    if rgb.size != (PAGE_SIZE_PX, PAGE_SIZE_PX):
        rgb = rgb.resize((PAGE_SIZE_PX, PAGE_SIZE_PX))
    hwc = np.asarray(rgb, dtype=np.float32) / 255.0
    chw = (hwc.transpose(2, 0, 1) - _MEAN) / _STD
    return np.ascontiguousarray(chw[np.newaxis], dtype=np.float32)


def expected_label(angle_deg: int) -> int:
    """The orientation class of a page rotated counter-clockwise by ``angle_deg``.

    The model's labels are clockwise angles 0/90/180/270, so a page turned 90°
    counter-clockwise reads as 270° clockwise (index 3).
    """
    if angle_deg % 90:
        raise ValueError(f"angle must be a multiple of 90, got {angle_deg}")
    return ((360 - angle_deg) % 360) // 90
