"""client/resend.py through ClientCore: which requests are sent again after a lost
connection or an UNAVAILABLE with retry, with what budget, and what a cancel does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool.client.core import ClientCore
from carpool.client.resend import (
    NEXT_STAGE,
    UNKNOWN_LATENCY_S,
    Event,
    Kept,
    Stage,
)
from carpool.client.results import InferResult
from carpool.common.errors import Cancelled, ErrorCode, RequestError, Unavailable
from carpool.common.protocol import (
    CLIENT_NONCE_BYTES,
    Cancel,
    Command,
    ErrorReply,
    ReplyMeta,
    Submit,
    TensorMeta,
    decode_meta,
    decode_submit,
    encode_error,
    encode_reply,
    parse_header,
)
from carpool.common.protocol import frames as codec

T0 = 100.0
X = np.ones((1, 4), np.float32)


def submit_of(frames: list[Any]) -> Submit:
    assert parse_header(frames[0]) is Command.REQUEST
    return decode_submit(decode_meta(frames[1]))


def reply(rid: int) -> list[Any]:
    meta = ReplyMeta(rid, (TensorMeta("y", "float32", (1, 4)),))
    return encode_reply(meta, [X.tobytes()], simple=False)


def stopping(rid: int, *, retry: bool = True) -> list[Any]:
    return encode_error(ErrorReply(rid, ErrorCode.UNAVAILABLE, "stopping", retry=retry))


def learnt(core: ClientCore, latency_s: float, model: str = "m") -> None:
    """Teach the core a latency for ``model``: one request answered after it."""
    rid, _ = core.request(T0, model, {"x": X}, 5.0)
    got_rid, result = core.on_reply(reply(rid), T0 + latency_s)
    assert got_rid == rid
    assert isinstance(result, InferResult)


def test_every_request_carries_the_clients_own_nonce() -> None:
    a, b = ClientCore(), ClientCore()
    nonces = {submit_of(a.request(T0, "m", {"x": X})[1]).client for _ in range(3)}
    assert nonces == {a.resend.nonce}
    assert len(a.resend.nonce) == CLIENT_NONCE_BYTES
    assert a.resend.nonce != b.resend.nonce


def test_a_lost_connection_queues_the_request_again_with_what_remains_of_its_budget() -> None:
    core = ClientCore()
    rid, frames = core.request(T0, "m", {"x": X}, 2.0)
    assert core.connection_lost(T0 + 0.5) == []
    assert core.lost_connections == 1
    again = core.outgoing(T0 + 0.75)
    assert again is not None
    first, second = submit_of(frames), submit_of(again)
    assert (second.request_id, second.client, second.model) == (rid, first.client, "m")
    assert second.timeout_ms == 1250  # what remains of 2 s at 0.75 s
    assert bytes(again[2]) == bytes(frames[2])
    core.took()
    assert core.outgoing(T0 + 0.75) is None
    assert core.resends == 1
    assert core.on_reply(reply(rid), T0 + 1.0)[0] == rid  # answered, once
    assert core.on_reply(reply(rid), T0 + 1.0)[0] is None
    assert core.late_replies == 1
    assert not core.resend.kept


def test_the_copy_kept_is_not_the_callers_buffer() -> None:
    core = ClientCore()
    small, large = np.zeros((1, 4), np.float32), np.zeros((1, 32768), np.float32)
    _rid, _ = core.request(T0, "m", {"a": small, "b": large}, 2.0)
    small[:] = 7  # a camera loop refills its buffers after submit()
    large[:] = 7
    core.connection_lost(T0 + 0.1)
    again = core.outgoing(T0 + 0.1)
    assert again is not None
    assert not np.frombuffer(memoryview(again[2]), np.float32).any()
    assert not np.frombuffer(memoryview(again[3]), np.float32).any()


def test_with_too_little_budget_left_a_request_fails_at_once_when_the_connection_is_lost() -> None:
    core = ClientCore()
    # No latency known yet: the floor.
    short, _ = core.request(T0, "m", {"x": X}, UNKNOWN_LATENCY_S * 0.6)
    failed = core.connection_lost(T0)
    assert [rid for rid, _ in failed] == [short]
    assert isinstance(failed[0][1], Unavailable)
    assert "connection to the broker closed" in str(failed[0][1])
    assert short not in core.pending
    assert core.outgoing(T0) is None
    # With a latency seen for the model: a budget below it.
    learnt(core, 0.3)
    assert core.resend.needed_s("m") == pytest.approx(0.3)
    slow, _ = core.request(T0, "m", {"x": X}, 0.25)
    kept, _ = core.request(T0, "m", {"x": X}, 0.5)
    failed = core.connection_lost(T0 + 0.01)
    assert [rid for rid, _ in failed] == [slow]
    assert kept in core.pending
    assert core.outgoing(T0 + 0.01) is not None


def test_a_request_waiting_for_the_socket_fails_when_its_budget_gets_too_small() -> None:
    core = ClientCore()
    rid, _ = core.request(T0, "m", {"x": X}, 1.0)
    core.connection_lost(T0 + 0.1)
    give_up = T0 + 1.0 - UNKNOWN_LATENCY_S
    assert core.next_deadline() == pytest.approx(give_up)
    assert core.expire(give_up - 0.001) == []
    assert core.outgoing(give_up) is None  # never sent that late
    failed = core.expire(give_up)
    assert [r for r, _ in failed] == [rid]
    assert isinstance(failed[0][1], Unavailable)
    assert rid not in core.pending
    assert not core.resend.kept


def test_the_first_unavailable_with_retry_leaves_the_connection_for_a_new_one() -> None:
    core = ClientCore()
    rid, frames = core.request(T0, "m", {"x": X}, 2.0)
    other, _ = core.request(T0, "m", {"x": X}, 2.0)
    got, error = core.on_reply(stopping(rid), T0 + 0.1)
    assert got is None
    assert isinstance(error, Unavailable)
    assert rid in core.pending
    assert core.resend.kept[rid].stage is Stage.QUEUED
    assert core.leaving
    assert core.cancel(other) is None  # asked for while leaving: nothing goes out
    assert core.outgoing(T0 + 0.1) is None  # not on the connection of the broker that refused it
    assert core.switched(T0 + 0.2) == []
    assert (core.leaving, core.retiring, core.switches) == (False, True, 1)
    again = core.outgoing(T0 + 0.4)
    assert again is not None
    assert submit_of(again).request_id == rid
    assert submit_of(again).client == submit_of(frames).client
    assert submit_of(again).timeout_ms == 1600
    assert bytes(again[2]) == bytes(frames[2])
    core.took()
    assert core.outgoing(T0 + 0.4) is None  # (no CANCEL for the one on the old connection)
    assert core.on_reply(reply(rid), T0 + 0.5)[0] == rid
    assert core.lost_connections == 0


def test_answers_on_the_retiring_connection_still_settle_and_end_its_retirement() -> None:
    core = ClientCore()
    refused, _ = core.request(T0, "m", {"x": X}, 2.0)
    running, _ = core.request(T0, "m", {"x": X}, 2.0)
    queued, _ = core.request(T0, "m", {"x": X}, 2.0)
    core.on_reply(stopping(refused), T0 + 0.1)
    core.switched(T0 + 0.1)
    assert core.resend.retiring == 0
    assert core.resend.epoch == 1
    # The new connection takes the refused one, and a new request.
    assert core.outgoing(T0 + 0.1) is not None
    core.took()
    fresh, _ = core.request(T0 + 0.2, "m", {"x": X}, 2.0)
    # The old connection answers what it ran within its grace...
    got, result = core.on_reply(reply(running), T0 + 0.3)
    assert got == running
    assert isinstance(result, InferResult)
    assert core.retiring
    # ...and refuses the rest: sent again on the new one, without leaving it.
    assert core.on_reply(stopping(queued), T0 + 0.4) == (None, core.resend.kept[queued].refusal)
    assert not core.leaving
    assert not core.retiring  # nothing more is awaited there: the twin closes it
    again = core.outgoing(T0 + 0.4)
    assert again is not None
    assert submit_of(again).request_id == queued
    core.took()
    assert {rid: k.epoch for rid, k in core.resend.kept.items()} == {
        refused: 1,
        queued: 1,
        fresh: 1,
    }
    assert core.resends == 2


def test_a_retiring_connection_lost_sends_its_requests_again_on_the_current_one() -> None:
    core = ClientCore()
    learnt(core, 0.3)
    refused, _ = core.request(T0, "m", {"x": X}, 2.0)
    waiting_long, _ = core.request(T0, "m", {"x": X}, 2.0)
    waiting_short, _ = core.request(T0, "m", {"x": X}, 0.5)
    core.on_reply(stopping(refused), T0 + 0.1)
    core.switched(T0 + 0.1)
    assert core.outgoing(T0 + 0.1) is not None
    core.took()
    failed = core.retiring_lost(T0 + 0.25)
    assert [rid for rid, _ in failed] == [waiting_short]  # 0.25 s left, 0.3 s needed
    assert "connection to the broker closed" in str(failed[0][1])
    assert (core.retiring, core.lost_connections) == (False, 1)
    again = core.outgoing(T0 + 0.3)
    assert again is not None
    assert submit_of(again).request_id == waiting_long
    assert submit_of(again).timeout_ms == 1700
    core.took()
    assert core.outgoing(T0 + 0.3) is None
    # The current connection is untouched: the refused one, sent on it, still waits there.
    assert core.resend.kept[refused].stage is Stage.SENT
    assert core.retiring_lost(T0 + 0.4) == []  # (nothing retires now: not counted)
    assert core.lost_connections == 1


def test_the_current_connection_lost_leaves_the_retiring_ones_requests_where_they_are() -> None:
    core = ClientCore()
    refused, _ = core.request(T0, "m", {"x": X}, 2.0)
    running, _ = core.request(T0, "m", {"x": X}, 2.0)
    core.on_reply(stopping(refused), T0 + 0.1)
    core.switched(T0 + 0.1)
    assert core.outgoing(T0 + 0.1) is not None
    core.took()
    assert core.connection_lost(T0 + 0.2) == []
    assert core.resend.epoch == 2
    assert not core.resend.on_trial  # (a reopened socket: not on trial)
    again = core.outgoing(T0 + 0.2)
    assert again is not None
    assert submit_of(again).request_id == refused
    core.took()
    assert core.outgoing(T0 + 0.2) is None
    assert core.retiring
    assert core.on_reply(reply(running), T0 + 0.3)[0] == running
    assert not core.retiring


def test_a_cancel_of_a_request_on_the_retiring_connection_sends_nothing() -> None:
    core = ClientCore()
    refused, _ = core.request(T0, "m", {"x": X}, 2.0)
    ran, _ = core.request(T0, "m", {"x": X}, 2.0)
    turned_away, _ = core.request(T0, "m", {"x": X}, 2.0)
    dropped, _ = core.request(T0, "m", {"x": X}, 2.0)
    assert core.cancel(dropped) is None  # its CANCEL, asked for on the current connection...
    core.on_reply(stopping(refused), T0 + 0.1)
    core.switched(T0 + 0.1)
    for rid in (ran, turned_away):
        assert core.cancel(rid) is None
    again = core.outgoing(T0 + 0.1)
    assert again is not None
    assert parse_header(again[0]) is Command.REQUEST  # ...not sent on the new one either
    core.took()
    assert core.outgoing(T0 + 0.1) is None
    assert core.resend.cancels == 0
    # The stopping broker ran one: its result is its answer.
    got, result = core.on_reply(reply(ran), T0 + 0.2)
    assert (got, type(result)) == (ran, InferResult)
    # It refuses another: that one ran nowhere, and is not sent again.
    got, error = core.on_reply(stopping(turned_away), T0 + 0.3)
    assert got == turned_away
    assert isinstance(error, Cancelled)
    assert not core.leaving
    # The connection closes before it answers the last.
    failed = core.retiring_lost(T0 + 0.4)
    assert [rid for rid, _ in failed] == [dropped]
    assert isinstance(failed[0][1], Cancelled)
    assert core.outgoing(T0 + 0.4) is None
    assert set(core.pending) == {refused}


def test_a_cancelled_request_refused_with_retry_is_answered_cancelled() -> None:
    core = ClientCore()
    rid, _ = core.request(T0, "m", {"x": X}, 2.0)
    assert core.cancel(rid) is None
    assert core.outgoing(T0) is not None  # its CANCEL
    core.took()
    got, error = core.on_reply(stopping(rid), T0 + 0.1)  # the broker stopped first
    assert got == rid
    assert isinstance(error, Cancelled)  # it ran nowhere, and is not sent again
    assert core.leaving  # (that broker stops all the same)
    assert not core.pending


def test_a_refusal_on_a_connection_on_trial_parks_the_request_until_that_one_closes() -> None:
    """A broker that admits new connections while it stops answers the new one as it did
    the old: the client leaves no connection on trial, so it does not open a socket and
    send every request again each round trip until that broker closes."""
    core = ClientCore()
    first, _ = core.request(T0, "m", {"x": X}, 2.0)
    core.on_reply(stopping(first), T0 + 0.1)
    core.switched(T0 + 0.1)
    assert core.resend.on_trial
    assert core.outgoing(T0 + 0.1) is not None
    core.took()
    second, _ = core.request(T0 + 0.2, "m", {"x": X}, 2.0)
    for rid in (first, second):
        assert core.on_reply(stopping(rid), T0 + 0.3)[0] is None
        assert core.resend.kept[rid].stage is Stage.PARKED
    assert not core.leaving
    assert core.outgoing(T0 + 0.3) is None
    assert core.switches == 1
    assert core.connection_lost(T0 + 0.5) == []  # that broker closed: on the next one
    sent = []
    while (again := core.outgoing(T0 + 0.6)) is not None:
        sent.append(submit_of(again).request_id)
        core.took()
    assert sent == [first, second]


def test_an_answer_ends_the_trial_and_a_later_refusal_leaves_that_connection_too() -> None:
    core = ClientCore()
    first, _ = core.request(T0, "m", {"x": X}, 5.0)
    core.on_reply(stopping(first), T0 + 0.1)
    core.switched(T0 + 0.1)
    parked, _ = core.request(T0 + 0.1, "m", {"x": X}, 5.0)
    core.on_reply(stopping(parked), T0 + 0.2)  # on trial: parked
    answered, _ = core.request(T0 + 0.2, "m", {"x": X}, 5.0)
    assert core.on_reply(reply(answered), T0 + 0.3)[0] == answered
    assert not core.resend.on_trial  # a broker that runs requests: not the stopping one
    assert core.resend.kept[parked].stage is Stage.PARKED
    assert core.outgoing(T0 + 0.3) is not None  # (the first, sent again)
    core.took()
    core.on_reply(stopping(first), T0 + 0.4)  # this broker stops too
    assert core.leaving
    assert core.switched(T0 + 0.4) == []
    sent = []
    while (again := core.outgoing(T0 + 0.5)) is not None:
        sent.append(submit_of(again).request_id)
        core.took()
    assert sent == [first, parked]  # the parked one goes on the new connection too
    assert core.switches == 2


def test_a_second_switch_drops_the_retiring_connection_and_sends_its_requests_again() -> None:
    core = ClientCore()
    first, _ = core.request(T0, "m", {"x": X}, 5.0)
    on_oldest, _ = core.request(T0, "m", {"x": X}, 5.0)
    cancelled, _ = core.request(T0, "m", {"x": X}, 5.0)
    core.on_reply(stopping(first), T0 + 0.1)
    core.switched(T0 + 0.1)
    core.cancel(cancelled)  # on the retiring connection: no CANCEL
    assert core.outgoing(T0 + 0.1) is not None
    core.took()
    answered, _ = core.request(T0 + 0.1, "m", {"x": X}, 5.0)
    core.on_reply(reply(answered), T0 + 0.2)  # the trial ends
    on_middle, _ = core.request(T0 + 0.2, "m", {"x": X}, 5.0)
    core.on_reply(stopping(first), T0 + 0.3)  # a second broker stops while one retires
    assert core.leaving
    failed = core.switched(T0 + 0.3)
    assert [(rid, type(error)) for rid, error in failed] == [(cancelled, Cancelled)]
    assert core.resend.retiring == 1  # the middle one retires now
    sent = []
    while (again := core.outgoing(T0 + 0.4)) is not None:
        sent.append(submit_of(again).request_id)
        core.took()
    assert sent == [first, on_oldest]
    assert core.resend.kept[on_middle].epoch == 1
    assert core.on_reply(reply(on_middle), T0 + 0.5)[0] == on_middle
    assert not core.retiring
    assert core.lost_connections == 0


def test_a_request_on_the_retiring_connection_past_its_local_deadline_ends_the_retirement() -> None:
    core = ClientCore(grace_s=0.5)
    refused, _ = core.request(T0, "m", {"x": X}, 5.0)
    slow, _ = core.request(T0, "m", {"x": X}, 1.0)
    core.on_reply(stopping(refused), T0 + 0.1)
    core.switched(T0 + 0.1)
    assert core.retiring
    failed = core.expire(T0 + 1.5)
    assert [rid for rid, _ in failed] == [slow]
    assert "no reply from the broker" in str(failed[0][1])
    assert not core.retiring


def test_a_refusal_with_too_little_budget_still_leaves_the_connection() -> None:
    core = ClientCore()
    rid, _ = core.request(T0, "m", {"x": X}, 1.0)
    got, error = core.on_reply(stopping(rid), T0 + 1.0 - UNKNOWN_LATENCY_S / 2)
    assert got == rid
    assert str(error) == "stopping"
    assert core.leaving  # (that broker is stopping, whatever becomes of this request)
    assert core.switched(T0 + 1.0) == []
    assert not core.retiring


def test_unavailable_without_retry_or_with_too_little_budget_is_the_answer() -> None:
    core = ClientCore()
    plain, _ = core.request(T0, "m", {"x": X}, 2.0)
    assert core.on_reply(stopping(plain, retry=False), T0)[0] == plain
    short, _ = core.request(T0, "m", {"x": X}, 2.0)
    got, error = core.on_reply(stopping(short), T0 + 2.0 - UNKNOWN_LATENCY_S / 2)
    assert got == short
    assert isinstance(error, Unavailable)
    assert not core.pending


def test_a_refused_request_whose_budget_runs_out_gets_the_brokers_answer() -> None:
    core = ClientCore()
    rid, _ = core.request(T0, "m", {"x": X}, 1.0)
    core.on_reply(stopping(rid), T0 + 0.1)
    failed = core.expire(T0 + 1.0)
    assert [r for r, _ in failed] == [rid]
    assert str(failed[0][1]) == "stopping"
    # And the same once the connection was lost but the socket never took it.
    rid, _ = core.request(T0, "m", {"x": X}, 1.0)
    core.on_reply(stopping(rid), T0 + 0.1)
    core.connection_lost(T0 + 0.2)
    failed = core.expire(T0 + 1.0)
    assert [r for r, _ in failed] == [rid]
    assert str(failed[0][1]) == "stopping"


def test_a_request_sent_again_teaches_no_latency() -> None:
    core = ClientCore()
    learnt(core, 0.1)
    rid, _ = core.request(T0, "m", {"x": X}, 5.0)
    core.connection_lost(T0 + 0.1)
    assert core.outgoing(T0 + 3.0) is not None
    core.took()
    core.on_reply(reply(rid), T0 + 3.1)
    assert core.resend.needed_s("m") == pytest.approx(0.1)
    learnt(core, 0.2)
    assert core.resend.needed_s("m") == pytest.approx(0.1 + 0.2 * 0.1)


def test_cancel_sends_cancel_and_the_brokers_answer_settles_it() -> None:
    core = ClientCore()
    rid, _ = core.request(T0, "m", {"x": X}, 2.0)
    assert core.cancel(rid) is None
    frames = core.outgoing(T0)
    assert frames is not None
    assert parse_header(frames[0]) is Command.CANCEL
    assert Cancel.from_wire(decode_meta(frames[1])) == Cancel(rid, core.resend.nonce)
    core.took()
    assert core.resend.cancels == 1
    assert core.cancel(rid) is None
    assert core.outgoing(T0) is None
    cancelled = encode_error(ErrorReply(rid, ErrorCode.CANCELLED, "cancelled"))
    got, error = core.on_reply(cancelled, T0 + 0.1)
    assert got == rid
    assert isinstance(error, Cancelled)
    assert core.cancel(rid) is None  # answered: nothing to do


def test_cancel_of_a_request_at_no_broker_answers_it_at_once() -> None:
    core = ClientCore()
    queued, _ = core.request(T0, "m", {"x": X}, 2.0)
    refused, _ = core.request(T0, "m", {"x": X}, 2.0)
    core.on_reply(stopping(refused), T0)
    core.connection_lost(T0 + 0.1)  # (both wait for the socket now)
    for rid in (queued, refused):
        error = core.cancel(rid)
        assert isinstance(error, Cancelled)
        assert rid not in core.pending
    assert core.outgoing(T0 + 0.2) is None


def test_a_cancelled_request_whose_connection_is_lost_is_cancelled_not_sent_again() -> None:
    core = ClientCore()
    rid, _ = core.request(T0, "m", {"x": X}, 2.0)
    core.cancel(rid)
    failed: list[tuple[int, RequestError]] = core.connection_lost(T0 + 0.1)
    assert [r for r, _ in failed] == [rid]
    assert isinstance(failed[0][1], Cancelled)
    assert core.outgoing(T0 + 0.1) is None


def test_a_request_lost_twice_keeps_one_place_in_the_outbox() -> None:
    core = ClientCore()
    rid, _ = core.request(T0, "m", {"x": X}, 2.0)
    core.connection_lost(T0 + 0.1)
    core.connection_lost(T0 + 0.2)
    assert core.outgoing(T0 + 0.3) is not None
    core.took()
    assert core.outgoing(T0 + 0.3) is None
    core.connection_lost(T0 + 0.4)  # lost again after it was sent: queued again
    again = core.outgoing(T0 + 0.5)
    assert again is not None
    assert submit_of(again).timeout_ms == 1500
    assert codec.unpack(again[1])["id"] == rid


def test_a_request_waiting_to_be_sent_again_at_its_local_deadline_fails_as_lost() -> None:
    """A client busy past a request's give-up (a blocking submit waiting for room) finds
    it at its local deadline: it failed because the connection closed, not for want of
    a reply from a broker that never had it."""
    core = ClientCore(grace_s=0.5)
    lost_rid, _ = core.request(T0, "m", {"x": X}, 1.0)
    refused_rid, _ = core.request(T0, "m", {"x": X}, 1.0)
    core.on_reply(stopping(refused_rid), T0)
    core.connection_lost(T0 + 0.1)
    failed = dict(core.expire(T0 + 2.0))
    assert set(failed) == {lost_rid, refused_rid}
    assert "connection to the broker closed" in str(failed[lost_rid])
    assert str(failed[refused_rid]) == "stopping"
    assert not core.pending
    assert not core.resend.kept


def test_every_row_of_the_stage_table_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: set[tuple[Stage, Event]] = set()
    move = Kept.move

    def recording(self: Kept, event: Event) -> None:
        seen.add((self.stage, event))
        move(self, event)

    def send_all(now: float) -> None:
        while core.outgoing(now) is not None:
            core.took()  # QUEUED -> SENT

    monkeypatch.setattr(Kept, "move", recording)
    core = ClientCore()
    refused, _ = core.request(T0, "m", {"x": X}, 5.0)
    lost, _ = core.request(T0, "m", {"x": X}, 5.0)
    core.on_reply(stopping(refused), T0)  # SENT -> QUEUED
    core.switched(T0)
    send_all(T0)
    core.retiring_lost(T0 + 0.1)  # SENT -> QUEUED (lost)
    assert core.resend.kept[lost].stage is Stage.QUEUED
    core.on_reply(stopping(refused), T0 + 0.1)  # on trial: SENT -> PARKED
    core.connection_lost(T0 + 0.1)  # PARKED -> QUEUED, QUEUED -> QUEUED
    send_all(T0 + 0.2)
    core.on_reply(stopping(refused), T0 + 0.2)  # SENT -> QUEUED, leaving
    core.switched(T0 + 0.2)
    send_all(T0 + 0.2)
    core.on_reply(stopping(refused), T0 + 0.3)  # on trial: SENT -> PARKED
    answered, _ = core.request(T0 + 0.3, "m", {"x": X}, 5.0)
    core.on_reply(reply(answered), T0 + 0.3)  # the trial ends
    other, _ = core.request(T0 + 0.3, "m", {"x": X}, 5.0)
    core.on_reply(stopping(other), T0 + 0.4)  # SENT -> QUEUED, leaving
    core.switched(T0 + 0.4)  # PARKED -> QUEUED (left)
    assert seen == set(NEXT_STAGE)
    with pytest.raises(KeyError):  # not in the table: a QUEUED one was sent on no connection
        core.resend.kept[other].move(Event.REFUSED)
    send_all(T0 + 0.5)
    with pytest.raises(KeyError):  # nor is a SENT one taken
        core.resend.kept[other].move(Event.TAKEN)


def test_shared_memory_stays_held_through_a_resend_until_the_answer() -> None:
    from carpool.common.shm import ShmArena, available

    if not available():
        pytest.skip("no usable /dev/shm")
    arena = ShmArena(8192)
    core = ClientCore(arena=arena, shm_min_bytes=1024)
    try:
        big = np.zeros((1, 1536), np.float32)
        rid, frames = core.request(T0, "m", {"x": big}, 2.0)
        held = arena.used_bytes
        assert held > 0
        core.connection_lost(T0 + 0.1)
        again = core.outgoing(T0 + 0.1)
        assert again is not None
        assert submit_of(again).shm == submit_of(frames).shm  # the same place, still held
        core.took()
        assert arena.used_bytes == held
        core.on_reply(reply(rid), T0 + 0.2)
        assert arena.used_bytes == 0
        # And given back when one waiting to be sent again runs out of budget.
        rid, _ = core.request(T0, "m", {"x": big}, 1.0)
        core.connection_lost(T0 + 0.1)
        assert [r for r, _ in core.expire(T0 + 1.0)] == [rid]
        assert arena.used_bytes == 0
    finally:
        arena.close()
