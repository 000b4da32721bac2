"""render.py: seeded camera frames holding text lines whose words and places are known.

A frame is a light, slightly noisy background with dark lines of words and codes, as a
robot's camera might see labels on shelves. The same seed and size give the same frame.
Lines are spread down the whole frame: the last one ends a few pixels above the bottom
edge, and every third one is set flush right, a few pixels from the right edge (where the
detector's padding begins). Text height scales with the frame (1/20 of its height, at least
30 px: smaller text loses the spaces between words in the recognizer), so every
resolution carries the same words per line; words are set 0.6 font sizes apart.

Pillow is an optional dependency (``pip install 'carpool[demo]'``), imported lazily.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from carpool.pages import require_pillow

_VOCABULARY = (
    "aisle bay bin box carton crate dock door fragile gate hold keep level lift load "
    "order pallet pick rack return row shelf ship slot stack store tote truck unit zone "
    "north south east west cold dry heavy spare parts batch camera frame robot"
)
_WORDS = tuple(_VOCABULARY.split())
_GAP = 0.6  # space between words, in font sizes (a wide space reads back as one)
_INK_BOX = ((min, 0), (min, 1), (max, 2), (max, 3))  # union of word boxes
_EDGE_PX = 4  # flush-right lines end, and the last line ends, this far from the edge


@dataclass(frozen=True, slots=True)
class TextLine:
    """One rendered line: its text and the box its ink covers, ``(x0, y0, x1, y1)`` in
    pixels, ends exclusive."""

    text: str
    box: tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class Frame:
    """A rendered camera frame, ``pixels`` RGB ``[H, W, 3]`` uint8, and its lines."""

    pixels: NDArray[np.uint8]
    lines: tuple[TextLine, ...]

    @property
    def height_px(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width_px(self) -> int:
        return int(self.pixels.shape[1])


def font_px_for(height_px: int) -> int:
    """The text size used in a frame ``height_px`` high."""
    return max(30, round(height_px / 20))


def _phrase(rng: random.Random, fits: Callable[[list[str]], bool], most: int) -> list[str]:
    words: list[str] = []
    while len(words) < most:
        word = rng.choice(_WORDS) if rng.random() < 0.7 else f"{rng.randrange(10, 99999)}"
        if rng.random() < 0.15:
            word = word.upper()
        if words and not fits([*words, word]):
            break
        words.append(word)
    return words


def render_frame(
    seed: int, width_px: int, height_px: int, lines: int = 10, words: int = 3
) -> Frame:
    """A frame of ``width_px`` x ``height_px`` with ``lines`` text lines of up to ``words``
    words (words and numbers; fewer where the line would not fit), chosen by ``seed``.

    Raises:
        ValueError: the frame is too small for that many lines of its text size.
        ImportError: Pillow is not installed (the message says how to get it).
    """
    image_module = require_pillow()
    from PIL import ImageDraw, ImageFont

    font_px = font_px_for(height_px)
    pitch_px = (height_px - _EDGE_PX) / lines
    if lines < 1 or pitch_px < 1.5 * font_px:
        raise ValueError(f"{lines} lines of {font_px} px do not fit {height_px} rows")
    rng = random.Random(seed)
    noise = np.random.default_rng(seed)
    shade = rng.randrange(215, 250)
    base = np.full((height_px, width_px, 3), shade, dtype=np.int16)
    base += noise.integers(-8, 9, size=(height_px, width_px, 1), dtype=np.int16)
    image = image_module.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_px)
    gap_px = round(_GAP * font_px)
    bottom_ink_px = round(draw.textbbox((0, 0), "Agy", font=font)[3])

    def width(words: list[str]) -> int:
        inked = sum(round(draw.textlength(word, font=font)) for word in words)
        return inked + gap_px * (len(words) - 1)

    rendered: list[TextLine] = []
    for i in range(lines):
        flush_right = i % 3 == 2
        left_px = rng.randrange(_EDGE_PX * 2, max(_EDGE_PX * 2 + 1, width_px // 4))
        room_px: float = width_px - left_px - _EDGE_PX * 2 if not flush_right else width_px * 0.6

        def fits(words: list[str], room_px: float = room_px) -> bool:
            return width(words) <= room_px

        chosen = _phrase(rng, fits, words)
        bottom_px = round((i + 1) * pitch_px)
        top_px = round(i * pitch_px + 0.3 * font_px)
        if i == lines - 1:
            top_px = bottom_px - bottom_ink_px
        x_px = width_px - _EDGE_PX - width(chosen) if flush_right else left_px
        ink = rng.randrange(0, 70)
        boxes = []
        for word in chosen:
            boxes.append(draw.textbbox((x_px, top_px), word, font=font))
            draw.text((x_px, top_px), word, fill=(ink, ink, ink), font=font)
            x_px += round(draw.textlength(word, font=font)) + gap_px
        x0, y0, x1, y1 = (round(f(b[k] for b in boxes)) for f, k in _INK_BOX)
        rendered.append(TextLine(" ".join(chosen), (x0, y0, x1, y1)))
    return Frame(np.asarray(image, dtype=np.uint8).copy(), tuple(rendered))
