"""worker/shapes.py: a model config's shape declarations against the model's inputs and
outputs (each problem under its key), and into the EngineInfo a worker announces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest

from carpool.common.errors import ConfigError
from carpool.common.padding import CropAxis, PadRule
from carpool.common.protocol import ModelSpec, TensorMeta
from carpool.common.shape_rules import ShapeRule
from carpool.worker.engines.base import Array, EngineInfo, engine_io
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.shapes import (
    CropConfig,
    InputConfig,
    ModelShapes,
    OutputConfig,
    declare,
    problems,
)
from carpool.worker.warmup import warm_up

#: The PP-OCR detector's tensors: [B, 3, H, W] in, [B, 1, H, W] out.
DET_IN = (TensorMeta("x", "float32", (-1, 3, -1, -1)),)
DET_OUT = (TensorMeta("map", "float32", (-1, 1, -1, -1)),)
HW = (CropConfig(2, "x", 2), CropConfig(3, "x", 3))


def _problems(**shapes: object) -> list[tuple[str, str]]:
    return problems(ModelShapes(**shapes), DET_IN, DET_OUT, 8)  # type: ignore[arg-type]


def test_a_detector_padded_to_multiples_of_32_and_cropped_back_fits() -> None:
    pad = PadRule(multiple_of=(1, 32, 32))
    shapes = ModelShapes(
        {"x": InputConfig(pad=pad)},
        {"map": OutputConfig(HW)},
        {"x": ((1, 3, 736, 1280), (4, 3, 480, 640))},
    )
    assert problems(shapes, DET_IN, DET_OUT, 8) == []
    info = declare(EngineInfo(engine_io(DET_IN, DET_OUT, 8)), shapes, "det")
    assert info.io.pads == (pad,)
    assert info.io.crops == ((CropAxis(2, "x", 2), CropAxis(3, "x", 3)),)
    assert info.warmup == (((1, 3, 736, 1280),), ((4, 3, 480, 640),))
    # READY carries the pad rule and the crops (protocol §8.1); the warm-up stays here.
    spec = info.spec("det")
    assert ModelSpec.from_wire(spec.to_wire()) == spec
    assert spec.pads == info.io.pads
    assert spec.crops == info.io.crops


@pytest.mark.parametrize(
    ("shapes", "expected"),
    [
        (
            {"inputs": {"x": InputConfig(pad=PadRule(multiple_of=(32, 32)))}},
            ("inputs.x.pad.multiple_of", "has 2 entries, the input has 3 dims after the batch dim"),
        ),
        (
            {"inputs": {"x": InputConfig(pad=PadRule(buckets=((4, 64, 64),)))}},
            ("inputs.x.pad.buckets", "bucket [4, 64, 64] has 4 in dim 1, fixed at 3"),
        ),
        (
            {"inputs": {"x": InputConfig(pad=PadRule(multiple_of=(2, 32, 32)))}},
            ("inputs.x.pad.multiple_of", "dim 1 is fixed at 3, not a multiple of 2"),
        ),
        (
            {
                "inputs": {
                    "x": InputConfig(
                        multiple_of=(1, 1, 32, 32), pad=PadRule(buckets=((3, 64, 100),))
                    )
                }
            },
            (
                "inputs.x.pad.buckets",
                "bucket [3, 64, 100] breaks the input's shape rule: dim 3 is 100, the model "
                "takes multiples of 32 (pad to 128)",
            ),
        ),
        (
            {"inputs": {"x": InputConfig(pad=PadRule(buckets=((48, 320),)))}},
            ("inputs.x.pad.buckets", "bucket [48, 320] has 2 dims, the input has 3"),
        ),
        (
            {"inputs": {"x": InputConfig(pad=PadRule())}},
            ("inputs.x.pad", "a pad rule needs multiple_of or buckets"),
        ),
        (
            {"inputs": {"image": InputConfig(multiple_of=(1, 1, 32, 32))}},
            ("inputs.image", "no input 'image'; the model's inputs are ['x']"),
        ),
        (
            {"inputs": {"x": InputConfig(min_shape=(1, 32))}},
            ("inputs.x.min_shape", "has 2 entries, the input has 4 dims"),
        ),
        (
            {"outputs": {"prob": OutputConfig(HW)}},
            ("outputs.prob", "no output 'prob'; the model's outputs are ['map']"),
        ),
        (
            {"outputs": {"map": OutputConfig((CropConfig(4, "x", 2),))}},
            ("outputs.map.crop[0].axis", "4 is not an output axis in 1..3"),
        ),
        (
            {"outputs": {"map": OutputConfig((CropConfig(2, "y", 2),))}},
            ("outputs.map.crop[0]", "names input 'y', not one of ['x']"),
        ),
        (
            {"outputs": {"map": OutputConfig((CropConfig(2, "x", 2, (1, 2, 3)),))}},
            ("outputs.map.crop[0].scale", "is [numerator, denominator], got (1, 2, 3)"),
        ),
        (
            {"outputs": {"map": OutputConfig((CropConfig(1, "x", 1),))}},
            ("outputs.map.crop[0].axis", "output axis 1 is fixed at 1, not dynamic"),
        ),
        (
            {"outputs": {"map": OutputConfig((*HW, CropConfig(3, "x", 3)))}},
            ("outputs.map.crop[2].axis", "3 is cropped twice"),
        ),
        (
            {"warmup": {"x": ((1, 3, 736),)}},
            ("warmup.x[0]", "[1, 3, 736] has 3 dims, the input has 4"),
        ),
        (
            {"warmup": {"x": ((16, 3, 64, 64),)}},
            ("warmup.x[0]", "[16, 3, 64, 64]: dim 0 (the batch) must lie in 1..max_batch (8)"),
        ),
        (
            {"warmup": {"x": ((1, 1, 64, 64),)}},
            ("warmup.x[0]", "[1, 1, 64, 64]: dim 1 is 1, the input's is 3"),
        ),
        (
            {
                "inputs": {"x": InputConfig(multiple_of=(1, 1, 32, 32))},
                "warmup": {"x": ((1, 3, 720, 1280),)},
            },
            (
                "warmup.x[0]",
                "[1, 3, 720, 1280] breaks the input's shape rule: dim 2 is 720, the model "
                "takes multiples of 32 (pad to 736)",
            ),
        ),
        (
            {
                "inputs": {"x": InputConfig(pad=PadRule(multiple_of=(1, 32, 32)))},
                "warmup": {"x": ((1, 3, 720, 1280),)},
            },
            (
                "warmup.x[0]",
                "[1, 3, 720, 1280] is not a bucket of the input's pad rule (requests run "
                "padded to one)",
            ),
        ),
        (
            {"warmup": {"y": ((1, 3, 64, 64),)}},
            ("warmup.y", "no input 'y'; the model's inputs are ['x']"),
        ),
    ],
)
def test_each_problem_names_its_key_and_the_rule(
    shapes: Mapping[str, object], expected: tuple[str, str]
) -> None:
    assert expected in _problems(**shapes)


def test_a_warm_up_run_needs_a_shape_for_every_input() -> None:
    two = (TensorMeta("a", "float32", (-1, 4)), TensorMeta("b", "float32", (-1, 4)))
    found = problems(ModelShapes(warmup={"a": ((1, 4), (2, 4))}), two, two[:1], 8)
    assert found == [("warmup", "has no shapes for input(s) ['b']: each run needs every input")]
    found = problems(ModelShapes(warmup={"a": ((1, 4), (2, 4)), "b": ((1, 4),)}), two, two, 8)
    assert found == [("warmup", "inputs have [1, 2] shapes; each run takes one of each")]


def test_declare_refuses_with_every_problem_and_its_key() -> None:
    shapes = ModelShapes(
        {"x": InputConfig(pad=PadRule(multiple_of=(32, 32)))},
        {"prob": OutputConfig(HW)},
    )
    with pytest.raises(ConfigError) as caught:
        declare(EngineInfo(engine_io(DET_IN, DET_OUT, 8)), shapes, "model 'det'")
    assert str(caught.value) == (
        "model 'det': inputs.x.pad.multiple_of: has 2 entries, the input has 3 dims after "
        "the batch dim; outputs.prob: no output 'prob'; the model's outputs are ['map']"
    )


def test_a_declared_shape_rule_replaces_the_engines_own_for_that_input() -> None:
    io = replace(engine_io(DET_IN, DET_OUT, 8), rules=(ShapeRule(multiple_of=(1, 1, 32, 32)),))
    info = EngineInfo(io)
    kept = declare(info, ModelShapes({"x": InputConfig(pad=PadRule(multiple_of=(1, 32, 32)))}), "")
    assert kept.io.rules == info.io.rules  # a pad rule alone leaves the shape rule
    replaced = declare(info, ModelShapes({"x": InputConfig(max_shape=(-1, 3, 64, 64))}), "")
    assert replaced.io.rules == (ShapeRule(max_shape=(-1, 3, 64, 64)),)


class Seen(SyntheticEngine):
    """Records the shape of every batch run."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.shapes: list[tuple[int, ...]] = []

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        self.shapes.append(tuple(inputs["x"].shape))
        return super().run(inputs)


def test_warm_up_runs_the_declared_shapes_and_checks_the_first_per_sample() -> None:
    """With ``warmup`` declared, the warm-up runs each declared shape (not a guess from
    the rules: a detector warmed up at 32 x 32 pays for its first camera frame), then
    the per-sample check on one sample of the first."""
    shapes = ModelShapes(warmup={"x": ((4, 3, 64, 96), (1, 3, 128, 32))})
    engine = Seen(item_shape=(3, -1, -1), max_batch=8, shapes=shapes)
    warm_up(engine)
    one = (1, 3, 64, 96)
    assert engine.shapes == [(4, 3, 64, 96), (1, 3, 128, 32), one, one, one, (2, 3, 64, 96)]
