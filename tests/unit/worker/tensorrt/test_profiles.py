"""worker/tensorrt/profiles.py: profiles from a model's buckets and shape rules or from
flags, the refusal of sets too large to build (naming the model, input and dim), the
profile a batch's shapes select, and the broker's shape rules and preferred batch sizes
that come from them."""

from __future__ import annotations

import re

import pytest

from carpool.common.errors import ConfigError
from carpool.common.padding import PadRule
from carpool.common.protocol import TensorMeta
from carpool.common.shape_rules import ShapeRule
from carpool.worker.config import ModelConfig
from carpool.worker.engines.base import BadInput
from carpool.worker.shapes import InputConfig
from carpool.worker.tensorrt import profiles
from carpool.worker.tensorrt.profile_text import parse_batch
from carpool.worker.tensorrt.profiles import InputRange, Limits, Profile

IMAGE = (TensorMeta("x", "float32", (-1, 3, -1, -1)),)
LINE = (TensorMeta("x", "float32", (-1, 3, 48, -1)),)
FIXED = (TensorMeta("x", "float32", (-1, 3, 224, 224)),)


def test_a_fixed_shape_model_has_one_profile_over_its_batch() -> None:
    config = ModelConfig(name="orientation", max_batch=16, preferred_batch=(4, 8))
    (profile,) = profiles.from_model(config, FIXED)
    assert profile == Profile(
        (InputRange("x", (1, 3, 224, 224), (8, 3, 224, 224), (16, 3, 224, 224)),)
    )


def test_each_bucket_is_one_profile_with_min_opt_max_the_bucket() -> None:
    pad = PadRule(buckets=((3, 48, 160), (3, 48, 320), (3, 48, 640)))
    config = ModelConfig(name="rec", max_batch=8, inputs={"x": InputConfig(pad=pad)})
    got = profiles.from_model(config, LINE)
    assert [p.inputs[0] for p in got] == [
        InputRange("x", (1, 3, 48, w), (8, 3, 48, w), (8, 3, 48, w)) for w in (160, 320, 640)
    ]


def test_a_dynamic_dim_takes_its_shape_rule_in_pad_steps_and_its_opt_from_the_warmup() -> None:
    config = ModelConfig(
        name="det",
        max_batch=4,
        inputs={
            "x": InputConfig(
                min_shape=(1, 3, 100, 100),
                max_shape=(-1, 3, 1000, 1000),
                pad=PadRule(multiple_of=(1, 32, 32)),
            )
        },
        warmup={"x": ((1, 3, 480, 640),)},
    )
    (profile,) = profiles.from_model(config, IMAGE)
    # min rounded up and max down to multiples of 32; opt the warm-up's H and W
    assert profile.inputs[0] == InputRange(
        "x", (1, 3, 128, 128), (4, 3, 480, 640), (4, 3, 992, 992)
    )


def test_batch_ranges_split_the_batch_into_profiles_times_the_buckets() -> None:
    pad = PadRule(buckets=((3, 48, 160), (3, 48, 320)))
    config = ModelConfig(name="rec", max_batch=64, inputs={"x": InputConfig(pad=pad)})
    got = profiles.from_model(config, LINE, [(1, 8, 8), (9, 64, 64)])
    assert [(p.inputs[0].min[0], p.inputs[0].max[0], p.inputs[0].max[3]) for p in got] == [
        (1, 8, 160),
        (1, 8, 320),
        (9, 64, 160),
        (9, 64, 320),
    ]
    assert profiles.preferred_batch(got) == (8, 64)
    assert profiles.max_batch(got) == 64


def test_a_batch_range_above_max_batch_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape("--batch 1..32 is above its max_batch 8")):
        profiles.from_model(ModelConfig(name="m", max_batch=8), FIXED, [(1, 8, 32)])


def test_a_dynamic_dim_without_an_upper_bound_is_refused_naming_the_input_and_dim() -> None:
    with pytest.raises(ConfigError) as caught:
        profiles.from_model(ModelConfig(name="det"), IMAGE)
    assert str(caught.value).startswith(
        "model 'det', input 'x', dim 2 is dynamic with no upper bound"
    )
    assert "--profile" in str(caught.value)


def test_a_dim_whose_rule_admits_no_step_is_refused() -> None:
    config = ModelConfig(
        name="det",
        inputs={
            "x": InputConfig(
                min_shape=(1, 3, 40, 40),
                max_shape=(-1, 3, 60, 60),
                pad=PadRule(multiple_of=(1, 64, 64)),
            )
        },
    )
    with pytest.raises(
        ConfigError, match=re.escape("dim 2: no size in 40..60 is a multiple of 64")
    ):
        profiles.from_model(config, IMAGE)


def test_more_profiles_than_allowed_are_refused_naming_the_model() -> None:
    buckets = tuple((3, 48, 160 * k) for k in range(1, 11))
    pad = InputConfig(pad=PadRule(buckets=buckets))
    config = ModelConfig(name="rec", max_batch=8, inputs={"x": pad})
    got = profiles.from_model(config, LINE)
    with pytest.raises(ConfigError, match=r"model 'rec': 10 optimization profiles, more than 8"):
        profiles.check_limits("rec", got, Limits())
    profiles.check_limits("rec", got, Limits(max_profiles=10))


@pytest.mark.parametrize(
    ("lo", "hi", "dim", "fix"),
    [
        ((1, 3, 32, 32), (8, 3, 1024, 64), "dim 2", "use buckets"),
        ((1, 3, 32, 32), (32, 3, 32, 32), "dim 0 (the batch)", "--batch ranges"),
    ],
)
def test_a_dim_wider_than_max_ratio_is_refused_naming_input_and_dim(lo, hi, dim, fix) -> None:
    wide = (Profile((InputRange("x", lo, hi, hi),)),)
    with pytest.raises(ConfigError) as caught:
        profiles.check_limits("det", wide, Limits())
    message = str(caught.value)
    assert message.startswith(f"model 'det', input 'x', {dim}: profile 0 spans")
    assert "above 16" in message
    assert fix in message
    profiles.check_limits("det", wide, Limits(max_ratio=32))


def test_profiles_from_flags_name_every_input() -> None:
    (profile,) = profiles.from_flags("det", IMAGE, ["x=1x3x32x32:4x3x320x320:8x3x512x512"])
    assert profile.inputs == (InputRange("x", (1, 3, 32, 32), (4, 3, 320, 320), (8, 3, 512, 512)),)


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("x=1x3x32x32:4x3x320x320", "NAME=MIN:OPT:MAX"),
        ("y=1x3:1x3:1x3", "no input 'y'"),
        ("x=1x3x32:1x3x32:1x3x32", "min shape [1, 3, 32] has 3 dims"),
        ("x=1x3x64x64:1x3x32x32:1x3x64x64", "dim 2: needs 1 <= min <= opt <= max"),
        ("x=1x1x32x32:1x1x32x32:1x1x32x32", "dim 1: is fixed at 3"),
        ("x=1x3xAx3:1:1", "is not a shape"),
    ],
)
def test_bad_profile_flags_say_what_is_wrong(flag, words) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        profiles.from_flags("det", IMAGE, [flag])


def test_a_profile_flag_missing_an_input_is_refused() -> None:
    two = (*IMAGE, TensorMeta("scale", "float32", (-1, 1)))
    with pytest.raises(ConfigError, match=r"gives no shapes for input\(s\) \['scale'\]"):
        profiles.from_flags("m", two, ["x=1x3x8x8:1x3x8x8:1x3x8x8"])


@pytest.mark.parametrize(("text", "ok"), [("1:4:8", (1, 4, 8)), ("4:2:8", None), ("1:8", None)])
def test_batch_flags(text, ok) -> None:
    if ok is None:
        with pytest.raises(ConfigError, match="--batch"):
            parse_batch(text)
    else:
        assert parse_batch(text) == ok


BUCKETED = tuple(
    Profile((InputRange("x", (1, 3, 48, w), (8, 3, 48, w), (8, 3, 48, w)),)) for w in (160, 320)
)


@pytest.mark.parametrize(
    ("shape", "index"), [((1, 3, 48, 160), 0), ((8, 3, 48, 320), 1), ((3, 3, 48, 320), 1)]
)
def test_a_batch_selects_the_profile_that_admits_its_shapes(shape, index) -> None:
    assert profiles.select_profile(BUCKETED, {"x": shape}) == index


def test_a_shape_outside_every_profile_is_refused_listing_what_each_takes() -> None:
    with pytest.raises(BadInput) as caught:
        profiles.select_profile(BUCKETED, {"x": (9, 3, 48, 160)})
    assert str(caught.value) == (
        "shapes x [9, 3, 48, 160] lie outside every optimization profile (profile 0 takes "
        "x [1..8, 3, 48, 160]: input 'x': the batch (dim 0) is 9, not in 1..8; profile 1 "
        "takes x [1..8, 3, 48, 320]: input 'x': the batch (dim 0) is 9, not in 1..8)"
    )


def _two(low: tuple[int, ...], opt: tuple[int, ...], high: tuple[int, ...]) -> Profile:
    """A profile of inputs x (``low``, ``opt``, ``high``) and m (the same batch range)."""
    return Profile((InputRange("x", low, opt, high), InputRange("m", low[:1], opt[:1], high[:1])))


SMALL = _two((1, 32), (4, 64), (8, 128))
LARGE = _two((1, 32), (32, 64), (64, 128))
WIDE = _two((1, 128), (4, 256), (8, 512))


@pytest.mark.parametrize(
    ("x", "m", "chosen"),
    [((2, 64), (2,), 1), ((8, 128), (8,), 1), ((9, 64), (9,), 0), ((4, 300), (4,), 2)],
)
def test_select_profile_takes_the_tightest_that_admits_every_input(x, m, chosen) -> None:
    assert profiles.select_profile([LARGE, SMALL, WIDE], {"x": x, "m": m}) == chosen


def test_select_profile_takes_the_first_of_equals() -> None:
    assert profiles.select_profile([SMALL, SMALL], {"x": (2, 64), "m": (2,)}) == 0


@pytest.mark.parametrize(
    ("x", "m", "reason"),
    [
        (
            (65, 64),
            (65,),
            "profile 1 takes x [1..64, 32..128], m [1..64]: input 'x': the "
            "batch (dim 0) is 65, not in 1..64",
        ),
        (
            (2, 16),
            (2,),
            "profile 0 takes x [1..8, 32..128], m [1..8]: input 'x': dim 1 is 16, not in 32..128",
        ),
        ((2, 64, 1), (2,), "input 'x' has 3 dims, the engine takes 2"),
        ((2, 64), (70,), "input 'm': the batch (dim 0) is 70, not in 1..8"),
    ],
)
def test_a_shape_outside_every_profile_is_refused_naming_the_dim(x, m, reason) -> None:
    with pytest.raises(BadInput, match="outside every optimization profile") as refused:
        profiles.select_profile([SMALL, LARGE], {"x": x, "m": m})
    assert reason in str(refused.value)


def test_what_a_plan_announces_comes_from_its_profiles() -> None:
    inputs = (TensorMeta("x", "float32", (-1, -1)), TensorMeta("m", "int64", (-1,)))
    outputs = (TensorMeta("y", "float32", (-1, 10)),)
    info = profiles.engine_info(inputs, outputs, [SMALL, LARGE, WIDE], "m")
    assert info.io.max_batch == 64
    assert info.io.preferred_batch == (4, 32)  # the opt batch sizes
    assert info.io.rules[0] == ShapeRule((1, 32), (64, 512))
    assert info.io.rules[1] == ShapeRule((1,), (64,))
    assert info.warmup == (((4, 64), (4,)), ((32, 64), (32,)), ((4, 256), (4,)))


def test_max_batch_is_the_largest_one_every_input_takes() -> None:
    uneven = Profile((InputRange("x", (1, 4), (8, 4), (16, 4)), InputRange("m", (1,), (2,), (4,))))
    assert profiles.max_batch([uneven]) == 4
    assert profiles.preferred_batch([uneven]) == (2,)


@pytest.mark.parametrize(("shape", "kind"), [((4, 10), "output 'y'"), ((-1, 10), None)])
def test_a_plan_without_a_dynamic_batch_dim_is_refused(shape, kind) -> None:
    inputs = (TensorMeta("x", "float32", (-1, -1)), TensorMeta("m", "int64", (-1,)))
    outputs = (TensorMeta("y", "float32", shape),)
    if kind is None:
        assert profiles.engine_info(inputs, outputs, [SMALL], "m").io.max_batch == 8
        return
    with pytest.raises(ConfigError, match=f"{kind} has shape .* dynamic batch dim"):
        profiles.engine_info(inputs, outputs, [SMALL], "m")
    with pytest.raises(ConfigError, match="no optimization profile"):
        profiles.engine_info(inputs, (), [], "m")


def test_the_broker_rules_are_the_envelope_of_the_profiles() -> None:
    assert profiles.shape_rules_from_profiles(BUCKETED) == {
        "x": ShapeRule((1, 3, 48, 160), (8, 3, 48, 320))
    }
    assert profiles.preferred_batch(BUCKETED) == (8,)


def test_a_profile_key_is_its_json_shapes() -> None:
    assert BUCKETED[0].inputs[0].to_key() == [
        "x",
        [1, 3, 48, 160],
        [8, 3, 48, 160],
        [8, 3, 48, 160],
    ]
