"""dispatched.py: a BATCH as the dispatcher hands it to a worker's transport — pure.

A :class:`DispatchedBatch` holds the batch's requests; its transport asks for one form:
:meth:`~DispatchedBatch.to_message`, the typed :class:`BrokerBatch` (for a worker in the
broker's process, no msgpack), or :meth:`~DispatchedBatch.to_frames`, that message's
frames (for a socket), encoded straight from the requests by the encoders the typed
message uses (:func:`~carpool.common.protocol.worker_messages.item_wire`,
:func:`~carpool.common.protocol.worker_messages.batch_frames`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.broker.requests import PendingRequest, RequestKey
from carpool.common.protocol import BatchItem, BatchMeta, BrokerBatch, Frame, TensorMeta
from carpool.common.protocol.worker_messages import batch_frames, item_wire


def batch_inputs(key: RequestKey) -> tuple[TensorMeta, ...]:
    """A queue key's BATCH ``inputs``: its tensors with dim 0 = -1."""
    return tuple(TensorMeta(name, dtype, (-1, *shape)) for name, dtype, shape in key[1])


@dataclass(slots=True)
class DispatchedBatch:
    """One BATCH to one worker: ``requests`` in batch order, their ``payloads``
    request-major, ``sent_s`` the dispatch time (each request's queue time ends there),
    ``inputs_wire`` the wire form of ``inputs`` where the caller keeps it (None: made
    here). (Not frozen, for speed: docs/benchmarks.md "Why the hot path looks as it does".)"""

    batch_id: int
    model: str
    inputs: tuple[TensorMeta, ...]
    requests: Sequence[PendingRequest]
    payloads: Sequence[Frame]
    sent_s: float
    inputs_wire: list[dict[str, Any]] | None = None

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
        meta = BatchMeta(self.batch_id, self.model, self.inputs, items)
        return BrokerBatch(meta, self.payloads)

    def to_frames(self) -> list[Any]:
        """The frames of :meth:`to_message`'s message, without building it."""
        sent_s = self.sent_s
        items = [
            item_wire(
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
        inputs = self.inputs_wire
        if inputs is None:
            inputs = [t.to_wire() for t in self.inputs]
        return batch_frames(self.batch_id, self.model, inputs, items, self.payloads)
