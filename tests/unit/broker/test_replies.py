"""replies.py: the core's error replies as functions over the stats they are counted in:
in the form the client's message came in (after a REQ socket's delimiter, framed or
simple), a refusal counted among its model's refusals only when the door says so, and
INTERNAL for a message whose handling failed (a CANCEL gets none)."""

from __future__ import annotations

from carpool.broker import replies
from carpool.broker.replies import Refused
from carpool.broker.requests import ClientId
from carpool.broker.stats import BrokerStats, Notes
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Cancel,
    Command,
    Request,
    Submit,
    TensorMeta,
    decode_from_client,
    encode_request,
    encode_simple_request,
    header,
)
from carpool.common.protocol import frames as codec
from tests.unit.broker.pending import pending_request

CLIENT = ClientId(b"c1")
SUBMIT = Submit(7, "m", 100, (TensorMeta("x", "uint8", (1, 2)),))


def test_an_error_is_counted_and_framed_after_the_delimiter_if_there_was_one() -> None:
    stats = BrokerStats()
    plain = replies.error(stats, CLIENT, False, 3, ErrorCode.NOT_FOUND, "no")
    delimited = replies.error(stats, CLIENT, True, 3, ErrorCode.NOT_FOUND, "no")
    assert plain.frames[0] == header(Command.ERROR)
    assert list(delimited.frames[:2]) == [b"", header(Command.ERROR)]
    assert codec.unpack(plain.frames[1]) == {
        "id": 3,
        "code": int(ErrorCode.NOT_FOUND),
        "message": "no",
    }
    assert stats.errors["NOT_FOUND"] == 2


def test_a_refusal_answers_in_the_requests_form_and_counts_only_what_the_door_counts() -> None:
    stats = BrokerStats()
    request = decode_from_client([encode_simple_request(SUBMIT, [b"ab"])])
    assert isinstance(request, Request)
    full = Refused(ErrorCode.OVERLOADED, "broker queue full", 20)
    (frame,) = replies.refusal(stats, CLIENT, request, full).frames
    assert codec.unpack(frame)["error"] == {
        "code": int(ErrorCode.OVERLOADED),
        "message": "broker queue full",
        "retry_after_ms": 20,
    }
    unknown = Refused(ErrorCode.NOT_FOUND, "no such model", counted=False)
    replies.refusal(stats, CLIENT, request, unknown)
    assert stats.errors == {"OVERLOADED": 1, "NOT_FOUND": 1}
    assert stats.refusals == {"m": {"OVERLOADED": 1}}


def test_a_held_requests_error_is_noted_and_counted_as_its_models_failure() -> None:
    notes, stats = Notes(), BrokerStats()
    answer = replies.request_error(notes, pending_request(4), ErrorCode.UNAVAILABLE, "gone")
    assert codec.unpack(answer.frames[1])["id"] == 4
    assert notes.failed == [("m", "UNAVAILABLE")]
    assert not stats.errors  # (the core counts the notes: BrokerStats.take)
    stats.take(notes)
    assert stats.errors["UNAVAILABLE"] == 1
    assert stats.model_errors == {"m": {"UNAVAILABLE": 1}}
    assert notes.failed == []  # taken once
    stats.take(notes)
    assert stats.errors["UNAVAILABLE"] == 1


def test_internal_names_what_it_can_read_and_never_answers_a_cancel() -> None:
    stats = BrokerStats()
    framed = replies.internal_error(stats, CLIENT, [b"", *encode_request(SUBMIT, [b"ab"])])
    assert framed is not None
    assert framed.frames[0] == b""
    assert codec.unpack(framed.frames[2])["id"] == 7
    simple = replies.internal_error(stats, CLIENT, [encode_simple_request(SUBMIT, [b"ab"])])
    assert simple is not None
    assert codec.unpack(simple.frames[0])["id"] == 7
    unreadable = replies.internal_error(stats, CLIENT, [b"junk"])
    assert unreadable is not None
    assert codec.unpack(unreadable.frames[1])["id"] is None
    assert replies.internal_error(stats, CLIENT, Cancel(7, b"n" * 16).to_frames()) is None
    assert stats.errors["INTERNAL"] == 3
