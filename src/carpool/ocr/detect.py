"""detect.py: the PP-OCRv4 detector's input, and its probability map to text boxes.

Pre-processing follows RapidOCR 1.4.4's ``DetPreProcess`` (mean and std 0.5, scale
1/255, CHW) without its resize: a camera frame is read at its own resolution, and the
model's need for multiples of 32 is met by padding (the fleet's pad rule, or
:func:`pad_to` for a direct run), never by scaling the frame.

Post-processing follows its ``DBPostProcess`` (threshold 0.3, box threshold 0.5, unclip
ratio 1.6, minimum side 3, 2x2 dilation, the "fast" box score) for upright text, in numpy
alone: the thresholded map's 8-connected components (run-length labelling with a
union-find) stand for its contours, each component's bounding rectangle for the minimum
area rectangle, and the rectangle grown by ``area * ratio / perimeter`` on every side for
the polygon offset. Rotated text is out of scope: the frames here hold level lines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

INPUT = "x"
OUTPUT = "sigmoid_0.tmp_0"
MULTIPLE_PX = 32  # the model's H and W must be multiples of this


@dataclass(frozen=True, slots=True)
class DbParams:
    """RapidOCR's defaults for the PP-OCRv4 detector (its config.yaml)."""

    thresh: float = 0.3
    box_thresh: float = 0.5
    unclip_ratio: float = 1.6
    min_size_px: float = 3.0
    max_candidates: int = 1000


@dataclass(frozen=True, slots=True)
class Box:
    """An upright text box, ``x0, y0, x1, y1`` in pixels (ends exclusive), with its score."""

    x0: int
    y0: int
    x1: int
    y1: int
    score: float

    @property
    def width_px(self) -> int:
        return self.x1 - self.x0

    @property
    def height_px(self) -> int:
        return self.y1 - self.y0


def preprocess(pixels: NDArray[np.uint8]) -> NDArray[np.float32]:
    """An RGB frame ``[H, W, 3]`` as the detector's ``x``: float32 ``[1, 3, H, W]``."""
    chw = pixels.astype(np.float32).transpose(2, 0, 1) * np.float32(1 / 255.0)
    return ((chw - np.float32(0.5)) / np.float32(0.5))[np.newaxis]


def padded_shape(height_px: int, width_px: int, multiple: int = MULTIPLE_PX) -> tuple[int, int]:
    """``(H, W)`` rounded up to multiples of ``multiple``: the least the model runs."""
    return (-(-height_px // multiple) * multiple, -(-width_px // multiple) * multiple)


def pad_to(x: NDArray[np.float32], height_px: int, width_px: int) -> NDArray[np.float32]:
    """``x`` ``[N, C, H, W]`` padded with zeros at the bottom and right to the given size,
    as the fleet's pad rule does (its value 0.0)."""
    n, c, h, w = x.shape
    if (h, w) == (height_px, width_px):
        return x
    if h > height_px or w > width_px:
        raise ValueError(f"a {h}x{w} frame does not fit {height_px}x{width_px}")
    out = np.zeros((n, c, height_px, width_px), dtype=x.dtype)
    out[:, :, :h, :w] = x
    return out


def boxes(prob: NDArray[np.float32], params: DbParams = DbParams()) -> list[Box]:
    """Text boxes from one probability map ``[H, W]`` (already cropped to the frame),
    top to bottom, then left to right."""
    height_px, width_px = prob.shape
    mask = prob > params.thresh
    dilated = mask.copy()  # cv2.dilate with a 2x2 kernel: anchor at (1, 1)
    dilated[1:, :] |= mask[:-1, :]
    dilated[:, 1:] |= mask[:, :-1]
    dilated[1:, 1:] |= mask[:-1, :-1]
    found: list[Box] = []
    for x0, y0, x1, y1 in components(dilated)[: params.max_candidates]:
        if min(x1 - x0, y1 - y0) < params.min_size_px:
            continue
        score = float(prob[y0 : y1 + 1, x0 : x1 + 1].mean())
        if score < params.box_thresh:
            continue
        w, h = x1 - x0, y1 - y0
        grow = w * h * params.unclip_ratio / (2 * (w + h))
        if min(w, h) + 2 * grow < params.min_size_px + 2:
            continue
        found.append(
            Box(
                int(np.clip(round(x0 - grow), 0, width_px)),
                int(np.clip(round(y0 - grow), 0, height_px)),
                int(np.clip(round(x1 + grow), 0, width_px)),
                int(np.clip(round(y1 + grow), 0, height_px)),
                score,
            )
        )
    found.sort(key=lambda b: (b.y0, b.x0))
    return found


def components(mask: NDArray[np.bool_]) -> list[tuple[int, int, int, int]]:
    """The 8-connected components of ``mask`` as bounding boxes ``(x0, y0, x1, y1)`` with
    inclusive ends, in the order of their first pixel (row-major)."""
    height_px, width_px = mask.shape
    edges = np.diff(np.pad(mask, ((0, 0), (1, 1))).astype(np.int8), axis=1)
    rows, starts = np.nonzero(edges == 1)
    _, stops = np.nonzero(edges == -1)  # exclusive
    count = len(rows)
    if count == 0:
        return []
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    row_begin = np.searchsorted(rows, np.arange(height_px + 1))
    for r in range(height_px - 1):
        a, a_end = int(row_begin[r]), int(row_begin[r + 1])
        b, b_end = a_end, int(row_begin[r + 2])
        while a < a_end and b < b_end:
            # Runs [s, e) touch across rows (8-connected) when s_b <= e_a and s_a <= e_b.
            if starts[b] <= stops[a] and starts[a] <= stops[b]:
                ra, rb = root(a), root(b)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
            if stops[a] < stops[b]:
                a += 1
            else:
                b += 1
    labels = np.fromiter((root(i) for i in range(count)), dtype=np.int64, count=count)
    ids, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    x0 = np.full(len(ids), width_px, dtype=np.int64)
    y0 = np.full(len(ids), height_px, dtype=np.int64)
    x1 = np.zeros(len(ids), dtype=np.int64)
    y1 = np.zeros(len(ids), dtype=np.int64)
    np.minimum.at(x0, inverse, starts)
    np.minimum.at(y0, inverse, rows)
    np.maximum.at(x1, inverse, stops - 1)
    np.maximum.at(y1, inverse, rows)
    order = np.argsort(first, kind="stable")
    return [(int(x0[k]), int(y0[k]), int(x1[k]), int(y1[k])) for k in order]
