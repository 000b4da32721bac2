"""dispatched.py: a BATCH as the dispatcher hands it to a worker's transport — pure.

A :class:`DispatchedBatch` holds the batch's requests; its transport asks for one form:
:meth:`~DispatchedBatch.to_frames` builds the BATCH meta straight from the requests for a
socket (the hot path: no :class:`BatchItem` per request), and
:meth:`~DispatchedBatch.to_message` builds the typed :class:`BrokerBatch` for a worker in
the broker's process (no msgpack either way). Both use the protocol's BATCH encoders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.broker.requests import PendingRequest, RequestKey
from carpool.common.protocol import (
    BatchItem,
    BatchMeta,
    BrokerBatch,
    Frame,
    TensorMeta,
    batch_frames,
    batch_inputs_wire,
    batch_item_wire,
    batch_wire,
)


@dataclass(frozen=True, slots=True)
class BatchInputs:
    """A queue key's BATCH ``inputs`` (dim 0 = -1), in both forms, built once per key."""

    metas: tuple[TensorMeta, ...]
    wire: list[dict[str, Any]]

    @classmethod
    def of(cls, key: RequestKey) -> BatchInputs:
        metas = tuple(TensorMeta(name, dtype, (-1, *shape)) for name, dtype, shape in key[1])
        return cls(metas, batch_inputs_wire(metas))


@dataclass(slots=True)
class DispatchedBatch:
    """One BATCH to one worker: ``requests`` in batch order, their ``payloads``
    request-major, ``sent_s`` the dispatch time (each request's queue time ends there).
    (Not frozen: one is made per batch.)"""

    batch_id: int
    model: str
    inputs: BatchInputs
    requests: Sequence[PendingRequest]
    payloads: Sequence[Frame]
    sent_s: float

    def to_frames(self) -> list[Any]:
        sent_s = self.sent_s
        items = [
            batch_item_wire(
                r.request_id,
                r.samples,
                r.simple,
                1000.0 * (sent_s - r.arrival_s),
                r.shm,
                r.shm_outputs,
                r.shapes,
            )
            for r in self.requests
        ]
        return batch_frames(
            batch_wire(self.batch_id, self.model, self.inputs.wire, items), self.payloads
        )

    def to_message(self) -> BrokerBatch:
        sent_s = self.sent_s
        items = tuple(
            BatchItem(
                r.request_id,
                r.samples,
                r.simple,
                1000.0 * (sent_s - r.arrival_s),
                r.refs,
                r.shm_outputs,
                r.shapes,
            )
            for r in self.requests
        )
        return BrokerBatch(
            BatchMeta(self.batch_id, self.model, self.inputs.metas, items), self.payloads
        )
