"""Each worker's own limits (broker/limits.py): which queue shapes a worker admits, the
door's refusal naming what each live worker takes, METADATA's union (hull) of rules, and
the per-worker limits METADATA carries."""

from __future__ import annotations

from carpool.broker.limits import hull, refusal, takes, violation
from carpool.broker.metadata import describe
from carpool.broker.registry import WorkerRegistry
from carpool.broker.requests import WorkerId
from carpool.common.protocol import (
    MetadataRequest,
    ModelMetadata,
    ModelSpec,
    Ready,
    TensorMeta,
    WorkerLimits,
)
from carpool.common.shape_rules import ShapeRule

F32 = "float32"
INPUTS = (TensorMeta("x", F32, (-1, 3, -1, -1)), TensorMeta("k", F32, (-1, 2)))
OUTPUTS = (TensorMeta("y", F32, (-1, 2)),)
JETSON = ShapeRule((1, 1, 32, 32), (-1, -1, 736, 1280), (1, 1, 32, 32))
SERVER = ShapeRule((1, 1, 64, 64), (-1, -1, 1472, 2560), (1, 1, 16, 16))


def spec(max_batch: int, *rules: ShapeRule | None, preferred: tuple[int, ...] = ()) -> ModelSpec:
    return ModelSpec("det", INPUTS, OUTPUTS, max_batch, preferred, tuple(rules))


def key(h: int, w: int) -> tuple[str, tuple[tuple[str, str, tuple[int, ...]], ...]]:
    return ("det", (("x", F32, (3, h, w)), ("k", F32, (2,))))


def test_a_worker_admits_the_shapes_its_rules_keep() -> None:
    jetson = spec(8, JETSON, None)
    assert violation(jetson, key(736, 1280)) is None
    assert violation(spec(8), key(5000, 7)) is None  # no rule: any shape
    why = violation(jetson, key(1472, 1280))
    assert why == (
        "input 'x': shape [3, 1472, 1280] (without dim 0): dim 2 is 1472, the model takes "
        "at most 736"
    )
    assert "multiples of 32" in (violation(jetson, key(48, 64)) or "")


def test_the_refusal_names_what_each_worker_takes() -> None:
    workers = [
        ("jetson-1", spec(8, JETSON, None)),
        ("jetson-2", spec(8, JETSON, None)),
        ("gpu-1", spec(64, SERVER, None)),
    ]
    text = refusal("det", key(2048, 4096), workers)
    assert text.startswith("input 'x': shape [3, 2048, 4096] (without dim 0): dim 2 is 2048")
    assert "no live worker of model 'det' takes it" in text
    assert "gpu-1: max_batch 64; 'x' dim 2 in 64..1472 step 16, dim 3 in 64..2560 step 16" in text
    assert "jetson-1, jetson-2: max_batch 8; 'x' dim 2 in 32..736 step 32" in text
    assert takes(spec(4)) == "max_batch 4; any shape"


def test_the_hull_is_the_loosest_rule_every_admitted_shape_keeps() -> None:
    (x, k) = hull([spec(8, JETSON, None), spec(64, SERVER, None)])
    assert k is None
    assert x == ShapeRule((1, 1, 32, 32), (-1, -1, 1472, 2560), (1, 1, 16, 16))
    # An input a worker leaves unruled has no rule in the union; no rule at all: ().
    assert hull([spec(8, JETSON, None), spec(8)]) == ()
    assert hull([spec(8, ShapeRule(max_shape=(-1, -1, 64, -1)), None), spec(8, SERVER, None)]) == (
        ShapeRule((), (-1, -1, 1472, -1), ()),
        None,
    )


def test_metadata_shows_the_union_and_each_workers_limits() -> None:
    registry = WorkerRegistry()
    for wid, name, s in (
        (b"a", "jetson-1", spec(8, JETSON, None, preferred=(4, 8))),
        (b"b", "gpu-1", spec(64, SERVER, None, preferred=(32,))),
    ):
        assert registry.conflicts(Ready(name, 1, (s,))) == []
        registry.add(0.0, WorkerId(wid), Ready(name, 1, (s,)), 1.0)
    (model,) = describe(registry, MetadataRequest()) or []
    assert model.spec.max_batch == 64
    assert model.spec.preferred_batch == (4, 8, 32)
    assert model.spec.rules == (
        ShapeRule((1, 1, 32, 32), (-1, -1, 1472, 2560), (1, 1, 16, 16)),
        None,
    )
    assert model.workers == ("gpu-1", "jetson-1")
    assert model.limits == (
        WorkerLimits("gpu-1", 64, (32,), (SERVER, None)),
        WorkerLimits("jetson-1", 8, (4, 8), (JETSON, None)),
    )
    wire = model.to_wire()
    assert wire["limits"][1]["inputs"] == [
        {"name": "x", **JETSON.to_wire()},
        {"name": "k"},
    ]
    assert ModelMetadata.from_wire(wire) == model
    # The registry's answer per queue shape: who admits it, and the largest batch then.
    assert registry.limit(key(736, 1280)) == 64
    assert [w.name for w in registry.admitting(key(736, 1280))] == ["jetson-1", "gpu-1"]
    assert registry.limit(key(32, 32)) == 8
    assert registry.limit(key(2048, 64)) == 0
    registry.remove(WorkerId(b"b"))
    assert registry.limit(key(736, 1280)) == 8
    assert registry.limit(key(1472, 2560)) == 0
