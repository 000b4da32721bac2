"""The broker holds requests to the shape rules a worker announced (protocol §8.1): a
shape outside them is INVALID_ARGUMENT at the door, never a batch. Uses
harness.py."""

from __future__ import annotations

from carpool.common.errors import ErrorCode
from carpool.common.protocol import Command, ModelSpec, TensorMeta
from carpool.common.shape_rules import ShapeRule
from tests.unit.broker.harness import F32, T0, W1, W2, Broker, batches, ids, only, to_clients

RULE = ShapeRule(min_shape=(1, 32, 1), max_shape=(-1, 256, -1), multiple_of=(1, 32, 1))


def det(rules: tuple[ShapeRule | None, ...] = (RULE,), max_batch: int = 8) -> ModelSpec:
    return ModelSpec(
        "m",
        (TensorMeta("x", F32, (-1, -1, 4)),),
        (TensorMeta("y", F32, (-1, 2)),),
        max_batch,
        (),
        rules,
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


SMALL = ShapeRule(max_shape=(-1, 64, -1))  # a Jetson's profile: H up to 64
LARGE = ShapeRule(min_shape=(1, 32, 1), max_shape=(-1, 256, -1))  # a server's: 32..256


def two_workers() -> Broker:
    """W1 takes batches of 2 and H up to 64; W2 batches of 8 and H in 32..256."""
    b = Broker.make(max_batch=8, max_wait_s=0.0)
    assert only(b.ready(T0, W1, det((SMALL,), max_batch=2), slots=4), Command.DISCONNECT) == []
    assert only(b.ready(T0, W2, det((LARGE,), max_batch=8), slots=4), Command.DISCONNECT) == []
    return b


def test_workers_with_other_limits_serve_one_model_each_batch_where_it_fits() -> None:
    """Limits (max_batch, shape rules) are each worker's own; a batch goes only to a
    worker whose limits admit it."""
    b = two_workers()
    assert W1 in b.core.registry
    assert W2 in b.core.registry
    # H 16: only W1 admits it; H 128: only W2; 5 samples of H 48: only W2 (W1 takes 2).
    for rid, item, n, to in ((1, (16, 4), 1, W1), (2, (128, 4), 1, W2), (3, (48, 4), 5, W2)):
        (batch,) = batches(b.request(T0, rid, n=n, item=item))
        assert (batch.to, ids(batch)) == (to, [rid])
    # A shape no live worker admits is refused at the door, naming what each takes.
    (msg,) = to_clients(b.request(T0, 4, item=(300, 4)))
    assert (msg.rid, msg.code) == (4, ErrorCode.INVALID_ARGUMENT)
    text = msg.meta["message"]
    assert "dim 1 is 300" in text, text
    assert "w1: max_batch 2; 'x' dim 1 in 1..64" in text, text
    assert "w2: max_batch 8; 'x' dim 1 in 32..256" in text, text
    # 3 samples of H 16: only W1 admits the shape, and it takes 2 at most.
    (msg,) = to_clients(b.request(T0, 5, n=3, item=(16, 4)))
    assert (msg.rid, msg.code) == (5, ErrorCode.INVALID_ARGUMENT)
    assert "accepts at most 2 per batch" in msg.meta["message"]


def test_when_the_only_worker_that_takes_a_shape_leaves_its_queue_is_answered() -> None:
    """W2 busy with one batch of H 128, another waits; W2 leaves: both are answered
    (requeued, then unservable), a new one is refused at the door, W1's shapes flow."""
    b = Broker.make(max_batch=8, max_wait_s=0.0)
    b.ready(T0, W1, det((SMALL,), max_batch=2), slots=4)
    b.ready(T0, W2, det((LARGE,), max_batch=8), slots=1)
    (batch,) = batches(b.request(T0, 1, item=(128, 4)))
    assert batch.to == W2
    assert batches(b.request(T0, 2, item=(128, 4))) == []  # W2 busy: waits for it
    out = b.disconnect(T0 + 0.01, W2)
    errors = only(out, Command.ERROR)
    assert sorted((m.rid, m.code) for m in errors) == [
        (1, ErrorCode.UNAVAILABLE),
        (2, ErrorCode.UNAVAILABLE),
    ]
    assert "no live worker of model 'm' takes its shapes now" in errors[0].meta["message"]
    (msg,) = to_clients(b.request(T0 + 0.02, 3, item=(128, 4)))
    assert msg.code is ErrorCode.INVALID_ARGUMENT
    assert "dim 1 is 128, the model takes at most 64" in msg.meta["message"]
    (batch,) = batches(b.request(T0 + 0.02, 4, n=2, item=(16, 4)))
    assert (batch.to, ids(batch)) == (W1, [4])
    assert b.core.registry.max_batch("m") == 2


def test_a_worker_whose_inputs_differ_is_still_refused() -> None:
    """What a client sends and gets back stays one model's: another dtype is refused."""
    b = Broker.make()
    b.ready(T0, W1, det())
    other = ModelSpec("m", (TensorMeta("x", "float16", (-1, -1, 4)),), det().outputs, 8)
    out = b.ready(T0, W2, other)
    assert [(m.to, m.command) for m in out] == [(W2, Command.DISCONNECT)]
    assert W2 not in b.core.registry
    assert only(b.ready(T0, W2, det(())), Command.DISCONNECT) == []  # no rule: admitted
    assert W2 in b.core.registry
