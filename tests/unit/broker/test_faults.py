"""What the core's count of writes shows after a fault inside it (faults.py): a client
message that went past its checks counts before its first write, so a fault anywhere
after that point stops the broker instead of being answered as harmless; and the
answer to a harmless one (a CANCEL gets none). Uses harness.py."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from carpool.broker.batcher import RequestQueue
from carpool.broker.replies import Side
from carpool.common.errors import ErrorCode
from tests.unit.broker.harness import C1, T0, W1, Broker, parse


def _fail(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("injected fault")


@pytest.mark.parametrize("where", ["queue", "order"])
def test_a_fault_after_a_request_went_past_its_checks_counts_as_a_change(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first writes of queueing a request (its queue, the model's queue order) come
    before the request book's: the intake's count covers them."""
    b = Broker.make(max_batch=4)
    b.ready(T0, W1)
    if where == "queue":
        monkeypatch.setattr(RequestQueue, "arrive", _fail)
    else:
        monkeypatch.setattr(b.core.backlog.order, "arrived", _fail)
    mark = b.core.changes()
    with pytest.raises(RuntimeError, match="injected fault"):
        b.core.on_client(T0, C1, b.request_frames(1))
    assert b.core.changes() != mark  # not harmless: the broker stops


def test_a_fault_before_any_write_leaves_the_count_and_is_answered_internal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = Broker.make(max_batch=4)
    b.ready(T0, W1)
    monkeypatch.setattr("carpool.broker.intake.layout_of", _fail)
    mark = b.core.changes()
    frames = b.request_frames(7)
    with pytest.raises(RuntimeError, match="injected fault"):
        b.core.on_client(T0, C1, frames)
    assert b.core.changes() == mark
    (answer,) = [parse(o) for o in b.core.on_fault(T0, Side.FRONTEND, C1, frames)]
    assert (answer.rid, answer.code) == (7, ErrorCode.INTERNAL)


def test_a_cancel_whose_handling_failed_is_not_answered() -> None:
    """Its id is the cancelled request's, whose own answer is still to come."""
    b = Broker.make()
    cancel = [b"CP\x01\x05", msgpack.packb({"id": 5, "client": b"n" * 16})]
    assert b.core.on_fault(T0, Side.FRONTEND, C1, cancel) == []


def test_a_fault_in_the_decoder_is_answered_internal_with_its_id_after_the_delimiter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answer reads the header and the meta itself, not through the decoder that
    failed: a REQ client gets its empty delimiter (else its socket drops the answer) and
    a DEALER client its request's id."""
    b = Broker.make(max_batch=4)
    b.ready(T0, W1)
    monkeypatch.setattr("carpool.common.protocol.from_client.decode_request", _fail)
    frames = [b"", *b.request_frames(7)]
    with pytest.raises(RuntimeError, match="injected fault"):
        b.core.on_client(T0, C1, frames)
    (answer,) = [parse(o) for o in b.core.on_fault(T0, Side.FRONTEND, C1, frames)]
    assert (answer.rid, answer.code, answer.delimited) == (7, ErrorCode.INTERNAL, True)
