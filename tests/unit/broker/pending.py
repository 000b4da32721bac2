"""A PendingRequest as the broker's unit tests build one: model "m", one float32 input
"x" of [samples, 4], its payload frame in place."""

from __future__ import annotations

from carpool.broker.batcher import ClientId, PendingRequest, request_key
from carpool.common.protocol import Priority, TensorMeta


def pending_request(
    seq: int,
    samples: int = 1,
    deadline_s: float = 100.0,
    arrival_s: float = 0.0,
    priority: Priority = Priority.INTERACTIVE,
    nbytes: int = 0,
) -> PendingRequest:
    inputs = (TensorMeta("x", "float32", (samples, 4)),)
    return PendingRequest(
        seq=seq,
        client=ClientId(b"c"),
        delimited=False,
        request_id=seq,
        simple=False,
        model="m",
        key=request_key("m", inputs),
        samples=samples,
        priority=priority,
        arrival_s=arrival_s,
        deadline_s=deadline_s,
        payloads=[bytes(16 * samples)],
        nbytes=nbytes,
    )
