"""client/resend.py through ClientCore: which requests are sent again after a lost
connection or an UNAVAILABLE with retry, with what budget, and what a cancel does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool.client.core import ClientCore, InferResult
from carpool.client.resend import NEXT_STAGE, UNKNOWN_LATENCY_S, Event, Kept, Stage
from carpool.common import codec
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


def test_unavailable_with_retry_is_sent_again_only_on_the_next_connection() -> None:
    core = ClientCore()
    rid, _ = core.request(T0, "m", {"x": X}, 2.0)
    got, error = core.on_reply(stopping(rid), T0 + 0.1)
    assert got is None
    assert isinstance(error, Unavailable)
    assert rid in core.pending
    assert core.resend.kept[rid].stage is Stage.PARKED
    assert core.outgoing(T0 + 0.2) is None  # not on the connection that refused it
    assert core.connection_lost(T0 + 0.3) == []
    again = core.outgoing(T0 + 0.4)
    assert again is not None
    assert submit_of(again).request_id == rid
    assert submit_of(again).timeout_ms == 1600
    core.took()
    assert core.on_reply(reply(rid), T0 + 0.5)[0] == rid


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

    monkeypatch.setattr(Kept, "move", recording)
    core = ClientCore()
    refused, _ = core.request(T0, "m", {"x": X}, 5.0)
    lost, _ = core.request(T0, "m", {"x": X}, 5.0)
    core.on_reply(stopping(refused), T0)  # SENT -> PARKED
    core.connection_lost(T0 + 0.1)  # PARKED -> QUEUED, SENT -> QUEUED
    core.connection_lost(T0 + 0.2)  # QUEUED -> QUEUED
    while core.outgoing(T0 + 0.3) is not None:
        core.took()  # QUEUED -> SENT
    assert seen == set(NEXT_STAGE)
    with pytest.raises(KeyError):
        core.resend.kept[lost].move(Event.TAKEN)  # not in the table: SENT does not take


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
