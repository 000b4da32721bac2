"""Resends (intake.py; protocol.md §6.1, §6.5): a request sent again with its client's nonce and
id is answered once, on the connection of its latest copy, and never run twice while
the broker holds it; a CANCEL drops a held or queued request (answered CANCELLED) and
does nothing else; under CURVE a request's origin is bound to its key. Every UNAVAILABLE
for a request that did not run, once the broker is told to stop, carries ``retry``
(§11).

BrokerCore driven with wire frames and an injected clock, with harness.py; at the end,
Resends built on its own from the state it reads (the book, the held requests, the stats).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from carpool.broker.backlog import Backlog
from carpool.broker.config import BatchingOverride, BrokerConfig
from carpool.broker.holding import HeldRequests
from carpool.broker.intake import Resends
from carpool.broker.replies import Outgoing
from carpool.broker.requests import ClientId, RequestBook
from carpool.broker.stats import BrokerStats
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Cancel,
    Command,
    Request,
    Submit,
    TensorMeta,
    decode_from_client,
    encode_request,
    header,
)
from carpool.common.protocol import frames as codec
from tests.unit.broker.harness import (
    C1,
    C2,
    C3,
    T0,
    W1,
    Broker,
    Msg,
    batches,
    ids,
    parse,
    to_clients,
)
from tests.unit.broker.pending import pending_request

NONCE = bytes(range(16))
OTHER = bytes(range(1, 17))
CANCEL = header(Command.CANCEL)


def served(**config: Any) -> Broker:
    """A broker with one worker of one slot: a first request runs, the next ones queue."""
    b = Broker.make(max_batch=1, max_wait_s=0.0, **config)
    b.ready(T0, W1, slots=1)
    return b


def cancel(b: Broker, now: float, rid: int, cid: bytes = C1, nonce: bytes = NONCE) -> list[Msg]:
    return b.client(now, cid, Cancel(rid, nonce).to_frames())


def answers(msgs: list[Msg]) -> list[tuple[bytes, int | None, Command]]:
    return [(m.to, m.rid, m.command) for m in to_clients(msgs)]


def test_a_copy_of_a_running_request_is_answered_once_on_its_own_connection() -> None:
    b = served()
    (batch,) = batches(b.request(T0, 7, C1, nonce=NONCE, timeout_ms=5000))
    # The client lost its connection and sends the request again from a new one.
    assert b.request(T0 + 0.1, 7, C2, nonce=NONCE, timeout_ms=5000) == []
    assert b.core.stats.resent == 1
    out, _ = b.result(T0 + 0.2, batch)
    assert answers(out) == [(C2, 7, Command.REPLY)]
    assert batches(out) == []  # it ran once
    assert b.core.book.by_origin == {}  # answered: its entry left
    # Answered, it is no longer held: a later copy is a new request, and runs.
    assert ids(batches(b.request(T0 + 0.3, 7, C3, nonce=NONCE))[0]) == [7]


def test_a_copy_of_a_queued_request_moves_its_answer_and_its_client_share() -> None:
    b = served(max_client_requests=2)
    (first,) = batches(b.request(T0, 1, C3))
    assert b.request(T0, 2, C1, nonce=NONCE, timeout_ms=5000) == []  # queued
    assert b.request(T0 + 0.1, 2, C2, nonce=NONCE, delimited=True) == []
    assert b.core.backlog.held(ClientId(C1)) == (0, 0)
    assert b.core.backlog.held(ClientId(C2))[0] == 1
    b.request(T0 + 0.1, 3, C2)  # C2's second: within its 2
    (full,) = to_clients(b.request(T0 + 0.1, 4, C2))  # C2's third
    assert full.code is ErrorCode.OVERLOADED
    assert b.core.queued == 2
    out, _ = b.result(T0 + 0.2, first)
    (second,) = batches(out)
    assert ids(second) == [2]
    (reply,) = to_clients(b.result(T0 + 0.3, second)[0])
    assert (reply.to, reply.rid, reply.command, reply.delimited) == (C2, 2, Command.REPLY, True)


def test_another_nonce_or_none_is_another_request() -> None:
    b = served()
    (batch,) = batches(b.request(T0, 7, C1, nonce=NONCE))
    assert b.request(T0, 7, C2, nonce=OTHER) == []  # queued, its own request
    assert b.request(T0, 7, C3) == []
    assert b.core.queued == 2
    assert b.core.stats.resent == 0
    out, _ = b.result(T0 + 0.1, batch)
    assert answers(out) == [(C1, 7, Command.REPLY)]
    assert ids(batches(out)[0]) == [7]  # the next one runs too


def test_a_copy_that_names_another_model_is_refused_and_the_request_goes_on() -> None:
    b = served()
    (batch,) = batches(b.request(T0, 7, C1, nonce=NONCE))
    (refused,) = to_clients(b.request(T0, 7, C2, nonce=NONCE, model="other"))
    assert (refused.to, refused.rid, refused.code) == (C2, 7, ErrorCode.INVALID_ARGUMENT)
    assert "same model" in refused.meta["message"]
    assert answers(b.result(T0 + 0.1, batch)[0]) == [(C1, 7, Command.REPLY)]


def test_a_copy_of_a_held_request_is_answered_on_its_connection_after_the_release() -> None:
    b = Broker.make(
        max_batch=4, max_wait_s=0.0, models={"m": BatchingOverride()}, register_grace_s=5.0
    )
    b.core.started_s = T0
    assert b.request(T0 + 0.1, 7, C1, nonce=NONCE, timeout_ms=3000) == []
    assert b.request(T0 + 0.2, 7, C2, nonce=NONCE, timeout_ms=3000) == []
    assert b.core.holding.count == 1  # held once
    assert b.core.stats.resent == 1
    (batch,) = batches(b.ready(T0 + 0.3, W1, slots=1))
    assert ids(batch) == [7]
    assert answers(b.result(T0 + 0.4, batch)[0]) == [(C2, 7, Command.REPLY)]
    assert b.core.holding.by_origin == {}
    assert b.core.book.by_origin == {}


def test_a_copy_of_a_held_request_moves_its_client_share() -> None:
    b = Broker.make(models={"m": BatchingOverride()}, register_grace_s=5.0, max_client_requests=1)
    b.core.started_s = T0
    assert b.request(T0 + 0.1, 7, C1, nonce=NONCE) == []
    assert b.request(T0 + 0.2, 7, C2, nonce=NONCE) == []  # the copy: C2's share now
    (refused,) = to_clients(b.request(T0 + 0.3, 8, C2))
    assert (refused.rid, refused.code) == (8, ErrorCode.UNAVAILABLE)
    assert b.request(T0 + 0.3, 9, C1) == []  # C1 holds none: held
    assert b.core.holding.count == 2


def test_a_cancel_drops_a_queued_request_and_is_not_answered_itself() -> None:
    b = served()
    (batch,) = batches(b.request(T0, 1, C1, nonce=NONCE))
    assert b.request(T0, 2, C1, nonce=NONCE) == []
    assert b.request(T0 + 0.1, 2, C2, nonce=NONCE) == []  # its latest copy came by C2
    (cancelled,) = to_clients(cancel(b, T0 + 0.2, 2, C3))
    assert (cancelled.to, cancelled.rid, cancelled.code) == (C2, 2, ErrorCode.CANCELLED)
    assert b.core.stats.cancelled == 1
    assert b.core.queued == 0
    assert b.core.book.by_origin.keys() == {(NONCE, 1)}
    # A request at a worker, one answered, an unknown one, another nonce's: nothing.
    assert cancel(b, T0 + 0.3, 1) == []
    assert cancel(b, T0 + 0.3, 2) == []
    assert cancel(b, T0 + 0.3, 99) == []
    out, _ = b.result(T0 + 0.4, batch)
    assert answers(out) == [(C1, 1, Command.REPLY)]
    assert batches(out) == []  # the cancelled one never leaves
    b.request(T0 + 0.5, 3, C1, nonce=NONCE)
    assert b.request(T0 + 0.5, 4, C1, nonce=NONCE) == []
    assert cancel(b, T0 + 0.6, 4, nonce=OTHER) == []
    assert b.core.queued == 1
    assert b.core.stats.cancelled == 1


def test_a_cancel_drops_a_held_request() -> None:
    b = Broker.make(models={"m": BatchingOverride()}, register_grace_s=5.0)
    b.core.started_s = T0
    assert b.request(T0 + 0.1, 7, C1, nonce=NONCE) == []
    (cancelled,) = to_clients(cancel(b, T0 + 0.2, 7, C2))
    assert (cancelled.to, cancelled.rid, cancelled.code) == (C1, 7, ErrorCode.CANCELLED)
    assert b.core.holding.count == 0
    assert b.core.holding.by_origin == {}
    assert b.core.next_wakeup(T0 + 0.2) is None
    assert to_clients(b.ready(T0 + 0.3, W1)) == []


def test_an_invalid_cancel_is_answered_invalid_argument() -> None:
    b = served()
    no_nonce = [CANCEL, codec.pack({"id": 5})]
    short_nonce = [CANCEL, codec.pack({"id": 6, "client": b"abc"})]
    no_id = [CANCEL, codec.pack({"client": NONCE})]
    extra = [*Cancel(8, NONCE).to_frames(), b"\x00"]
    for frames, rid in (
        (no_nonce, 5),
        (short_nonce, 6),
        (no_id, None),
        (extra, None),
        ([CANCEL], None),
    ):
        (msg,) = to_clients(b.client(T0, C1, frames))
        assert (msg.to, msg.rid, msg.code) == (C1, rid, ErrorCode.INVALID_ARGUMENT)


def test_under_curve_the_origin_is_bound_to_the_key() -> None:
    """The server sets the seam under CURVE: a client id starts with its key."""
    b = served()
    b.core.resends.key_of = lambda client: client[:1]
    alice, alice_again, mallory = b"a-conn-1", b"a-conn-2", b"m-conn-1"
    (batch,) = batches(b.request(T0, 7, alice, nonce=NONCE))
    assert b.request(T0, 8, alice, nonce=NONCE) == []
    assert b.request(T0 + 0.1, 7, mallory, nonce=NONCE) == []  # queued: its own request
    assert cancel(b, T0 + 0.1, 8, mallory) == []
    assert b.core.queued == 2
    assert b.request(T0 + 0.2, 7, alice_again, nonce=NONCE) == []
    assert b.core.stats.resent == 1
    (cancelled,) = to_clients(cancel(b, T0 + 0.3, 8, alice_again))
    assert (cancelled.to, cancelled.code) == (alice, ErrorCode.CANCELLED)
    out, _ = b.result(T0 + 0.4, batch)
    assert answers(out) == [(alice_again, 7, Command.REPLY)]
    (theirs,) = batches(out)
    assert ids(theirs) == [7]  # mallory's own request, run for mallory
    assert answers(b.result(T0 + 0.5, theirs)[0]) == [(mallory, 7, Command.REPLY)]


def test_every_unavailable_of_a_request_that_did_not_run_carries_retry_from_the_stop() -> None:
    b = served()
    assert batches(b.request(T0, 1, C1, timeout_ms=60_000))
    b.request(T0, 2, C1, timeout_ms=60_000)  # its cost unknown: kept for the grace
    assert to_clients(b._turn(T0, b.core.begin_stop(T0, T0 + 2.0))) == []
    (refused,) = to_clients(b.request(T0 + 0.1, 3, C2))
    (gone,) = to_clients(b.request(T0 + 0.1, 4, C2, model="gone"))
    assert (gone.code, refused.code) == (ErrorCode.NOT_FOUND, ErrorCode.UNAVAILABLE)
    assert refused.meta["retry"] is True
    final = to_clients([parse(o) for o in b.core.finish_stop(T0 + 2.0)])
    assert sorted((m.rid, m.code, m.meta.get("retry", False)) for m in final) == [
        (1, ErrorCode.UNAVAILABLE, False),  # at a worker: it may have run
        (2, ErrorCode.UNAVAILABLE, True),
    ]


# ---------------------------------------------------------------- Resends on its own


def _parts() -> tuple[Resends, RequestBook, BrokerStats]:
    book, stats = RequestBook(), BrokerStats()
    config = BrokerConfig(models={"m": BatchingOverride()})
    return Resends(book, HeldRequests(config, Backlog(book), stats), stats), book, stats


def _copy(rid: int, model: str = "m", nonce: bytes = NONCE) -> Request[Any]:
    submit = Submit(rid, model, 1000, (TensorMeta("x", "float32", (1, 4)),), client=nonce)
    msg = decode_from_client(encode_request(submit, [bytes(16)]))
    assert isinstance(msg, Request)
    return msg


def test_a_request_no_one_holds_is_claimed_by_its_origin() -> None:
    resends, _, stats = _parts()
    assert resends.claim(ClientId(C1), _copy(5)) == (NONCE, 5)
    resends.key_of = lambda client: b"key:" + client
    assert resends.claim(ClientId(C1), _copy(5)) == (b"key:" + C1 + NONCE, 5)
    assert stats.resent == 0


def test_a_copy_of_a_queued_request_takes_its_answer_to_the_copys_connection() -> None:
    resends, book, stats = _parts()
    held = dataclasses.replace(pending_request(1), origin=(NONCE, 5))
    book.enter(held)
    assert resends.claim(ClientId(C2), _copy(5)) == []
    assert (held.client, stats.resent) == (C2, 1)
    refused = resends.claim(ClientId(C3), _copy(5, model="other"))
    assert isinstance(refused, list)
    assert [parse(o).code for o in refused] == [ErrorCode.INVALID_ARGUMENT]
    assert held.client == C2  # the request goes on as it was


def test_a_cancel_returns_the_queued_request_it_names_and_nothing_else() -> None:
    resends, book, stats = _parts()
    held = dataclasses.replace(pending_request(1), origin=(NONCE, 5))
    book.enter(held)
    out: list[Outgoing] = []
    assert resends.cancel(ClientId(C1), Cancel(6, NONCE), out) is None
    assert resends.cancel(ClientId(C1), Cancel(5, OTHER), out) is None
    assert resends.cancel(ClientId(C1), Cancel(5, NONCE), out) is held
    assert (out, stats.cancelled) == ([], 1)
