"""The broker holds requests to the shape rules a worker announced (protocol §8.1): a
shape outside them is INVALID_ARGUMENT at the door, never a batch. Uses test_core's
harness (both pump modes)."""

from __future__ import annotations

from carpool.common.errors import ErrorCode
from carpool.common.protocol import Command, ModelSpec, TensorMeta
from carpool.common.shape_rules import ShapeRule
from tests.unit.broker.test_core import (  # noqa: F401  (pump_mode: autouse, both modes)
    C1,
    F32,
    T0,
    W1,
    W2,
    Broker,
    batches,
    ids,
    only,
    pump_mode,
    to_clients,
)

RULE = ShapeRule(min_shape=(1, 32, 1), max_shape=(-1, 256, -1), multiple_of=(1, 32, 1))


def det(rules: tuple[ShapeRule | None, ...] = (RULE,)) -> ModelSpec:
    return ModelSpec(
        "m", (TensorMeta("x", F32, (-1, -1, 4)),), (TensorMeta("y", F32, (-1, 2)),), 8, (), rules
    )


def test_shapes_outside_the_rules_are_refused_and_inside_them_batched() -> None:
    b = Broker.make(max_batch=1, max_wait_s=0.0)
    b.ready(T0, W1, det(), slots=4)
    refused = {
        1: (100, 4, "dim 1 is 100, the model takes multiples of 32 (pad to 128)"),
        2: (288, 4, "dim 1 is 288, the model takes at most 256"),
        3: (64, 5, "does not fit [?, ?, 4]"),  # the spec's own fixed dim still holds
    }
    for rid, (h, w, why) in refused.items():
        (msg,) = to_clients(b.request(T0, rid, item=(h, w)))
        assert (msg.command, msg.rid, msg.code) == (Command.ERROR, rid, ErrorCode.INVALID_ARGUMENT)
        assert why in msg.meta["message"]
    out = b.request(T0, 4, item=(64, 4))
    assert [ids(m) for m in batches(out)] == [[4]]
    # A known layout takes the fast path; a shape that breaks a rule never became one.
    out = b.request(T0, 5, item=(64, 4)) + b.request(T0, 6, item=(100, 4))
    assert [ids(m) for m in batches(out)] == [[5]]
    (msg,) = to_clients(out)
    assert (msg.rid, msg.code) == (6, ErrorCode.INVALID_ARGUMENT)


def test_a_worker_whose_rules_differ_from_the_registered_spec_is_refused() -> None:
    """The first READY fixes a model's inputs, rules included: the broker admits
    requests by one set of rules, so every worker of the model must take them."""
    b = Broker.make()
    b.ready(T0, W1, det())
    out = b.ready(T0, W2, det((ShapeRule(multiple_of=(1, 16, 1)),)))
    assert [(m.to, m.command) for m in out] == [(W2, Command.DISCONNECT)]
    assert W2 not in b.core.registry
    out = b.ready(T0, W2, det(()))
    assert only(out, Command.DISCONNECT)
    assert only(b.ready(T0, W2, det()), Command.DISCONNECT) == []
    assert W2 in b.core.registry
