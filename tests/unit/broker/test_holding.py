"""holding.py: in the grace window after a start, requests for an expected model no worker
has registered yet wait at the door until a READY registers it (then they are admitted as
usual, in arrival order), their deadline nears, the window ends or the broker stops; each
gets exactly one reply. Names the broker does not expect are answered as before.

BrokerCore driven with wire frames and an injected clock, with harness.py;
the trace reading on files in ``tmp_path``; at the end, HeldRequests built on its own
from what it reads (the configuration, the backlog, the stats).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from carpool.broker.backlog import Backlog
from carpool.broker.config import BatchingOverride, BrokerConfig
from carpool.broker.holding import HOLD_LEAD_S, HeldRequests
from carpool.broker.replies import Outgoing
from carpool.broker.requests import ClientId, RequestBook
from carpool.broker.stats import BrokerStats
from carpool.broker.trace import MAX_RECORDED_MODELS, recorded_models
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Command,
    Request,
    Submit,
    TensorMeta,
    decode_from_client,
    encode_request,
)
from tests.unit.broker.harness import (
    C1,
    C2,
    C3,
    F32,
    SPEC,
    T0,
    W1,
    Broker,
    Msg,
    batches,
    ids,
    model_spec,
    only,
    parse,
    ready_frames,
    to_clients,
)

GRACE_S = 5.0


def restarted(**config: Any) -> Broker:
    """A broker just started at T0 whose configuration names model ``m``."""
    config.setdefault("models", {"m": BatchingOverride()})
    config.setdefault("register_grace_s", GRACE_S)
    b = Broker.make(max_batch=4, max_wait_s=0.0, **config)
    b.core.started_s = T0
    return b


def codes(msgs: list[Msg]) -> list[tuple[int | None, ErrorCode]]:
    return [(m.rid, m.code) for m in to_clients(msgs)]


def test_a_request_held_at_the_door_is_served_when_its_worker_registers() -> None:
    b = restarted()
    assert b.request(T0 + 0.1, 1, timeout_ms=1000) == []
    assert b.request(T0 + 0.2, 2, C2, simple=True) == []
    assert b.request(T0 + 0.3, 3, delimited=True) == []
    assert b.core.holding.count == 3
    assert b.core.queued == 0  # not admitted: no spec could validate them yet
    out = b.ready(T0 + 0.4, W1, slots=4)
    assert to_clients(out) == []
    sent = batches(out)
    assert [rid for batch in sent for rid in ids(batch)] == [1, 2, 3]  # arrival order
    assert b.core.holding.count == 0
    # Each keeps the deadline it had on arrival: the hold ate into its budget.
    assert b.core.backlog.deadlines.earliest() == pytest.approx(T0 + 1.1, abs=0.002)
    replies = [m for batch in sent for m in to_clients(b.result(T0 + 0.45, batch)[0])]
    assert sorted((m.to, m.rid, m.command) for m in replies) == [
        (C1, 1, Command.REPLY),
        (C1, 3, Command.REPLY),
        (C2, 2, Command.REPLY),
    ]
    assert {m.rid: (m.simple, m.delimited) for m in replies} == {
        1: (False, False),
        2: (True, False),
        3: (False, True),
    }


def test_a_held_request_is_answered_unavailable_its_lead_before_its_deadline() -> None:
    b = restarted()
    assert b.request(T0 + 0.1, 1, timeout_ms=300) == []
    due_s = T0 + 0.1 + 0.3 - HOLD_LEAD_S
    assert b.core.next_wakeup(T0 + 0.1) == pytest.approx(due_s)
    assert b.tick(due_s - 0.001) == []
    (late,) = to_clients(b.tick(due_s))
    assert (late.rid, late.code) == (1, ErrorCode.UNAVAILABLE)
    assert "no worker has registered model 'm' yet" in late.meta["message"]
    assert b.core.next_wakeup(due_s) is None
    out = b.ready(due_s + 0.01, W1)  # too late for it: nothing is sent twice
    assert to_clients(out) == []
    assert batches(out) == []


def test_a_ready_after_a_held_request_fell_due_answers_it_instead_of_admitting_it() -> None:
    """Between the expiry and the tick that would answer it, a READY arrives: the request
    is answered UNAVAILABLE (once), not admitted with no budget left."""
    b = restarted()
    assert b.request(T0 + 0.1, 1, timeout_ms=300) == []
    assert b.request(T0 + 0.1, 2, timeout_ms=2000) == []
    out = b.worker(T0 + 0.36, W1, ready_frames(SPEC, name="w1", slots=1))
    assert codes(out) == [(1, ErrorCode.UNAVAILABLE)]
    assert [ids(batch) for batch in batches(out)] == [[2]]


def test_held_requests_are_answered_when_the_grace_window_ends() -> None:
    b = restarted()
    assert b.request(T0 + 4.0, 1, timeout_ms=None) == []  # the default budget: 10 s
    assert b.core.next_wakeup(T0 + 4.0) == pytest.approx(T0 + GRACE_S)
    assert codes(b.tick(T0 + GRACE_S)) == [(1, ErrorCode.UNAVAILABLE)]
    # After the window a model no worker registered is NOT_FOUND, expected or not.
    assert codes(b.request(T0 + GRACE_S, 2)) == [(2, ErrorCode.NOT_FOUND)]


def test_names_the_broker_does_not_expect_are_answered_at_once() -> None:
    b = restarted()
    assert codes(b.request(T0 + 0.1, 1, model="other")) == [(1, ErrorCode.UNAVAILABLE)]
    assert b.core.holding.count == 0
    b.core.expect(["other"])  # a model of the broker's last trace
    assert b.request(T0 + 0.2, 2, model="other") == []
    assert b.request(T0 + 0.2, 3) == []  # the configuration's models stay expected
    assert b.core.holding.count == 2
    assert codes(b.request(T0 + 0.3, 4, model="random")) == [(4, ErrorCode.UNAVAILABLE)]
    assert codes(b.tick(T0 + GRACE_S)) == [(2, ErrorCode.UNAVAILABLE), (3, ErrorCode.UNAVAILABLE)]
    assert codes(b.request(T0 + GRACE_S + 1, 5, model="random")) == [(5, ErrorCode.NOT_FOUND)]


def test_no_request_is_held_without_a_grace_window_or_with_too_little_budget() -> None:
    b = restarted(register_grace_s=0.0)
    assert codes(b.request(T0, 1)) == [(1, ErrorCode.NOT_FOUND)]
    b = restarted()
    short_ms = int(1000 * HOLD_LEAD_S)
    assert codes(b.request(T0 + 0.1, 2, timeout_ms=short_ms)) == [(2, ErrorCode.UNAVAILABLE)]
    # A core not told when it started (the simulator, tests) holds nothing.
    plain = Broker.make(models={"m": BatchingOverride()})
    assert codes(plain.request(T0, 3)) == [(3, ErrorCode.NOT_FOUND)]


def test_held_requests_count_against_the_queue_limits() -> None:
    b = restarted(max_queued=3, max_client_requests=2)
    assert b.request(T0 + 0.1, 1) == []
    assert b.request(T0 + 0.1, 2) == []
    assert codes(b.request(T0 + 0.1, 3)) == [(3, ErrorCode.UNAVAILABLE)]  # C1's share
    assert b.request(T0 + 0.1, 4, C2) == []
    assert codes(b.request(T0 + 0.1, 5, C2)) == [(5, ErrorCode.UNAVAILABLE)]  # the queue's
    assert b.core.holding.count == 3
    # And their payload bytes: 40,000 x 4 float32 is 640 kB, two of them over 1 MiB.
    b = restarted(max_queued_mib=1)
    assert b.request(T0 + 0.1, 6, n=40_000) == []
    assert codes(b.request(T0 + 0.1, 7, C2, n=40_000)) == [(7, ErrorCode.UNAVAILABLE)]
    b = restarted(max_client_mib=1)
    assert b.request(T0 + 0.1, 8, n=40_000) == []
    assert codes(b.request(T0 + 0.1, 9, n=40_000)) == [(9, ErrorCode.UNAVAILABLE)]
    assert b.request(T0 + 0.1, 10, C2, n=40_000) == []


def test_queued_requests_leave_less_room_to_hold() -> None:
    other = model_spec("other")
    b = restarted(max_queued=2)
    b.ready(T0, W1, other, slots=1)
    assert len(batches(b.request(T0 + 0.1, 1, model="other"))) == 1
    assert b.request(T0 + 0.1, 2, model="other") == []  # queued behind the first
    assert b.request(T0 + 0.1, 3) == []  # held: 1 queued + 1 held
    assert codes(b.request(T0 + 0.1, 4)) == [(4, ErrorCode.UNAVAILABLE)]


def test_a_held_request_that_does_not_fit_the_registered_spec_is_answered_on_release() -> None:
    b = restarted()
    assert b.request(T0 + 0.1, 1, item=(5,)) == []  # the model takes items of 4
    assert b.request(T0 + 0.1, 2) == []
    out = b.ready(T0 + 0.2, W1, slots=2)
    assert codes(out) == [(1, ErrorCode.INVALID_ARGUMENT)]
    assert [rid for batch in batches(out) for rid in ids(batch)] == [2]


def test_a_ready_for_other_models_leaves_the_held_requests_waiting() -> None:
    b = restarted()
    b.core.expect(["later"])
    assert b.request(T0 + 0.1, 1, model="later") == []
    assert b.request(T0 + 0.1, 2) == []
    out = b.ready(T0 + 0.2, W1, slots=2)
    assert [rid for batch in batches(out) for rid in ids(batch)] == [2]
    assert b.core.holding.count == 1


def test_a_stopping_broker_answers_every_held_request_once() -> None:
    b = restarted()
    assert b.request(T0 + 0.1, 1) == []
    assert b.request(T0 + 0.2, 2, C2) == []
    msgs = [parse(o) for o in b.core.begin_stop(T0 + 0.3)]
    assert codes(msgs) == [(1, ErrorCode.UNAVAILABLE), (2, ErrorCode.UNAVAILABLE)]
    assert all("stopping" in m.meta["message"] for m in to_clients(msgs))
    assert all(m.meta.get("retry") is True for m in to_clients(msgs))
    assert b.core.holding.count == 0
    assert b.core.next_wakeup(T0 + 0.3) is None
    # Nothing more is held while stopping, and nothing is answered twice.
    (late,) = to_clients(b.request(T0 + 0.4, 3))
    assert (late.rid, late.code, late.meta.get("retry")) == (3, ErrorCode.UNAVAILABLE, True)
    assert to_clients([parse(o) for o in b.core.finish_stop(T0 + 0.5)]) == []
    assert only(b.tick(T0 + 10), Command.ERROR) == []


# --------------------------------------------------------------------------- the trace


def _trace(path: Path, models: list[str], extra: str = "") -> None:
    lines = [json.dumps({"t_s": i, "model": m, "shape": [1, 4]}) for i, m in enumerate(models)]
    path.write_text(extra + "\n".join(lines) + "\n")


def test_the_models_of_the_last_trace_are_read_newest_first(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    _trace(trace, ["a", "b", "a", "c"], extra='not json\n{"model": 7}\n[1]\n')
    assert recorded_models(str(trace)) == ["c", "a", "b"]
    assert recorded_models(str(tmp_path / "none.jsonl")) == []
    assert recorded_models(str(tmp_path)) == []  # not a regular file


def test_the_trace_read_for_models_is_bounded(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    names = [f"m{i}" for i in range(MAX_RECORDED_MODELS + 10)]
    _trace(trace, [*names, "x" * 300])  # (a name longer than the protocol allows)
    got = recorded_models(str(trace))
    assert len(got) == MAX_RECORDED_MODELS
    assert got[0] == names[-1]


# ---------------------------------------------------------------- HeldRequests on its own


def _held(**config: Any) -> HeldRequests:
    """The holding area of a broker that started at T0 and expects model "m"."""
    cfg = BrokerConfig(models={"m": BatchingOverride()}, register_grace_s=GRACE_S, **config)
    holding = HeldRequests(cfg, Backlog(RequestBook()), BrokerStats())
    holding.until_s = T0 + GRACE_S
    return holding


def _request(rid: int, model: str = "m", nonce: bytes | None = None) -> Request[Any]:
    submit = Submit(rid, model, 1000, (TensorMeta("x", F32, (1, 4)),), client=nonce)
    msg = decode_from_client(encode_request(submit, [bytes(16)]))
    assert isinstance(msg, Request)
    return msg


def test_an_expected_model_is_held_until_released_in_arrival_order() -> None:
    holding = _held()
    assert holding.hold(T0, ClientId(C1), _request(1))
    assert holding.hold(T0, ClientId(C2), _request(2))
    assert not holding.hold(T0, ClientId(C1), _request(3, model="other"))  # not expected
    assert (holding.count, holding.nbytes) == (2, 32)
    released = holding.release("m")
    assert [(h.client, h.request.request_id) for h in released] == [(C1, 1), (C2, 2)]
    assert (holding.count, holding.nbytes, holding.next_expiry_s()) == (0, 0, None)


def test_a_held_request_is_answered_once_at_its_expiry_its_cancel_or_the_stop() -> None:
    holding = _held()
    nonce = bytes(range(16))
    for rid in (1, 2, 3):
        holding.hold(T0, ClientId(C1), _request(rid, nonce=nonce), (nonce, rid))
    out: list[Outgoing] = []
    assert holding.cancel((nonce, 2), out)
    assert not holding.cancel((nonce, 2), out)
    holding.on_tick(T0 + 1.0 - HOLD_LEAD_S, out)  # request 1's (and 3's) budget is spent
    holding.stop(out, 7)
    answers = [parse(o) for o in out]
    assert [(m.rid, m.code) for m in answers] == [
        (2, ErrorCode.CANCELLED),
        (1, ErrorCode.UNAVAILABLE),
        (3, ErrorCode.UNAVAILABLE),
    ]
    assert holding.count == 0
    assert holding.by_origin == {}


def test_the_holding_area_keeps_to_the_queue_limits() -> None:
    holding = _held(max_queued=2, max_client_requests=1)
    assert holding.hold(T0, ClientId(C1), _request(1))
    assert not holding.hold(T0, ClientId(C1), _request(2))  # its client's share
    assert holding.hold(T0, ClientId(C2), _request(3))
    assert not holding.hold(T0, ClientId(C3), _request(4))  # the queue's
    assert not holding.hold(T0 + GRACE_S, ClientId(C3), _request(5))  # the window ended
