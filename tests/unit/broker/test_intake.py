"""intake.py: ClientIntake, the door, built on its own from the state it reads (the
configuration, the worker registry, the backlog, the fleet model): a request decoded
from the wire is queued (its entry returned) or refused (the Refused returned, nothing
written), and a layout checked once comes decoded with it the next time."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.broker.backlog import Backlog
from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.fleet import FleetModel
from carpool.broker.intake import ClientIntake
from carpool.broker.registry import WorkerRegistry
from carpool.broker.replies import Refused
from carpool.broker.requests import ClientId, PendingRequest, RequestBook, WorkerId
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    ModelSpec,
    Ready,
    Request,
    Submit,
    TensorMeta,
    decode_from_client,
    encode_request,
)

CLIENT = ClientId(b"c1")
T0 = 100.0
SPEC = ModelSpec(
    "m", (TensorMeta("x", "float32", (-1, 4)),), (TensorMeta("y", "float32", (-1, 2)),), 8
)


def door(**config: Any) -> ClientIntake:
    """The door of a broker with one live worker of model "m" (batches of up to 8)."""
    cfg = BrokerConfig(batching=BatchingConfig(policy="fixed", max_batch=8), **config)
    registry = WorkerRegistry(liveness=cfg.liveness)
    fleet = FleetModel(cfg, registry)
    lane = fleet.lane("m", 8, ())
    registry.add(T0, WorkerId(b"w"), Ready("w", 1, (SPEC,)), 1.0, {"m": lane})
    return ClientIntake(cfg, registry, Backlog(RequestBook(), fleet.batch_unit), fleet)


def request(intake: ClientIntake, rid: int, shape: tuple[int, ...] = (1, 4), **kw: Any) -> Any:
    """A REQUEST as the core hands it to the door: decoded with the door's layouts."""
    submit = Submit(rid, kw.pop("model", "m"), 1000, (TensorMeta("x", "float32", shape),), **kw)
    n = 4
    for d in shape:
        n *= d
    msg = decode_from_client(encode_request(submit, [bytes(n)]), intake.layouts)
    assert isinstance(msg, Request)
    return msg


def test_a_valid_request_is_queued_and_its_entry_returned() -> None:
    intake = door()
    got = intake.admit(T0, CLIENT, request(intake, 1, (2, 4)), None)
    assert isinstance(got, PendingRequest)
    assert (got.request_id, got.samples, got.model, got.deadline_s) == (1, 2, "m", T0 + 1.0)
    assert got.nbytes == 32
    assert intake.backlog.queued == 1
    assert intake.backlog.queues[got.key].head() is got


def test_a_layout_checked_once_comes_decoded_with_its_value_the_next_time() -> None:
    intake = door()
    first = intake.admit(T0, CLIENT, request(intake, 1), None)
    assert isinstance(first, PendingRequest)
    again = request(intake, 2)
    assert again.layout is not None
    assert again.layout.key == first.key
    second = intake.admit(T0, CLIENT, again, None)
    assert isinstance(second, PendingRequest)
    assert second.key is first.key  # the remembered layout's key, not one built again


@pytest.mark.parametrize(
    ("model", "shape", "code"),
    [
        ("nope", (1, 4), ErrorCode.NOT_FOUND),
        ("m", (1, 5), ErrorCode.INVALID_ARGUMENT),
        ("m", (9, 4), ErrorCode.INVALID_ARGUMENT),  # larger than any batch
    ],
)
def test_a_request_that_does_not_fit_is_refused_and_nothing_is_queued(
    model: str, shape: tuple[int, ...], code: ErrorCode
) -> None:
    intake = door()
    got = intake.admit(T0, CLIENT, request(intake, 1, shape, model=model), None)
    assert isinstance(got, Refused)
    assert got.code is code
    assert not got.hold
    assert (intake.backlog.queued, intake.writes) == (0, 0)


def test_only_the_doors_verdicts_count_among_a_models_refusals() -> None:
    """A name any client chose must not grow the per-model counters."""
    intake = door(max_queued=1)
    unknown = intake.admit(T0, CLIENT, request(intake, 1, model="nope"), None)
    assert isinstance(unknown, Refused)
    assert not unknown.counted
    assert isinstance(intake.admit(T0, CLIENT, request(intake, 2), None), PendingRequest)
    full = intake.admit(T0, CLIENT, request(intake, 3), None)
    assert isinstance(full, Refused)
    assert (full.code, full.counted) == (ErrorCode.OVERLOADED, True)


def test_just_after_a_start_an_unknown_model_may_be_held() -> None:
    intake = door(register_grace_s=5.0)
    intake.started_s = T0
    got = intake.admit(T0 + 1, CLIENT, request(intake, 1, model="later"), None)
    assert isinstance(got, Refused)
    assert (got.code, got.hold) == (ErrorCode.UNAVAILABLE, True)
    assert "no worker has registered model 'later' yet" in got.message
    after = intake.admit(T0 + 6, CLIENT, request(intake, 2, model="later"), None)
    assert isinstance(after, Refused)
    assert (after.code, after.hold) == (ErrorCode.NOT_FOUND, False)


def test_a_stopping_broker_refuses_with_retry() -> None:
    intake = door()
    intake.backlog.stopping = True
    got = intake.admit(T0, CLIENT, request(intake, 1), None)
    assert isinstance(got, Refused)
    assert (got.code, got.retry) == (ErrorCode.UNAVAILABLE, True)


def test_arrivals_are_recorded_while_recording() -> None:
    intake = door()
    intake.recording = []
    intake.admit(T0, CLIENT, request(intake, 1, (2, 4)), None)
    intake.admit(T0, CLIENT, request(intake, 2, model="nope"), None)  # not an arrival
    assert intake.recording == [(T0, "m", (2, 4), 1000, 0, 8)]
