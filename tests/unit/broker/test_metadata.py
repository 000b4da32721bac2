"""METADATA at the broker core: the models its live workers serve, by worker name."""

from __future__ import annotations

from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Command,
    MetadataRequest,
    ModelMetadata,
    ModelSpec,
    parse_metadata_reply,
)
from tests.unit.broker.harness import C1, SPEC, SPEC2, T0, W1, W2, Broker, model_spec


def _ask(
    b: Broker, request: MetadataRequest, delimited: bool = False
) -> tuple[int | None, list[ModelMetadata]]:
    frames = request.to_frames()
    (msg,) = b.client(T0 + 0.01, C1, [b"", *frames] if delimited else frames)
    assert msg.to == C1
    assert msg.delimited is delimited
    assert msg.command is Command.METADATA
    rid, models = parse_metadata_reply(msg.meta)
    return rid, list(models)


def test_one_model_is_described_from_its_live_workers() -> None:
    b = Broker.make()
    b.ready(T0, W1, SPEC, SPEC2)
    b.ready(T0, W2, model_spec("m", 16))  # the same model, a larger batch limit
    rid, (m,) = _ask(b, MetadataRequest(7, "m"))
    assert rid == 7
    assert m.spec.inputs == SPEC.inputs
    assert m.spec.outputs == SPEC.outputs
    assert m.spec.max_batch == 16  # the largest a live worker takes
    assert m.workers == ("w1", "w2")  # names, never routing ids


def test_every_served_model_is_listed_and_a_departed_one_is_not() -> None:
    b = Broker.make()
    b.ready(T0, W1, SPEC, SPEC2)
    b.ready(T0, W2, model_spec("only-w2"))
    _, models = _ask(b, MetadataRequest(), delimited=True)
    assert [m.spec.name for m in models] == ["m", "only-w2", "two"]
    b.disconnect(T0 + 0.005, W2)
    _, models = _ask(b, MetadataRequest(8))
    assert [m.spec.name for m in models] == ["m", "two"]


def test_a_model_no_live_worker_serves_is_not_found_with_the_request_id() -> None:
    b = Broker.make()
    b.ready(T0, W1, SPEC)
    (msg,) = b.client(T0, C1, MetadataRequest(9, "nosuch").to_frames())
    assert msg.command is Command.ERROR
    assert (msg.meta["id"], msg.meta["code"]) == (9, ErrorCode.NOT_FOUND)
    (msg,) = b.client(T0, C1, [MetadataRequest().to_frames()[0], b"\xc1"])
    assert msg.meta["code"] == ErrorCode.INVALID_ARGUMENT


def test_the_spec_is_the_one_the_workers_announced() -> None:
    b = Broker.make()
    spec: ModelSpec = SPEC2
    b.ready(T0, W1, spec)
    _, (m,) = _ask(b, MetadataRequest(1, "two"))
    assert m.spec == spec
