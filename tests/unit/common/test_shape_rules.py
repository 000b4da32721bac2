"""shape_rules.py and the model spec's input limits on the wire (protocol §8.1)."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.common.errors import ConfigError, ProtocolError
from carpool.common.protocol import ModelSpec, TensorMeta
from carpool.common.shape_rules import ShapeRule, align

F32 = "float32"
DET = ShapeRule(multiple_of=(1, 1, 32, 32))
PROFILE = ShapeRule(min_shape=(1, 3, 64, 64), max_shape=(-1, 3, 640, -1))


def spec(rules: tuple[ShapeRule | None, ...] = ()) -> ModelSpec:
    return ModelSpec(
        "det",
        (TensorMeta("x", F32, (-1, 3, -1, -1)), TensorMeta("k", F32, (-1, 2))),
        (TensorMeta("y", F32, (-1, 1, -1, -1)),),
        8,
        (),
        rules,
    )


@pytest.mark.parametrize(
    ("rule", "shape", "why"),
    [
        (DET, (1, 3, 96, 128), None),
        (DET, (5, 3, 32, 32), None),
        (DET, (1, 3, 100, 128), "dim 2 is 100, the model takes multiples of 32 (pad to 128)"),
        (DET, (1, 3, 96, 10), "dim 3 is 10, the model takes multiples of 32 (pad to 32)"),
        (PROFILE, (1, 3, 64, 4096), None),
        (PROFILE, (1, 3, 640, 64), None),
        (PROFILE, (1, 3, 63, 64), "dim 2 is 63, the model takes at least 64"),
        (PROFILE, (1, 3, 641, 64), "dim 2 is 641, the model takes at most 640"),
        (PROFILE, (1, 3, 64, 32), "dim 3 is 32, the model takes at least 64"),
        # Dim 0 is the sample count, bounded by max_batch, not by a rule.
        (ShapeRule(min_shape=(4, 1), max_shape=(2, -1), multiple_of=(3, 1)), (1, 7), None),
    ],
)
def test_a_request_shape_keeps_a_rule_or_is_told_which_dim_breaks_it(
    rule: ShapeRule, shape: tuple[int, ...], why: str | None
) -> None:
    assert rule.violation(shape) == why


def test_rules_travel_in_the_input_descriptors_and_come_back() -> None:
    with_rules = spec((DET, ShapeRule(max_shape=(-1, 2))))
    wire = with_rules.to_wire()
    assert wire["inputs"][0] == {
        "name": "x",
        "dtype": F32,
        "shape": [-1, 3, -1, -1],
        "multiple_of": [1, 1, 32, 32],
    }
    assert wire["inputs"][1]["max_shape"] == [-1, 2]
    assert ModelSpec.from_wire(wire) == with_rules
    only_first = spec((DET, None))
    assert ModelSpec.from_wire(only_first.to_wire()) == only_first


def test_a_spec_without_rules_has_only_the_plain_keys_on_the_wire() -> None:
    """The rule keys are optional: a READY without them (from a worker of any version)
    reads as a spec without rules."""
    wire = spec().to_wire()
    assert all(set(t) == {"name", "dtype", "shape"} for t in wire["inputs"])
    assert ModelSpec.from_wire(wire).rules == ()
    # Empty lists are no rule at all.
    wire["inputs"][0]["multiple_of"] = []
    assert ModelSpec.from_wire(wire).rules == ()


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("multiple_of", [1, 1, 32], "multiple_of has 3 entries, the input has 4 dims"),
        ("multiple_of", [1, 1, 0, 32], "multiple_of entries must be ints >= 1"),
        ("multiple_of", [1, 1, 32.0, 32], "multiple_of entries must be ints"),
        ("multiple_of", [1, 1, True, 32], "multiple_of entries must be ints"),
        ("min_shape", [1, 3, -1, 1], "min_shape entries must be ints >= 1"),
        ("max_shape", [1, 3, 0, 1], r"max_shape entries must be ints -1 \(no limit\) or >= 1"),
        ("max_shape", [1, 3, -2, 1], "max_shape entries must be ints"),
        ("max_shape", "640", "max_shape must be a list of ints"),
    ],
)
def test_a_malformed_rule_is_a_protocol_error(key: str, value: Any, match: str) -> None:
    wire = spec().to_wire()
    wire["inputs"][0][key] = value
    with pytest.raises(ProtocolError, match=match):
        ModelSpec.from_wire(wire)


def test_a_rule_whose_minimum_exceeds_its_maximum_is_refused() -> None:
    wire = spec().to_wire()
    wire["inputs"][0].update(min_shape=[1, 1, 64, 64], max_shape=[-1, -1, 32, -1])
    with pytest.raises(ProtocolError, match="dim 2: min_shape 64 exceeds max_shape 32"):
        ModelSpec.from_wire(wire)


def test_align_orders_rules_by_input_and_names_what_does_not_fit() -> None:
    assert align(["x", "k"], [4, 2], {"x": DET}, "m") == (DET, None)
    assert align(["x", "k"], [4, 2], {}, "m") == ()
    assert align(["x"], [4], {"x": ShapeRule()}, "m") == ()  # an empty rule is none
    with pytest.raises(ConfigError, match=r"shape rules for \['image'\], but its inputs"):
        align(["x"], [4], {"image": DET}, "m")
    with pytest.raises(ConfigError, match="input 'k': multiple_of has 4 entries"):
        align(["x", "k"], [4, 2], {"k": DET}, "m")
