"""padding.py: buckets, pad rules and crop axes, on the wire and in arithmetic."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.common.errors import ProtocolError
from carpool.common.padding import (
    CropAxis,
    PadRule,
    bucket_elements,
    cropped_extent,
    padded_elements,
)

DETECTOR = PadRule(multiple_of=(1, 32, 32))  # [3, H, W] items
RECOGNIZER = PadRule(buckets=((3, 48, 160), (3, 48, 320), (3, 48, 640)))
CAMERA = PadRule(buckets=((3, 1080, 1920), (3, 480, 640), (3, 720, 1280)), value=-1.0)


@pytest.mark.parametrize(
    ("rule", "shape", "bucket"),
    [
        (DETECTOR, (3, 720, 1280), (3, 736, 1280)),
        (DETECTOR, (3, 480, 640), (3, 480, 640)),
        (DETECTOR, (3, 1, 33), (3, 32, 64)),
        (RECOGNIZER, (3, 48, 100), (3, 48, 160)),
        (RECOGNIZER, (3, 48, 160), (3, 48, 160)),
        (RECOGNIZER, (3, 48, 161), (3, 48, 320)),
        (RECOGNIZER, (3, 48, 641), None),
        (RECOGNIZER, (3, 49, 100), None),
        (CAMERA, (3, 480, 640), (3, 480, 640)),  # the smallest that holds it, not the first
        (CAMERA, (3, 500, 640), (3, 720, 1280)),
        (CAMERA, (3, 1080, 1921), None),
        (PadRule((1, 32, 32), ((3, 736, 1280),)), (3, 720, 1280), (3, 736, 1280)),
        (PadRule((1, 32, 32), ((3, 736, 1280),)), (3, 737, 1280), None),
    ],
)
def test_a_request_goes_to_the_smallest_bucket_that_holds_it(
    rule: PadRule, shape: tuple[int, ...], bucket: tuple[int, ...] | None
) -> None:
    assert rule.bucket(shape) == bucket


@pytest.mark.parametrize("rule", [DETECTOR, RECOGNIZER, CAMERA])
def test_pad_rules_round_trip_on_the_wire(rule: PadRule) -> None:
    assert PadRule.from_wire(rule.to_wire(), 3, "m input x") == rule


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        ({}, "needs multiple_of or buckets"),
        ({"multiple_of": [32, 32]}, "multiple_of has 2 entries"),
        ({"multiple_of": [1, 0, 32]}, "ints >= 1"),
        ({"buckets": [[3, 48]]}, "has 2 dims"),
        ({"buckets": [[3, 48, 160], [3, 48, 160]]}, "listed twice"),
        ({"multiple_of": [1, 32, 32], "buckets": [[3, 48, 160]]}, "not a multiple"),
        ({"buckets": [[3, 48, 160]], "value": "0"}, "value must be a number"),
        ({"buckets": [[3, 48, 160]], "value": float("nan")}, "finite"),
        ({"buckets": [[3, 48, i + 1] for i in range(65)]}, "at most 64 buckets"),
        ([1, 2], "must be a map"),
    ],
)
def test_bad_pad_rules_are_refused_with_what_is_wrong(wire: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        PadRule.from_wire(wire, 3, "m input x")


def test_allowed_names_the_range_for_the_refusal_message() -> None:
    assert "at most [3, 48, 640]" in RECOGNIZER.allowed()
    assert "multiples of [1, 32, 32]" in DETECTOR.allowed()


def test_crop_axes_round_trip_and_scale_rounds_up() -> None:
    seq = CropAxis(1, "x", 3, 1, 8)  # the recognizer: T = W / 8
    assert CropAxis.from_wire(seq.to_wire(), "m output y") == seq
    assert seq.problems(3, {"x": 4}) == []
    assert cropped_extent(seq, 320) == 40
    assert cropped_extent(seq, 100) == 13  # 12.5, rounded up
    assert cropped_extent(CropAxis(2, "x", 2), 720) == 720


@pytest.mark.parametrize(
    ("crop", "match"),
    [
        (CropAxis(0, "x", 2), "not an output axis"),
        (CropAxis(4, "x", 2), "not an output axis"),
        (CropAxis(1, "z", 2), "names input 'z'"),
        (CropAxis(1, "x", 4), "not an axis of 'x'"),
        (CropAxis(1, "x", 2, 0, 1), "numerator and denominator"),
    ],
)
def test_crop_axes_that_do_not_fit_the_model_say_why(crop: CropAxis, match: str) -> None:
    (problem,) = crop.problems(4, {"x": 4})
    assert match in problem


def test_bad_crop_wire_maps_are_refused() -> None:
    bad: Any
    for bad in (
        [],
        {"axis": 1, "input": "x"},
        {"axis": 1, "input": "x", "input_axis": 2, "scale": [1]},
    ):
        with pytest.raises(ProtocolError):
            CropAxis.from_wire(bad, "m output y")


def test_padded_elements_count_what_padding_adds() -> None:
    assert bucket_elements(2, (3, 736, 1280)) == 2 * 3 * 736 * 1280
    assert padded_elements(2, (3, 720, 1280), (3, 736, 1280)) == 2 * 3 * 16 * 1280
    assert padded_elements(1, (3, 48, 160), (3, 48, 160)) == 0
