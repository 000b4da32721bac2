"""admission.py: admit(), the door a valid request passes or is refused at, as a pure
function of the request and the broker's counts (no reply is built, nothing changes)."""

from __future__ import annotations

import dataclasses

from carpool.broker.admission import (
    ADMITTED,
    Admitted,
    Layout,
    admit,
    full,
)
from carpool.broker.backlog import Backlog
from carpool.broker.batcher import request_key
from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.fleet import FleetModel
from carpool.broker.registry import WorkerRegistry
from carpool.broker.replies import Refused
from carpool.broker.requests import ClientId, RequestBook, RequestKey, WorkerId
from carpool.common.errors import ErrorCode
from carpool.common.protocol import ModelSpec, Priority, Ready, TensorMeta
from tests.unit.broker.pending import pending_request

CLIENT = ClientId(b"c1")
LAYOUT = Layout("m", ("m", (("x", "float32", (4,)),)), (2, 4), 2, None)


def door(policy: str = "fixed", **limits: int) -> tuple[BrokerConfig, Backlog, FleetModel]:
    config = BrokerConfig(batching=BatchingConfig(policy=policy), **limits)  # type: ignore[arg-type]
    registry = WorkerRegistry(liveness=config.liveness)
    return config, Backlog(RequestBook()), FleetModel(config, registry)


def ask(
    parts: tuple[BrokerConfig, Backlog, FleetModel],
    *,
    nbytes: int = 32,
    max_batch: int = 8,
) -> Admitted | Refused:
    return admit(LAYOUT, nbytes, 1.0, 0, max_batch, *parts, client=CLIENT, now=0.0)


def test_a_request_that_fits_is_admitted_and_nothing_changes() -> None:
    parts = door()
    assert ask(parts) is ADMITTED
    assert (parts[1].queued, parts[1].queued_bytes, parts[2].rates) == (0, 0, {})


def test_a_stopping_broker_refuses_and_it_is_no_arrival() -> None:
    parts = door()
    parts[1].stopping = True
    verdict = ask(parts)
    assert isinstance(verdict, Refused)
    assert (verdict.code, verdict.arrival) == (ErrorCode.UNAVAILABLE, False)


def test_a_request_larger_than_any_batch_is_invalid_and_no_arrival() -> None:
    verdict = ask(door(), max_batch=1)
    assert isinstance(verdict, Refused)
    assert (verdict.code, verdict.arrival) == (ErrorCode.INVALID_ARGUMENT, False)
    assert "at most 1 per batch" in verdict.message


def test_a_payload_larger_than_the_queue_is_invalid() -> None:
    verdict = ask(door(max_queued_mib=1), nbytes=(1 << 20) + 1)
    assert isinstance(verdict, Refused)
    assert (verdict.code, verdict.arrival) == (ErrorCode.INVALID_ARGUMENT, True)


def test_a_full_queue_is_overloaded_with_a_hint() -> None:
    """Full by count, or by bytes: what the intake reads (``full``) before it forms the
    turn's batches to make room, and the door's refusal when none was made."""
    parts = door(max_queued=1, max_queued_mib=1)
    assert not full(parts[0], parts[1], 1 << 20)
    assert full(parts[0], parts[1], (1 << 20) + 1)
    parts[1].queued = 1
    assert full(parts[0], parts[1], 0)
    verdict = ask(parts)
    assert isinstance(verdict, Refused)
    assert (verdict.code, verdict.retry_after_ms, verdict.shed) == (ErrorCode.OVERLOADED, 50, False)


def test_the_deadline_check_passes_while_costs_are_unknown() -> None:
    """With no fitted cost the best-case drain time is unknown (0): the door lets it in."""
    assert ask(door("carpool")) is ADMITTED


def _shapes_door(max_batch: int = 8) -> tuple[BrokerConfig, Backlog, FleetModel]:
    """The carpool door of a model with a dynamic item dim, one idle worker of batches of
    ``max_batch``, whose cost for shape [1, 0] is fitted at 40 ms + 4 ms a sample."""
    config = BrokerConfig(batching=BatchingConfig(policy="carpool", max_batch=max_batch))
    registry = WorkerRegistry(liveness=config.liveness)
    fleet = FleetModel(config, registry)
    x, y = TensorMeta("x", "float32", (-1, -1)), TensorMeta("y", "float32", (-1, 2))
    ready = Ready("w", 2, (ModelSpec("m", (x,), (y,), max_batch),))
    lane = fleet.lane("m", max_batch, ())
    registry.add(0.0, WorkerId(b"w"), ready, 1.0, {"m": lane})
    for n in (1, max_batch):
        lane.observe(_key(0), n, 0.040 + 0.004 * n)
    return config, Backlog(RequestBook(), fleet.batch_unit), fleet


def _key(width: int) -> RequestKey:
    return request_key("m", (TensorMeta("x", "float32", (1, width)),))


def _queued(backlog: Backlog, seq: int, width: int, priority: Priority) -> None:
    req = dataclasses.replace(
        pending_request(seq, priority=priority), key=_key(width), deadline_s=10.0
    )
    backlog.add(req)


def test_the_door_counts_other_shapes_queued_ahead_as_batches_of_their_own() -> None:
    """Seven requests of seven other shapes wait: they form seven batches (shapes never
    share one), each charged as a full batch of this shape (72 ms), so a request of shape
    [1, 0] is predicted done in 7 x 72 + 44 ms = 548 ms; stretched by 2% and held against
    90% of its timeout, 0.6 s is too little and 0.63 s enough. (Counted as 7 samples
    riding in its own full batch, it was predicted done in 72 ms.) Bulk requests of other
    shapes count for a bulk request only."""
    parts = _shapes_door()
    backlog = parts[1]
    for width in range(1, 8):
        _queued(backlog, width, width, Priority.INTERACTIVE)
    _queued(backlog, 8, 8, Priority.BULK)
    layout = Layout("m", _key(0), (1, 0), 1, None)

    def verdict(timeout_s: float, priority: Priority) -> Admitted | Refused:
        return admit(layout, 4, timeout_s, priority, 8, *parts, client=CLIENT, now=0.0)

    refused = verdict(0.6, Priority.INTERACTIVE)
    assert isinstance(refused, Refused)
    assert (refused.code, refused.shed) == (ErrorCode.DEADLINE_EXCEEDED, True)
    assert "predicted completion in 548 ms" in refused.message
    assert verdict(0.63, Priority.INTERACTIVE) is ADMITTED
    # A bulk request waits behind the bulk one too: 8 batches, 620 ms.
    bulk = verdict(0.63, Priority.BULK)
    assert isinstance(bulk, Refused)
    assert "predicted completion in 620 ms" in bulk.message
