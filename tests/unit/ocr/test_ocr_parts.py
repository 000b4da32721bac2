"""The OCR application's pure parts: rendering, DB post-processing, CTC decoding, CER."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.ocr import accuracy, detect, recognize, render
from carpool.ocr.detect import Box


def test_a_seed_renders_the_same_frame_and_lines_reach_the_edges() -> None:
    a = render.render_frame(3, 640, 480)
    b = render.render_frame(3, 640, 480)
    assert np.array_equal(a.pixels, b.pixels)
    assert a.lines == b.lines
    assert a.pixels.shape == (480, 640, 3)
    assert len(a.lines) == 10
    assert all(line.text for line in a.lines)
    assert max(line.box[2] for line in a.lines) >= 640 - 8  # flush right
    assert a.lines[-1].box[3] >= 480 - 12  # the last line sits on the bottom edge
    assert render.render_frame(4, 640, 480).lines != a.lines


def test_a_frame_too_small_for_its_lines_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        render.render_frame(0, 640, 100, lines=10)


def test_components_are_eight_connected_and_in_first_pixel_order() -> None:
    mask = np.zeros((6, 8), dtype=bool)
    mask[0, 5:8] = True  # a bar at the top right
    mask[1, 1] = mask[2, 2] = mask[3, 3] = True  # a diagonal: one component
    mask[5, 0:2] = True  # a separate bar at the bottom
    assert detect.components(mask) == [(5, 0, 7, 0), (1, 1, 3, 3), (0, 5, 1, 5)]
    assert detect.components(np.zeros((3, 3), dtype=bool)) == []


def test_a_u_shape_joins_into_one_component() -> None:
    mask = np.zeros((4, 5), dtype=bool)
    mask[0:3, 0] = mask[0:3, 4] = True
    mask[3, 0:5] = True
    assert detect.components(mask) == [(0, 0, 4, 3)]


def test_boxes_are_grown_by_the_unclip_distance_and_weak_ones_dropped() -> None:
    prob = np.zeros((60, 200), dtype=np.float32)
    prob[20:30, 40:140] = 0.9  # a text band 100 x 10
    prob[45:50, 10:20] = 0.35  # above the threshold, below box_thresh: dropped
    (box,) = detect.boxes(prob)
    # The dilated band is 101 x 11 px; unclip grows it by area * 1.6 / perimeter.
    grow = 100 * 10 * 1.6 / (2 * (100 + 10))
    assert (box.x0, box.y0) == (round(40 - grow), round(20 - grow))
    assert (box.x1, box.y1) == (round(140 + grow), round(30 + grow))
    assert box.score == pytest.approx(0.9, abs=0.1)


def test_detector_input_is_normalised_and_padded_at_the_bottom_and_right() -> None:
    pixels = np.full((20, 40, 3), 255, dtype=np.uint8)
    x = detect.preprocess(pixels)
    assert x.shape == (1, 3, 20, 40)
    assert np.allclose(x, 1.0)
    assert detect.padded_shape(720, 1280) == (736, 1280)
    padded = detect.pad_to(x, *detect.padded_shape(20, 40))
    assert padded.shape == (1, 3, 32, 64)
    assert np.allclose(padded[:, :, :20, :40], 1.0)
    assert not padded[:, :, 20:, :].any()
    assert not padded[:, :, :, 40:].any()
    with pytest.raises(ValueError, match="does not fit"):
        detect.pad_to(x, 16, 64)


def test_a_line_is_resized_to_48_rows_keeping_its_aspect() -> None:
    pixels = np.zeros((100, 300, 3), dtype=np.uint8)
    x = recognize.line_input(pixels, Box(0, 0, 200, 24, 1.0))
    assert x.shape == (1, 3, 48, 400)
    assert np.allclose(x, -1.0)


def test_ctc_decoding_collapses_repeats_and_drops_blanks() -> None:
    charset = recognize.Charset.from_metadata({"character": "a\nb\nc"})
    assert charset.symbols == ("blank", "a", "b", "c", " ")
    steps = [1, 1, 0, 1, 4, 2, 2, 3, 0]  # a a _ a ' ' b b c _
    probs = np.full((len(steps), 5), 0.1, dtype=np.float32)
    probs[np.arange(len(steps)), steps] = 0.6
    text, confidence = charset.decode(probs)
    assert text == "aa bc"
    assert confidence == pytest.approx(0.6)
    assert charset.decode(np.eye(5, dtype=np.float32)[[0, 0]]) == ("", 0.0)
    with pytest.raises(ValueError, match="classes"):
        charset.decode(np.zeros((2, 3), dtype=np.float32))


def test_edit_distance_and_cer() -> None:
    assert accuracy.edit_distance("kitten", "sitting") == 3
    assert accuracy.edit_distance("", "abc") == 3
    assert accuracy.edit_distance("same", "same") == 0
    line = render.TextLine("dock 42", (10, 10, 110, 30))
    elsewhere = render.TextLine("bay 7", (10, 60, 80, 80))
    read = [
        (Box(8, 8, 60, 32, 0.9), "dock"),  # the line read in two boxes
        (Box(62, 8, 112, 32, 0.9), "4Z"),
        (Box(300, 300, 340, 320, 0.9), "xyz"),  # a box no line claims: 3 insertions
    ]
    score = accuracy.score_frame([line, elsewhere], read)
    # "dock 42" read "dock 4Z" (1 error); "bay 7" missed (5); 3 stray characters.
    assert (score.errors, score.chars, score.lines, score.exact) == (9, 12, 2, 0)
    assert score.cer == pytest.approx(9 / 12)
