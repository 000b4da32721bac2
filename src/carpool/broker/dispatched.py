"""dispatched.py: a BATCH as the dispatcher hands it to a worker's transport — pure.

A :class:`DispatchedBatch` holds the batch's requests; its transport asks for one form:
:meth:`~DispatchedBatch.to_frames` for a socket, or :meth:`~DispatchedBatch.to_message`,
the typed :class:`BrokerBatch`, for a worker in the broker's process (no msgpack). Both
take each request's BATCH item fields in one place (:meth:`~DispatchedBatch.items`);
the socket's form passes them straight to the item's encoder, with no :class:`BatchItem`
per request on that path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from carpool.broker.requests import PendingRequest, RequestKey
from carpool.common.protocol import (
    BatchItem,
    BatchMeta,
    BrokerBatch,
    Frame,
    ShmRef,
    TensorMeta,
    batch_frames,
    batch_item_wire,
    batch_wire,
)

Item = TypeVar("Item")

#: Builds one BATCH item from a :class:`BatchItem`'s fields, in their order.
ItemOf = Callable[
    [
        int,
        int,
        bool,
        float,
        tuple[ShmRef | None, ...] | None,
        bool,
        tuple[tuple[int, ...], ...] | None,
    ],
    Item,
]


@dataclass(frozen=True, slots=True)
class BatchInputs:
    """A queue key's BATCH ``inputs`` (dim 0 = -1), typed and in wire form, built once
    per key."""

    metas: tuple[TensorMeta, ...]
    wire: list[dict[str, Any]]

    @classmethod
    def of(cls, key: RequestKey) -> BatchInputs:
        metas = tuple(TensorMeta(name, dtype, (-1, *shape)) for name, dtype, shape in key[1])
        return cls(metas, [t.to_wire() for t in metas])


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

    def items(self, item_of: ItemOf[Item]) -> list[Item]:
        """One BATCH item per request, by ``item_of``: :class:`BatchItem` or its encoder."""
        sent_s = self.sent_s
        return [
            item_of(
                r.request_id,
                r.samples,
                r.simple,
                1000.0 * (sent_s - r.arrival_s),
                r.refs,
                r.shm_outputs,
                r.shapes,
            )
            for r in self.requests
        ]

    def to_frames(self) -> list[Any]:
        items = self.items(batch_item_wire)
        return batch_frames(
            batch_wire(self.batch_id, self.model, self.inputs.wire, items), self.payloads
        )

    def to_message(self) -> BrokerBatch:
        items = tuple(self.items(BatchItem))
        meta = BatchMeta(self.batch_id, self.model, self.inputs.metas, items)
        return BrokerBatch(meta, self.payloads)
