"""core.py with shared-memory inputs (protocol §5.4): the broker checks a reference and
carries it into BATCH; it never opens a region. Uses harness.py."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.common.errors import ErrorCode
from carpool.common.protocol import Command
from tests.unit.broker.harness import (
    A_PAYLOAD,
    B_PAYLOAD,
    C1,
    SHM_KEY,
    SPEC2,
    T0,
    W1,
    Broker,
    answer,
    batches,
    ids,
    raw_request,
    shm_request,
)

B, A, KEY = B_PAYLOAD, A_PAYLOAD, SHM_KEY


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_references_ride_in_batch_in_spec_order_next_to_inline_requests(warm: bool) -> None:
    b = Broker.make(max_batch=3, max_wait_s=1.0)
    b.ready(T0, W1, SPEC2, slots=2)
    if warm:  # an inline request first: its layout is cached and the rest take the fast path
        b.client(T0, C1, raw_request(1))
    else:  # a shared-memory request first: the full path admits it
        b.client(T0, C1, shm_request(1, 64))
    b.client(T0, C1, shm_request(2, 128))
    (msg,) = batches(b.client(T0, C1, raw_request(3)))
    assert ids(msg) == [1, 2, 3]
    refs = [item.shm for item in msg.batch.items]
    first = None if warm else (("carpool-7-c1", 64, KEY), None)
    assert refs == [first, (("carpool-7-c1", 128, KEY), None), None]
    # Frames stay per request in spec order (a, b); an input in shared memory has an
    # empty frame, forwarded like any other.
    sent = [bytes(p) for p in msg.payloads]
    assert sent[2:] == [b"", B, A, B]
    assert sent[:2] == ([A, B] if warm else [b"", B])


@pytest.mark.parametrize(
    "changes",
    [
        {"payloads": [B, A]},  # in shared memory and in the frame: which?
        {"ref": {"region": "/etc/passwd", "offset": 64, "key": KEY}},
        {"ref": {"region": "carpool-x", "offset": -1, "key": KEY}},
        {"ref": {"region": "carpool-x", "key": KEY}},
        {"ref": {"region": "carpool-x", "offset": 64}},
        {"ref": {"region": "carpool-x", "offset": 64, "key": 5}},
        {"ref": "carpool-x"},
        # A worker's output ring is no input (§5.4): a worker that trusts the broker's
        # checks would read another client's outputs for this one.
        {"ref": {"region": "carpool-out-1234-abcd", "offset": 64, "key": KEY}},
        {"payloads": [b"\x01", b""]},  # the inline input is still checked
    ],
)
def test_bad_references_are_invalid_arguments_warm_or_cold(changes: dict[str, Any]) -> None:
    warm, cold = Broker.make(max_batch=8, max_wait_s=0.0), Broker.make(max_batch=8, max_wait_s=0.0)
    for b in (warm, cold):
        b.ready(T0, W1, SPEC2, slots=2)
    warm.client(T0, C1, raw_request(1))
    warm.client(T0, C1, shm_request(2))  # both layouts seen
    frames = shm_request(5, **changes)
    expected = [(Command.ERROR, 5, int(ErrorCode.INVALID_ARGUMENT))]
    assert answer(warm, frames) == answer(cold, frames) == expected


def test_nil_reference_means_the_bytes_are_in_the_frame() -> None:
    b = Broker.make(max_batch=1, max_wait_s=0.0)
    b.ready(T0, W1, SPEC2, slots=2)
    (msg,) = batches(b.client(T0, C1, shm_request(4, ref=None, payloads=[B, A])))
    assert msg.batch.items[0].shm is None
    assert [bytes(p) for p in msg.payloads] == [A, B]


def test_a_shared_memory_input_may_not_claim_more_than_the_limit() -> None:
    """An empty frame costs nothing, so the size a reference claims (a dynamic dim)
    is bounded at the door, on the cold and the warm path."""
    from carpool.common.shm import MAX_REF_BYTES

    b = Broker.make(max_batch=1, max_wait_s=0.0)
    b.ready(T0, W1, SPEC2, slots=2)
    huge = MAX_REF_BYTES // 4 + 1  # float32 items: one byte over the limit
    ref = {"region": "carpool-x", "offset": 64, "key": KEY}
    inputs: list[dict[str, Any]] = [
        {"name": "b", "dtype": "uint8", "shape": [1, 2]},
        {"name": "a", "dtype": "float32", "shape": [1, huge], "shm": ref},
    ]
    frames = raw_request(1, inputs=inputs, payloads=[B, b""])
    assert answer(b, frames) == [(Command.ERROR, 1, int(ErrorCode.INVALID_ARGUMENT))]
    inputs[1]["shape"] = [1, huge - 1]  # at the limit: admitted
    (msg,) = batches(b.client(T0, C1, raw_request(2, inputs=inputs, payloads=[B, b""])))
    assert ids(msg) == [2]
    # One byte more again, now that the layout's model and names are known: still no.
    inputs[1]["shape"] = [1, huge]
    assert answer(b, raw_request(3, inputs=inputs, payloads=[B, b""])) == [
        (Command.ERROR, 3, int(ErrorCode.INVALID_ARGUMENT))
    ]


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_shm_outputs_rides_in_batch(warm: bool) -> None:
    b = Broker.make(max_batch=3, max_wait_s=1.0)
    b.ready(T0, W1, SPEC2, slots=2)
    b.client(T0, C1, raw_request(1, **({"shm_outputs": True} if not warm else {})))
    b.client(T0, C1, raw_request(2, shm_outputs=True))
    (msg,) = batches(b.client(T0, C1, raw_request(3, shm_outputs=False)))
    assert [i.shm_outputs for i in msg.batch.items] == [not warm, True, False]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_bad_shm_outputs_is_invalid_warm_or_cold(value: Any) -> None:
    warm, cold = Broker.make(max_batch=8, max_wait_s=0.0), Broker.make(max_batch=8, max_wait_s=0.0)
    for b in (warm, cold):
        b.ready(T0, W1, SPEC2, slots=2)
    warm.client(T0, C1, raw_request(1))
    frames = raw_request(5, shm_outputs=value)
    expected = [(Command.ERROR, 5, int(ErrorCode.INVALID_ARGUMENT))]
    assert answer(warm, frames) == answer(cold, frames) == expected
