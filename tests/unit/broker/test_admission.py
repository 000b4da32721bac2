"""admission.py: admit(), the door a valid request passes or is refused at, as a pure
function of the request and the broker's counts (no reply is built, nothing changes)."""

from __future__ import annotations

from carpool.broker.admission import (
    ADMITTED,
    FULL_UNTIL_PUMPED,
    Admitted,
    Layout,
    Refused,
    admit,
)
from carpool.broker.backlog import Backlog
from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.fleet import FleetModel
from carpool.broker.inflight import InflightTable
from carpool.broker.registry import WorkerRegistry
from carpool.broker.requests import ClientId, RequestBook
from carpool.common.errors import ErrorCode

CLIENT = ClientId(b"c1")
LAYOUT = Layout("m", ("m", (("x", "float32", (4,)),)), (2, 4), 2, None)


def door(policy: str = "fixed", **limits: int) -> tuple[BrokerConfig, Backlog, FleetModel]:
    config = BrokerConfig(batching=BatchingConfig(policy=policy), **limits)  # type: ignore[arg-type]
    registry = WorkerRegistry(liveness=config.liveness)
    return config, Backlog(RequestBook()), FleetModel(config, registry, InflightTable())


def ask(
    parts: tuple[BrokerConfig, Backlog, FleetModel],
    *,
    nbytes: int = 32,
    max_batch: int = 8,
    pumpable: bool = False,
) -> Admitted | Refused:
    return admit(LAYOUT, nbytes, 1.0, 0, max_batch, pumpable, *parts, client=CLIENT, now=0.0)


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


def test_a_full_queue_is_overloaded_with_a_hint_unless_a_pump_may_make_room() -> None:
    parts = door(max_queued=1)
    parts[1].queued = 1
    assert ask(parts, pumpable=True) is FULL_UNTIL_PUMPED
    verdict = ask(parts)
    assert isinstance(verdict, Refused)
    assert (verdict.code, verdict.retry_after_ms, verdict.shed) == (ErrorCode.OVERLOADED, 50, False)


def test_the_deadline_check_passes_while_costs_are_unknown() -> None:
    """With no fitted cost the best-case drain time is unknown (0): the door lets it in."""
    assert ask(door("carpool")) is ADMITTED
